"""zero's state saved by orbax is read by the plan that laid it out, not by the first that fits.

Stages 1-2 (``plan_buckets``: parameters in reverse, as torch's reducer) and stage 3
(``zero3_plan``: forward order) cut a small model into buckets of the same lengths in another order,
so a save that holds the params whole (a stage-3 run that saved ``unshard_params``) cannot be told
apart by its shapes. ``ZeroState.plan_tag`` (the plan fingerprint's first 32 bits, an array leaf that
orbax writes) says which plan it is. A save without it (made before ``ZeroState`` kept it) is read
where its buckets tell one layout, and refused, naming both plans, where they do not, until the
reader is told ``zero_stage``.

The oracle: plain optax run the same way and saved by orbax, whose state is named by parameter (no
layout to recognise), loaded into the same target. zero and plain optax sum the float32 mean of the
gradient in another order, so the loaded moments agree within rtol 1.3e-6, atol 5e-5 (the project's
float32 same-framework tolerance); a state read by the wrong plan puts one parameter's moments on
another and misses by orders of magnitude.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import CheckpointError, open_checkpoint
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint.orbax._zero_layout import bucket_runs, candidate_plans, leaves_of
from hybrid.cli import main
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


def _target(params=None):
    """A zero stage-1 state at 2 devices to load into."""
    mesh = _mesh(2)
    tx = hj.zero(optax.adam(1e-2), AXIS, stage=1, mesh=mesh)
    params = jax.device_put(_params() if params is None else params, NamedSharding(mesh, P()))
    return params, jax.jit(tx.init)(params)


@functools.cache
def _runs():
    """``(zero stage 3's params and state, plain optax's)``: 3 steps each, on 4 devices."""
    mesh = _mesh(4)
    zero3 = _train(hj.zero(optax.adam(1e-2), AXIS, stage=3, mesh=mesh), hj.shard_params(_params(), AXIS, mesh=mesh),
                   hj.gathered(_loss), mesh)
    return zero3, _train(optax.adam(1e-2), jax.device_put(_params(), NamedSharding(mesh, P())), _loss, mesh)


def _save_untagged(path, params, state):
    """What a ZeroState saved before it kept plan_tag was: the same tree without that leaf."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"params": params, "opt_state": {"inner": state.inner}, "step": STEPS})


def test_a_stage_3_state_beside_whole_params_is_read_by_the_stage_3_plan(tmp_path):
    specs = {p: (tuple(x.shape), str(x.dtype)) for p, x in leaves_of(_params()).items()}
    (_, stage12), (_, stage3) = candidate_plans(specs)
    # the premise: by shapes alone the two plans are one; by where each parameter lies, not
    assert [b.length for b in stage12.buckets] == [b.length for b in stage3.buckets]
    assert bucket_runs(stage12) != bucket_runs(stage3) and stage12.tag() != stage3.tag()

    (zparams, zstate), (pparams, pstate) = _runs()
    assert int(zstate.plan_tag) == stage3.tag()
    _save(tmp_path / "zero3", hj.unshard_params(zparams), zstate)
    _save(tmp_path / "plain", pparams, pstate)

    info = open_checkpoint(str(tmp_path / "zero3")).manifest.metadata["zero_layout"]
    assert info["plan"] == stage3.fingerprint() and info["recognised_by"] == "its plan_tag"
    params, state = _target()
    _, got, at = ckpt_jax.load(str(tmp_path / "zero3"), params, state)
    _, want, _ = ckpt_jax.load(str(tmp_path / "plain"), params, state)
    assert at == STEPS and int(got.plan_tag) == int(state.plan_tag)  # the target keeps its own plan's tag
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got.inner, want.inner)
    with pytest.raises(CheckpointError, match=r"opt_state\.plan_tag: zero_stage=1, but the state's plan_tag "
                                              r"0x[0-9a-f]{8} names the plan of zero stage 3"):
        open_checkpoint(str(tmp_path / "zero3"), zero_stage=1)  # the tag decides


def test_an_untagged_state_both_plans_fit_is_refused_until_its_stage_is_named(tmp_path, capsys):
    """A stage-3 state saved before plan_tag, beside whole params: the stages 1-2 and stage 3 plans
    fit its lengths alike and place the parameters differently, so neither is guessed; the error
    (open_checkpoint, load and checkpoint info alike) names the leaf, both plans with their caps,
    and zero_stage, with which it loads (and converts) as the plain optax oracle (TOL: the module's
    note)."""
    (zparams, zstate), (pparams, pstate) = _runs()
    old = str(tmp_path / "old")
    _save_untagged(old, hj.unshard_params(zparams), zstate)
    _save(tmp_path / "plain", pparams, pstate)
    said = (r"old: opt_state\.inner\.0\.mu: zero's flat buckets there carry no plan_tag .* 2 bucket plans .* "
            r"zero stages 1-2 \(plan_buckets, first bucket 1 MiB, then 25 MiB\), plan_tag 0x[0-9a-f]{8}; "
            r"zero stage 3 \(zero3_plan, 1 MiB a bucket\), plan_tag 0x[0-9a-f]{8}\. .*"
            r"open_checkpoint\(path, zero_stage=3\).*--zero-stage 3")
    with pytest.raises(CheckpointError, match=said):
        open_checkpoint(old)
    params, state = _target()
    with pytest.raises(CheckpointError, match=said):
        ckpt_jax.load(old, params, state)
    assert main(["checkpoint", "info", old]) == 1
    assert re.search(said, capsys.readouterr().err)

    _, got, at = ckpt_jax.load(open_checkpoint(old, zero_stage=3), params, state)
    _, want, _ = ckpt_jax.load(str(tmp_path / "plain"), params, state)
    assert at == STEPS
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got.inner, want.inner)
    _, misread, _ = ckpt_jax.load(open_checkpoint(old, zero_stage=1), params, state)  # what first-fit read
    assert not np.allclose(misread.inner[0].mu[0], want.inner[0].mu[0], **TOL)
    assert main(["checkpoint", "info", old, "--zero-stage", "3"]) == 0
    assert "recognised by zero_stage=3 (no plan_tag saved)" in capsys.readouterr().out
    converted = str(tmp_path / "converted")  # convert takes it too, into hybrid's format, read as above
    assert main(["checkpoint", "convert", old, converted, "--to", "hybrid", "--world-size", "2", "--zero-stage", "3"]) == 0
    _, again, _ = ckpt_jax.load(converted, params, state)
    jax.tree.map(np.testing.assert_array_equal, again.inner, got.inner)
    capsys.readouterr()
    assert main(["checkpoint", "info", converted, "--zero-stage", "3"]) == 2  # orbax's option alone
    assert f"--zero-stage is for an orbax save of hybrid.jax.zero's state; {converted} holds a hybrid" \
        in capsys.readouterr().err


@pytest.mark.parametrize("model", ["one plan fits", "plans lay it out alike"])
def test_an_untagged_state_one_layout_fits_loads(model, tmp_path):
    """Without plan_tag and zero_stage, a state still loads where its buckets tell one layout: four
    1 MiB leaves are 2 buckets at stages 1-2 (1 MiB, then 25) and 4 at stage 3 (1 MiB each); a
    lone leaf is one bucket either way. Its moments equal plain Adam's after the same update (the
    same elementwise arithmetic; TOL as the module's)."""
    r = np.random.default_rng(0)
    shapes = {f"w{i}": (256, 1024) for i in range(4)} if model == "one plan fits" else {"w": (8, 4)}
    params = {k: jnp.asarray(r.normal(size=s), jnp.float32) for k, s in shapes.items()}
    grads = {k: jnp.asarray(r.normal(size=s), jnp.float32) for k, s in shapes.items()}
    mesh = _mesh(4)
    tx = hj.zero(optax.adam(1e-2), AXIS, stage=2, mesh=mesh)
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    _, zstate = jax.jit(tx.update)(grads, jax.jit(tx.init)(replicated), replicated)
    _save_untagged(tmp_path / "old", params, zstate)
    _save(tmp_path / "plain", params, optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)[1])

    ckpt = open_checkpoint(str(tmp_path / "old"))
    recognised = ckpt.manifest.metadata["zero_layout"]["recognised_by"]
    assert recognised == ("the buckets' lengths (no plan_tag saved: " + (
        "the one plan that fits)" if model == "one plan fits" else "the plans that fit lay the parameters out alike)"))
    target, state = _target(params)
    _, got, _ = ckpt_jax.load(ckpt, target, state)
    _, want, _ = ckpt_jax.load(str(tmp_path / "plain"), target, state)
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
