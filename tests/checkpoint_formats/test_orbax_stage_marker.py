"""zero's state saved by orbax is read by the plan that laid it out, not by the first that fits.

Stages 1-2 (``plan_buckets``: parameters in reverse, as torch's reducer) and stage 3
(``zero3_plan``: forward order) cut a small model into buckets of the same lengths in another order,
so a save that holds the params whole (a stage-3 run that saved ``unshard_params``) cannot be told
apart by its shapes. ``ZeroState.plan_tag`` (the plan fingerprint's first 32 bits, an array leaf that
orbax writes) says which plan it is.

The oracle: plain optax run the same way and saved by orbax, whose state is named by parameter (no
layout to recognise), loaded into the same target. zero and plain optax sum the float32 mean of the
gradient in another order, so the loaded moments agree within rtol 1.3e-6, atol 5e-5 (the project's
float32 same-framework tolerance); a state read by the wrong plan puts one parameter's moments on
another and misses by orders of magnitude.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import CheckpointError, open_checkpoint
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint.orbax._zero_layout import bucket_runs, candidate_plans, leaves_of
from tests.checkpoint_formats.test_orbax_manager import _batch, _loss, _mesh, _params  # the same small MLP run

AXIS, STEPS = "data", 3  # AXIS as test_orbax_manager's
TOL = dict(rtol=1.3e-6, atol=5e-5)


def _train(tx, params, loss, mesh):
    @jax.jit
    def step(params, state, x, y):
        u, state = tx.update(jax.grad(loss)(params, x, y), state, params)
        return optax.apply_updates(params, u), state
    state = jax.jit(tx.init)(params)
    for i in range(STEPS):
        params, state = step(params, state, *_batch(i, mesh))
    return params, state


def _save(path, params, state):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"params": params, "opt_state": state, "step": STEPS})


def _target():
    """A zero stage-1 state at 2 devices to load into."""
    mesh = _mesh(2)
    tx = hj.zero(optax.adam(1e-2), AXIS, stage=1, mesh=mesh)
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    return params, jax.jit(tx.init)(params)


def test_a_stage_3_state_beside_whole_params_is_read_by_the_stage_3_plan(tmp_path):
    specs = {p: (tuple(x.shape), str(x.dtype)) for p, x in leaves_of(_params()).items()}
    (_, stage12), (_, stage3) = candidate_plans(specs)
    # the premise: by shapes alone the two plans are one; by where each parameter lies, not
    assert [b.length for b in stage12.buckets] == [b.length for b in stage3.buckets]
    assert bucket_runs(stage12) != bucket_runs(stage3) and stage12.tag() != stage3.tag()

    mesh = _mesh(4)
    zparams, zstate = _train(hj.zero(optax.adam(1e-2), AXIS, stage=3, mesh=mesh),
                             hj.shard_params(_params(), AXIS, mesh=mesh), hj.gathered(_loss), mesh)
    assert int(zstate.plan_tag) == stage3.tag()
    _save(tmp_path / "zero3", hj.unshard_params(zparams), zstate)
    pparams, pstate = _train(optax.adam(1e-2), jax.device_put(_params(), NamedSharding(mesh, P())), _loss, mesh)
    _save(tmp_path / "plain", pparams, pstate)

    info = open_checkpoint(str(tmp_path / "zero3")).manifest.metadata["zero_layout"]
    assert info["plan"] == stage3.fingerprint() and info["recognised_by"] == "its plan_tag"
    params, state = _target()
    _, got, at = ckpt_jax.load(str(tmp_path / "zero3"), params, state)
    _, want, _ = ckpt_jax.load(str(tmp_path / "plain"), params, state)
    assert at == STEPS and int(got.plan_tag) == int(state.plan_tag)  # the target keeps its own plan's tag
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got.inner, want.inner)


def test_a_state_of_another_plan_is_refused_naming_it(tmp_path):
    mesh = _mesh(4)
    tx = hj.zero(optax.adam(1e-2), AXIS, stage=1, mesh=mesh, bucket_cap_bytes=256, first_bucket_cap_bytes=256)
    params, state = _train(tx, jax.device_put(_params(), NamedSharding(mesh, P())), _loss, mesh)
    _save(tmp_path / "caps", params, state)
    with pytest.raises(CheckpointError, match=r"caps: opt_state\.plan_tag: zero's state there is laid out by the "
                                              r"bucket plan tagged 0x[0-9a-f]{8}, which is none of the plans.*"
                                              r"other bucket caps"):
        open_checkpoint(str(tmp_path / "caps"))
