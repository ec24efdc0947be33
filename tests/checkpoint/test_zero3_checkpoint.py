"""A ZeRO-3 checkpoint (hybrid.jax.zero stage 3: ParamShards + the stage-2 state) resumes at another
device count, in stages 1 and 2, and in torch.

Within JAX the tolerance is tests/jax's (rtol 1e-6, atol 2e-7: another device count only changes
the order of float32 additions in the gradient mean); loading moves elements and computes nothing,
so loaded tensors are compared bitwise. Across frameworks it is the parity tolerance of
tests/checkpoint/test_resume.py (losses rtol 1e-5 / atol 1e-6, parameters rtol 1e-4 / atol 1e-5).

The JAX steps here, the uninterrupted run and the resumed ones alike, are compiled with the suite's
XLA:CPU quick code generation (tests/_xla.py: the same program and arithmetic, the parameters the
same within an ulp, in ~60% of the compile time that is most of this file's).
"""

import functools

import jax
import numpy as np
import optax
import pytest

import hybrid.jax as hj
from hybrid.checkpoint import Checkpoint
from hybrid.checkpoint import jax as ckpt_jax
from tests.jax._jax_model import CAPS, make_batch, make_params, shard_map_train
from tests.jax.zero3._zero3_run import cut, mesh_of, stage3_train

SAVE, STOP = 3, 6
SAME = dict(rtol=1e-6, atol=2e-7)
INNER = lambda: optax.adamw(0.05, weight_decay=0.1)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@functools.cache
def stage3_run(world_size=4):
    """4 devices, stage 3: the shards and state after SAVE steps, and the params after STOP."""
    mesh = mesh_of(world_size)
    shards = cut(make_params(), mesh)
    init, step = stage3_train(hj.zero(INNER(), "dp", stage=3), mesh, shards)
    state, saved = init(shards), None
    for i in range(STOP):
        shards, state = step(shards, state, *make_batch(i))
        if i + 1 == SAVE:
            saved = shards, state
    return saved, hj.unshard_params(shards)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("zero3") / "ckpt"
    (shards, state), _ = stage3_run()
    ckpt_jax.save(path, shards, state, step=SAVE, stage=3)
    return path


def test_the_files_hold_the_slices_as_stage_2_does(saved):
    (shards, state), _ = stage3_run()
    ckpt = Checkpoint(saved)
    assert (ckpt.manifest.world_size, ckpt.manifest.stage, ckpt.manifest.step) == (4, 3, SAVE)
    assert ckpt.manifest.plan == shards.layout.layout.plan
    params = ckpt.tensors("params")
    for (path, want) in jax.tree_util.tree_flatten_with_path(hj.unshard_params(shards))[0]:
        np.testing.assert_array_equal(params[hj.key_path_name(path)], np.asarray(want))
    for r in range(4):  # rank r's file: device r's slices, the padding included
        for b, flat in enumerate(state.inner[0].mu):
            lo, hi = shards.layout.shards.shard_range(b, r)
            np.testing.assert_array_equal(ckpt.read(r, f"mu/{b}", 0, hi - lo), np.asarray(flat)[lo:hi])
            np.testing.assert_array_equal(ckpt.read(r, f"params/{b}", 0, hi - lo), np.asarray(shards.buckets[b])[lo:hi])


def _resume_stage3(path, world_size):
    mesh = mesh_of(world_size)
    shards = cut(make_params(seed=9), mesh)  # another start: the load must replace it
    tx = hj.zero(INNER(), "dp", stage=3)
    init, step = stage3_train(tx, mesh, shards)
    shards, state, at = ckpt_jax.load(path, shards, init(shards))
    return shards, state, at, step


@pytest.mark.parametrize("world_size", [2, 3])
def test_resumes_in_stage_3_at_another_device_count(saved, tmp_path, world_size):
    shards, state, at, step = _resume_stage3(saved, world_size)
    assert at == SAVE and shards.layout.shards.world_size == world_size
    (saved_shards, _), final = stage3_run()
    for a, b in zip(_leaves(hj.unshard_params(shards)), _leaves(hj.unshard_params(saved_shards)), strict=True):
        np.testing.assert_array_equal(a, b)
    # Saved again from here, before any step: the same tensors (resharding computes nothing).
    ckpt_jax.save(tmp_path / "again", shards, state, step=at, stage=3)
    for kind in ("params", "mu", "nu"):
        a, b = Checkpoint(saved).tensors(kind), Checkpoint(tmp_path / "again").tensors(kind)
        assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a), kind
    for i in range(SAVE, STOP):
        shards, state = step(shards, state, *make_batch(i))
    for a, b in zip(_leaves(hj.unshard_params(shards)), _leaves(final), strict=True):
        np.testing.assert_allclose(a, b, **SAME)


@pytest.mark.parametrize("stage,world_size", [(1, 1), (2, 3)])
def test_resumes_in_stages_1_and_2(saved, stage, world_size):
    mesh = mesh_of(world_size)
    init, step = shard_map_train(hj.zero(INNER(), "dp", stage=stage, **CAPS), mesh, make_params())
    params, state, at = ckpt_jax.load(saved, make_params(seed=9), init(make_params(seed=9)), **CAPS)
    assert at == SAVE
    for i in range(SAVE, STOP):
        params, state = step(params, state, *make_batch(i))
    for a, b in zip(_leaves(params), _leaves(stage3_run()[1]), strict=True):
        np.testing.assert_allclose(a, b, **SAME)


def test_resumes_in_torch(tmp_path):
    # JAX stage 3 on 3 devices saves at step 6; torch (DDP + ZeRO2, 2 gloo ranks) resumes there
    # and follows JAX's uninterrupted run to step 12.
    # (hybrid.demo's stage 3: the twin MLP over shard_params; test_zero3_crossing.py has the rest.)
    # (The 2 ranks are forked from the test run's preloaded forkserver: tests._procs.torch_world.)
    from hybrid.demo import TrainConfig, train_jax, train_torch
    from tests._procs import torch_world

    jax_run = train_jax(TrainConfig(global_batch_size=48, num_steps=12, stage=3), num_devices=3,
                        save_to=str(tmp_path / "jax3"), save_at=6)
    torch_run = torch_world(train_torch, TrainConfig(global_batch_size=48, num_steps=12, stage=2), world_size=2,
                            resume=str(tmp_path / "jax3"))
    assert torch_run.start_step == 6
    np.testing.assert_allclose(torch_run.losses, jax_run.losses[6:], rtol=1e-5, atol=1e-6)
    for name, value in jax_run.params.items():
        np.testing.assert_allclose(torch_run.params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
