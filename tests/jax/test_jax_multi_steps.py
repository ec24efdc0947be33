"""Gradient accumulation around zero: ``optax.MultiSteps(zero(...), k)``, ``hybrid.jax.MultiSteps``
(the inner update, and so its collectives, on the k-th micro-step only: torch's ``no_sync``) and
``zero(optax.MultiSteps(...), k)``, against the unsharded ``optax.MultiSteps`` at stages 1-3."""

import re
import warnings

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from _jax_model import CAPS, assert_trees_close, loss, make_batch, make_params, reference, shard_map_train

K, MICRO_STEPS = 3, 6
# float32, same framework: a mean of per-device means against one mean (see test_jax_zero.py)
RTOL, ATOL = 1.3e-6, 2e-7
MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))


def _adamw():
    return optax.adamw(1e-2, weight_decay=0.1)


def _reference():
    return reference(optax.MultiSteps(_adamw(), K), make_params(), MICRO_STEPS)


def _stage3(tx):
    """``(init, step, shards)`` of a stage-3 loop: ParamShards, gathered loss, plain jax.grad."""
    shards = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "dp", **CAPS), mesh=MESH, in_specs=P(),
                                   out_specs=P("dp")))(make_params())
    specs = hj.state_specs(tx, shards, "dp", axis_size=MESH.size)
    loss_of_shards = hj.gathered(loss)

    def step(shards, state, x, y):
        u, state = tx.update(jax.grad(loss_of_shards)(shards, x, y), state, shards)
        return optax.apply_updates(shards, u), state

    init = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P("dp"), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(P("dp"), specs, P("dp"), P("dp")),
                                 out_specs=(P("dp"), specs)))
    return init, step, shards


def _run(tx, stage):
    if type(tx) is optax.MultiSteps:  # around zero state_specs warns: its collectives run every micro-step
        with pytest.warns(UserWarning, match="hybrid.jax.MultiSteps"):
            return _run_warned(tx, stage)
    return _run_warned(tx, stage)


def _run_warned(tx, stage):
    if stage == 3:
        init, step, params = _stage3(tx)
    else:
        params = make_params()
        init, step = shard_map_train(tx, MESH, params)
    state, history = init(params), []
    for i in range(MICRO_STEPS):
        params, state = step(params, state, *make_batch(i))
        history.append(hj.unshard_params(params) if stage == 3 else params)
    return history, state


@pytest.mark.parametrize("accumulate", [optax.MultiSteps, hj.MultiSteps], ids=["optax", "hybrid"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_multi_steps_around_zero_equals_optax(accumulate, stage):
    history, state = _run(accumulate(hj.zero(_adamw(), "dp", stage=stage, **({} if stage == 3 else CAPS)), K), stage)
    for i, (got, want) in enumerate(zip(history, _reference())):
        assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"micro-step {i}")
    assert int(state.gradient_step) == MICRO_STEPS // K and int(state.mini_step) == 0


def test_zero_around_multi_steps_equals_optax():
    """The other order: the accumulator holds the reduced gradient's slices (1/N of it per device),
    reduced every micro-step."""
    history, _ = _run(hj.zero(optax.MultiSteps(_adamw(), K), "dp", stage=2, **CAPS), 2)
    for i, (got, want) in enumerate(zip(history, _reference())):
        assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"micro-step {i}")


def _collectives_by_computation(hlo: str) -> dict:
    """``{computation header: number of reduce-scatters and all-gathers}`` of compiled HLO text."""
    out = {}
    for comp in re.split(r"\n(?=(?:ENTRY |%)\S.*\{\s*$)", hlo, flags=re.M):
        n = len(re.findall(r"\b(?:reduce-scatter|all-gather|all-reduce)(?:-start)?\(", comp))
        if n:
            out[comp.split("\n", 1)[0].split("(")[0].strip()] = n
    return out


@pytest.mark.parametrize("accumulate, every_micro_step", [(optax.MultiSteps, True), (hj.MultiSteps, False)],
                         ids=["optax", "hybrid"])
def test_where_the_collectives_run(accumulate, every_micro_step):
    """In the compiled micro-step, optax.MultiSteps runs zero's reduce-scatter and all-gather in the
    entry computation (every micro-step, results dropped unless it is the k-th); hybrid.jax.MultiSteps
    only inside the conditional's branch taken on the k-th micro-step (torch's no_sync)."""
    tx = accumulate(hj.zero(_adamw(), "dp", stage=2, **CAPS), K)
    params = make_params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optax.MultiSteps around zero: the warning this test shows the reason for
        init, step = shard_map_train(tx, MESH, params)
    hlo = step.lower(params, init(params), *make_batch(0)).compile().as_text()
    where = _collectives_by_computation(hlo)
    in_entry = sum(n for name, n in where.items() if name.startswith("ENTRY"))
    assert sum(where.values()) > 0
    if every_micro_step:
        assert in_entry > 0, where
    else:
        assert in_entry == 0, where
        entry = re.search(r"^ENTRY .*?^}", hlo, flags=re.M | re.S).group(0)
        assert "conditional(" in entry


def test_replicated_accumulator_is_named():
    """acc_grads given P() (the specs of a plain optax state) used to fail as 'gradient ... is
    invariant ... take per-device gradients with local_grad' although they were per device."""
    tx = optax.MultiSteps(hj.zero(_adamw(), "dp", stage=2, **CAPS), K)
    params = make_params()
    with pytest.warns(UserWarning, match="hybrid.jax.MultiSteps"):
        specs = hj.state_specs(tx, params, "dp", axis_size=MESH.size)
    assert specs.acc_grads["layers"][0]["weight"] == P("dp")
    wrong = specs._replace(acc_grads=jax.tree.map(lambda s: P(), specs.acc_grads))

    def step(params, state, x, y):
        u, state = tx.update(hj.local_grad(loss, "dp")(params, x, y), state, params)
        return optax.apply_updates(params, u), state

    state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(params)
    state = state._replace(acc_grads=jax.tree.map(lambda a: a[:a.shape[0] // MESH.size], state.acc_grads))
    with pytest.raises(ValueError, match=r"MultiSteps.*acc_grads need P\('dp'\).*state_specs"):
        jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(P(), wrong, P("dp"), P("dp")),
                              out_specs=(P(), wrong)))(params, state, *make_batch(0))
