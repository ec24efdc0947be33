"""The runners' plumbing: progress reaches the caller, a failing rank is reported, bad input refused."""

import dataclasses

import pytest

from hybrid.demo import TrainConfig, spawn_world, train_jax, train_torch_runs


def _fail_on_rank_1(*, progress=None):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ArithmeticError("rank one gives up")
    dist.barrier()  # rank 0 waits for a peer that will never come; the parent must not wait too


def test_progress_reaches_the_caller_once_per_step():
    seen = []
    configs = [TrainConfig(num_steps=3), TrainConfig(num_steps=2, stage=2)]
    results = spawn_world(train_torch_runs, configs, world_size=2, progress=lambda *a: seen.append(a))
    assert [(i, s) for i, s, _ in seen] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [loss for i, _, loss in seen if i == 0] == results[0].losses.tolist()


def test_a_failing_rank_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed:(.|\n)*ArithmeticError: rank one gives up"):
        spawn_world(_fail_on_rank_1, world_size=2, timeout_s=120)


def test_jax_progress_and_too_few_devices():
    seen = []
    r = train_jax(TrainConfig(num_steps=2), num_devices=2, progress=lambda s, loss: seen.append((s, loss)))
    assert seen == list(enumerate(r.losses.tolist()))
    with pytest.raises(ValueError, match="num_devices=64 but JAX sees"):
        train_jax(TrainConfig(num_steps=1), num_devices=64)


def test_config_refuses_weight_decay_without_adamw():
    with pytest.raises(ValueError, match="weight_decay=0.1 needs optimizer='adamw'"):
        dataclasses.replace(TrainConfig(), weight_decay=0.1)
