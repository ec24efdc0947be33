"""Users' own pairs, right the first time: an outsider's GPT pair (tests/parity/_outsider.py) whose
mapping's LayerNorm rules say nothing about how torch computes their gradients.

Oracles: torch's own ``DistributedDataParallel`` (its buckets after the rebuild, through a comm
hook) and the torch side of the parity harness (hybrid's DDP on gloo ranks, whose plan fingerprint
the report compares with the JAX side's).
"""

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist

import hybrid.parity as hp
from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES
from hybrid.demo._torch_run import free_port
from hybrid.jax import gradient_ready_order as jax_ready_order
from hybrid.jax._specs import _Layout
from hybrid.parity._harness import torch_job
from hybrid.parity._run_torch import torch_ddp_buckets
from hybrid.parity._spec import tree_map
from hybrid.torch import gradient_ready_order
from tests.parity import _outsider as o
from tests.parity._world import torch_runs

CAPS = dict(bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_CAP_BYTES)
SGD = hp.OptimizerSpec("sgd", lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def outsider_setup():
    return hp.prepare(o.torch_small, o.flax_small, o.data, steps=3, mapping=o.SMALL_MAPPING, optimizer=SGD)


@pytest.fixture(scope="module")
def outsider_torch(outsider_setup):
    """The torch side at stages 1 and 2 on 2 gloo ranks, both in one world (tests/parity/_world.py;
    ``hp.run`` itself, ranks and JAX side by side, is tests/parity/test_harness.py's subject)."""
    return torch_runs({stage: torch_job(outsider_setup, world_size=2, stage=stage) for stage in (1, 2)})


@pytest.mark.parametrize("stage", [1, 2])
def test_the_outsider_pair_plans_one_plan_in_both_frameworks(stage, outsider_setup, outsider_torch):
    """What ``hp.run`` compares, at 2 torch ranks against 3 JAX devices: the fingerprints were
    DIFFERENT (JAX put each block norm's bias before its weight); the harness now takes torch's
    own order. SGD with momentum: Adam would turn the attention key biases' zero gradients
    (softmax ignores them) into lr-sized steps of each framework's rounding noise (docs/parity.md,
    "Reading a report")."""
    report = hp.compare(outsider_torch[stage], hp.train_jax(outsider_setup, num_devices=3, stage=stage))
    print(f"\n{report.summary()}")
    assert report.labels == ("torch, 2 ranks", "jax, 3 devices") and len(report.losses[1]) == 3
    assert report.plans_match, report.summary()
    hp.assert_parity(report)


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _names(plan):
    return [[plan.specs[m].name for m in b.members] for b in plan.buckets]


def test_without_a_torch_half_the_rules_give_torchs_order(one_rank):
    """A JAX-only run (no torch step to observe) infers the order from JAX's backward and the
    rules: norm-like modules (a 1-D weight and a bias of its shape) count as computed together,
    so the outsider's rules give torch DDP's rebuilt buckets; the order observed by
    hybrid.torch.gradient_ready_order is that too."""
    params, jax_loss = o.flax_wide()
    module, torch_loss = o.torch_wide()
    batch = o.data(0)
    tensors = tree_map(torch.from_numpy, batch)
    pairing = hp.prepare(o.torch_wide, o.flax_wide, o.data, steps=1, mapping=o.WIDE_MAPPING).pairing
    rules_only = dataclasses.replace(pairing, torch_ready=())
    assert set(rules_only.computed_together().values()) == {"norm-like", "rule"}  # the blocks' norms; ln_f by rule
    ready = jax_ready_order(jax_loss, params, batch)
    theirs = torch_ddp_buckets(module, lambda ddp, step: torch_loss(ddp, tensors).backward())  # default caps
    assert len(theirs) == 2  # 6.1 MiB: a 1 MiB first bucket, then the rest
    for p in (rules_only, pairing):
        plan = _Layout.of(params, what="test", order=None, ready_order=ready, pairing=p, **CAPS).plan
        assert _names(plan) == theirs
    observed = gradient_ready_order(module, lambda m, b: torch_loss(m, b), tensors)
    assert observed == [n for bucket in theirs for n in bucket] == list(pairing.torch_ready)
    # what the rules gave before norm-like modules counted: each block norm's bias first
    old = dataclasses.replace(rules_only, pairs=tuple(dataclasses.replace(p, grads_together=bool(p.grads_together))
                                                      for p in rules_only.pairs))
    assert old.torch_ready_order(ready) != tuple(observed)
