"""An orbax ``CheckpointManager`` save of ``hybrid.jax.zero``'s own state, as a user writes it
(``mngr.save(3, args=ocp.args.StandardSave({"params": p, "opt_state": zero_state, "step": 3}))``),
resumed through ``hybrid.checkpoint.jax.load`` at another device count and stage.

The run: a small MLP, 3 steps of ``zero(chain, stage=s, mesh=...)`` under a plain ``jax.jit`` on 4
host devices (the batch sharded ``P("data")``), saved by orbax's manager, loaded at 2 devices into
another stage and stepped 3 more times. The reference is plain optax run the same way (3 steps on
4 devices, 3 on 2): the float32 mean of the gradient is summed in another order on 4 and 2 devices
and in zero's buckets, so results agree within rtol 1.3e-6, atol 5e-5 (the project's float32
same-framework tolerance); loads move elements and compute nothing, so the loaded parameters and
counts are compared exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import CheckpointError, open_checkpoint
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint.orbax import OrbaxCheckpoint
from tests.jax._jax_model import jitted

AXIS, SAVE, MORE = "data", 3, 3
TOL = dict(rtol=1.3e-6, atol=5e-5)
SCHEDULE_COUNT = 5  # the schedule's count, set apart from Adam's (3) before the save


def _tx():
    # AdamW with a schedule's own count beside Adam's: a chain as users write it
    return optax.chain(optax.adamw(1e-2, weight_decay=0.1), optax.scale_by_schedule(lambda c: 1.0 / (1.0 + 0.1 * c)))


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"hidden": {"kernel": jax.random.normal(k1, (8, 16)) * 0.3, "bias": jnp.zeros(16)},
            "out": {"kernel": jax.random.normal(k2, (16, 4)) * 0.3, "bias": jnp.zeros(4)}}


def _loss(p, x, y):
    h = jnp.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return jnp.mean((h @ p["out"]["kernel"] + p["out"]["bias"] - y) ** 2)


def _batch(i, mesh):
    kx, ky = jax.random.split(jax.random.PRNGKey(100 + i))
    x, y = jax.random.normal(kx, (8, 8)), jax.random.normal(ky, (8, 4))
    return jax.device_put((x, y), NamedSharding(mesh, P(AXIS)))


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def _step(tx, loss):
    def step(params, state, x, y):
        u, state = tx.update(jax.grad(loss)(params, x, y), state, params)
        return optax.apply_updates(params, u), state
    return jitted(step)


@functools.cache
def _plain_step():
    """Plain optax's jitted step, made once: on XLA:CPU compiling is most of these tests' time,
    and a new closure compiles again."""
    return _step(_tx(), _loss)


@functools.cache
def _zero_on(stage, num_devices):
    """``(tx, params, step, init)`` of the plain-jit zero loop at ``stage`` on the first
    ``num_devices`` devices, jitted once for every test (the arrays are immutable, and so shared)."""
    mesh = _mesh(num_devices)
    tx = hj.zero(_tx(), AXIS, stage=stage, mesh=mesh)
    if stage == 3:
        params, step = hj.shard_params(_params(), AXIS, mesh=mesh), _step(tx, hj.gathered(_loss))
    else:
        params, step = jax.device_put(_params(), NamedSharding(mesh, P())), _step(tx, _loss)
    return tx, params, step, jax.jit(tx.init)


def _with_schedule_count(state, count):
    def set_count(x):
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=jnp.full_like(x.count, count))
        return x
    return jax.tree.map(set_count, state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def _counts(state):
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, (optax.ScaleByAdamState, optax.ScaleByScheduleState)))
    return [(type(x).__name__, int(x.count)) for x in found
            if isinstance(x, (optax.ScaleByAdamState, optax.ScaleByScheduleState))]


@functools.cache
def _reference():
    """Plain optax: SAVE steps on 4 devices, the schedule count set as the zero run's, MORE on 2."""
    tx, params = _tx(), _params()
    state = tx.init(params)
    for i in range(SAVE + MORE):
        mesh = _mesh(4 if i < SAVE else 2)
        if i == SAVE:
            state = _with_schedule_count(state, SCHEDULE_COUNT)
        params, state = jax.device_put((params, state), NamedSharding(mesh, P()))
        params, state = _plain_step()(params, state, *_batch(i, mesh))
    return params


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(stage)``: ``(root, saved params)`` of the run's manager save at ``stage``, made once
    for the file (loads only read it)."""
    root = tmp_path_factory.mktemp("orbax-manager")

    @functools.cache
    def save(stage):
        return root / f"stage{stage}", _save(str(root / f"stage{stage}"), stage)
    return save


def _save(root, stage):
    """A CheckpointManager save at step SAVE of the zero run at ``stage`` on 4 devices."""
    mesh = _mesh(4)
    _, params, step, init = _zero_on(stage, 4)
    state = init(params)
    for i in range(SAVE):
        params, state = step(params, state, *_batch(i, mesh))
    state = _with_schedule_count(state, SCHEDULE_COUNT)
    saved = hj.unshard_params(params) if stage == 3 else params
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(SAVE, args=ocp.args.StandardSave({"params": params, "opt_state": state, "step": SAVE}))
    return saved


@pytest.mark.parametrize("saved_stage,resumed_stage", [(1, 2), (2, 3), (3, 1), (3, 3)])
def test_manager_save_of_zero_resumes_at_two_devices(saved, saved_stage, resumed_stage):
    root, saved_params = saved(saved_stage)
    mesh = _mesh(2)
    _, params, step, init = _zero_on(resumed_stage, 2)
    where = root / str(SAVE) / ("default" if saved_stage == 2 else "")
    params, state, at = ckpt_jax.load(str(where), params, init(params))
    assert at == SAVE
    whole = hj.unshard_params(params) if resumed_stage == 3 else params
    jax.tree.map(np.testing.assert_array_equal, whole, saved_params)  # a load moves elements only
    assert _counts(state) == [("ScaleByAdamState", SAVE), ("ScaleByScheduleState", SCHEDULE_COUNT)]
    for i in range(SAVE, SAVE + MORE):
        params, state = step(params, state, *_batch(i, mesh))
    whole = hj.unshard_params(params) if resumed_stage == 3 else params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), whole, _reference())


def test_info_lists_the_kept_scalars_and_wrong_directories_are_named(saved, tmp_path, capsys):
    from hybrid.cli.checkpoint import _print_info, describe

    root, _ = saved(1)
    d = describe(open_checkpoint(str(root)))  # the manager's root: its latest step
    assert d["left_out"] == [] and d["zero_layout"]["lengths"] == [8 * 16 + 16 + 16 * 4 + 4]
    assert d["carried_values"] == {"opt_state.inner.1.count": SCHEDULE_COUNT}
    _print_info(d)
    out = capsys.readouterr().out
    assert f"opt_state.inner.1.count = {SCHEDULE_COUNT}" in out and "zero's flat buckets" in out
    root3, _ = saved(3)  # ParamShards saved as they are: info says what they are
    d = describe(open_checkpoint(str(root3)))
    assert "ParamShards" in d["unnamed"] and d["optimizer"]["slots"] == ["mu", "nu"]
    assert d["carried_values"] == {"opt_state.inner.1.count": SCHEDULE_COUNT} and d["left_out"] == []
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointError, match=r"elsewhere: holds no orbax pytree.*\(root/3\) or the item directory"):
        OrbaxCheckpoint(tmp_path / "elsewhere")


def test_zero_layout_doctests():
    import doctest

    from hybrid.checkpoint.orbax import _format, _zero_layout

    for module in (_zero_layout, _format):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0


def test_a_plain_optax_save_keeps_its_schedule_count_in_zero(tmp_path):
    """The issue's case: plain optax saved by orbax, schedule count 5 beside Adam's 3, into zero."""
    tx, params = _tx(), _params()
    state = tx.init(params)
    for i in range(SAVE):
        params, state = _plain_step()(params, state, *_batch(i, _mesh(1)))
    state = _with_schedule_count(state, SCHEDULE_COUNT)
    with ocp.CheckpointManager(str(tmp_path / "mngr")) as mngr:
        mngr.save(SAVE, args=ocp.args.StandardSave({"params": params, "opt_state": state, "step": SAVE}))
    _, zparams, _, zinit = _zero_on(2, 2)
    _, loaded, _ = ckpt_jax.load(str(tmp_path / "mngr" / str(SAVE)), zparams, zinit(zparams))
    assert _counts(loaded) == [("ScaleByAdamState", SAVE), ("ScaleByScheduleState", SCHEDULE_COUNT)]
    _, plain, _ = ckpt_jax.load(str(tmp_path / "mngr"), params, tx.init(params))  # and into plain optax
    assert _counts(plain) == [("ScaleByAdamState", SAVE), ("ScaleByScheduleState", SCHEDULE_COUNT)]


def test_convert_into_a_managers_step_directory_restores_in_orbax(tmp_path):
    """``convert(..., "root/7", to="orbax")`` writes a CheckpointManager's step: its restore(7) finds it."""
    from hybrid.checkpoint import convert

    params = _params()
    tx = optax.adam(1e-2)
    state = tx.init(params)
    params, state = _step(tx, _loss)(params, state, *_batch(0, _mesh(1)))
    ckpt_jax.save(str(tmp_path / "h"), params, state, step=7)
    (tmp_path / "mngr").mkdir()
    convert(str(tmp_path / "h"), str(tmp_path / "mngr" / "7"), to="orbax")
    with ocp.CheckpointManager(str(tmp_path / "mngr")) as mngr:
        assert mngr.latest_step() == 7
        restored = mngr.restore(7, args=ocp.args.StandardRestore())
    assert int(restored["step"]) == 7
    jax.tree.map(np.testing.assert_array_equal, restored["params"], params)  # moved, not computed: exact
    assert open_checkpoint(str(tmp_path / "mngr")).manifest.step == 7


def test_multi_steps_and_apply_if_finite_state_comes_back_as_saved(tmp_path):
    """MultiSteps(zero(chain with optax.apply_if_finite and a schedule)) saved mid-accumulation on 4
    devices: its counters, apply_if_finite's, the schedule's count and the accumulated gradients
    load as saved at 2 devices (moved, not computed: exact), and info lists the scalars as carried."""
    from hybrid.cli.checkpoint import describe

    def make(n):
        mesh = _mesh(n)
        inner = optax.chain(optax.apply_if_finite(optax.adamw(1e-2), 3), optax.scale_by_schedule(lambda c: 1.0))
        tx = optax.MultiSteps(hj.zero(inner, AXIS, stage=2, mesh=mesh), 2)
        return tx, jax.device_put(_params(), NamedSharding(mesh, P()))

    tx, params = make(4)
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    for i in range(3):  # one whole step and half of the next: acc_grads hold a gradient
        grads = jax.grad(_loss)(params, *_batch(i, _mesh(4)))
        state = update(grads, state, params)[1]
    with ocp.CheckpointManager(str(tmp_path / "mngr")) as mngr:
        mngr.save(3, args=ocp.args.StandardSave({"params": params, "opt_state": state, "step": 3}))
    info = describe(open_checkpoint(str(tmp_path / "mngr")))
    carried = info["carried_values"]
    assert carried["opt_state.mini_step"] == 1 and carried["opt_state.gradient_step"] == 1
    assert carried["opt_state.inner_opt_state.inner.0.notfinite_count"] == 0
    assert info["state_arrays"] == ["opt_state.acc_grads.hidden.bias", "opt_state.acc_grads.hidden.kernel",
                                    "opt_state.acc_grads.out.bias", "opt_state.acc_grads.out.kernel"]
    tx2, params2 = make(2)
    _, loaded, _ = ckpt_jax.load(str(tmp_path / "mngr" / "3" / "default"), params2, jax.jit(tx2.init)(params2))
    for field in ("mini_step", "gradient_step"):
        assert int(getattr(loaded, field)) == int(getattr(state, field))
    jax.tree.map(np.testing.assert_array_equal, loaded.acc_grads, state.acc_grads)
    saved_inner, loaded_inner = state.inner_opt_state.inner, loaded.inner_opt_state.inner
    assert int(loaded_inner[0].total_notfinite) == int(saved_inner[0].total_notfinite)
    assert int(loaded_inner[1].count) == int(saved_inner[1].count) == 1
    jax.tree.map(np.testing.assert_array_equal, loaded_inner[0].inner_state[0].mu, saved_inner[0].inner_state[0].mu)


def test_hybrids_own_save_keeps_a_schedule_count_too(tmp_path):
    """The same chain saved by hybrid.checkpoint.jax.save from zero at 4 devices, loaded at 2."""
    _, params, step, init = _zero_on(2, 4)
    params, state = step(params, init(params), *_batch(0, _mesh(4)))
    ckpt_jax.save(str(tmp_path / "h"), params, _with_schedule_count(state, SCHEDULE_COUNT), step=1)
    _, params2, _, init2 = _zero_on(1, 2)
    _, loaded, _ = ckpt_jax.load(str(tmp_path / "h"), params2, init2(params2))
    assert _counts(loaded) == [("ScaleByAdamState", 1), ("ScaleByScheduleState", SCHEDULE_COUNT)]
