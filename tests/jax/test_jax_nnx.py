"""flax NNX state where a params tree goes: ``zero`` at stages 1-3 (``nnx.Optimizer`` at stages 1-2
under ``nnx.jit`` + ``nnx.shard_map`` and under a plain ``nnx.jit`` / ``jax.jit`` over the Mesh,
at stage 3 on a ``hybrid.jax.ShardedModule``, refused on the plain model; the functional ``nnx.split`` / ``nnx.merge`` step
under ``jax.jit``), ``shard_params`` / ``init_shards``, the mapping to the torch twin and checkpoints
that cross to ``TorchGPT`` and the linen ``FlaxGPT``.

The model is :class:`hybrid.models.NNXGPT` (embeddings, LayerNorm, attention, MLP, written in the
NNX idiom); the oracle the unsharded ``nnx.Optimizer`` with the same optax transform.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import plan_buckets, shard_flat
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig, NNXGPT, nnx_loss
from tests.jax._jax_model import jitted

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS, AXIS = 3, "dp"
# float32, same framework: the data-parallel gradient is a mean of 4 per-device means where the
# reference takes one mean over the batch (sums in another order); measured worst 1.2e-6 off
# after 3 AdamW steps on parameters of order 1 (Adam divides small gradients by their own scale).
RTOL, ATOL = 1.3e-6, 5e-6
MESH = Mesh(np.array(jax.devices()[:4]), (AXIS,))


def _model():
    return NNXGPT(CONFIG, rngs=nnx.Rngs(0))


def _tx():
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # AdamW as users write it: no decay on biases and norms
    # eps 1e-4, not 1e-8: the key part of c_attn's bias has gradient 0 in exact arithmetic (softmax
    # is shift-invariant), and Adam at eps 1e-8 turns its rounding noise (~1e-9, another sign in
    # another summation order) into steps of +-lr, comparing noise with noise
    return optax.adamw(1e-2, eps=1e-4, weight_decay=0.1, mask=decay)


def _batch(step):
    r = np.random.default_rng(step)
    idx = r.integers(0, CONFIG.vocab_size, (8, CONFIG.block_size))
    return jnp.asarray(idx, jnp.int32), jnp.asarray(np.roll(idx, -1, axis=1), jnp.int32)


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _close(got: dict, want: dict):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


@functools.cache
def _reference():
    """The unsharded run: nnx.Optimizer with the plain optax transform, nnx.jit."""
    model = _model()
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, idx, tgt):
        optimizer.update(model, nnx.grad(nnx_loss)(model, idx, tgt))

    for i in range(STEPS):
        step(model, optimizer, *_batch(i))
    return _params(model)


def test_nnx_state_is_named_by_its_variables():
    """No ".value" in a name; the same torch names through GPT_MAPPING as linen's tree."""
    _, state = nnx.split(_model(), nnx.Param)
    names = [s.name for s in hj.specs(state)]
    assert "h.0.attn.c_attn.kernel" in names and not [n for n in names if n.endswith("value")]
    pure = nnx.to_pure_dict(state)
    assert names == [s.name for s in hj.specs(pure)]
    linen = jax.eval_shape(FlaxGPT(CONFIG).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    nnx_pairs = GPT_MAPPING.pair({s.name: s.shape for s in hj.specs(state)})
    linen_pairs = GPT_MAPPING.pair({s.name: s.shape for s in hj.specs(linen)})
    assert sorted(p.torch for p in nnx_pairs.pairs) == sorted(p.torch for p in linen_pairs.pairs)


def test_mapping_names_a_value_suffix():
    from hybrid.core import MappingError
    with pytest.raises(MappingError, match=r"drop the '\.value'.*|'h\.0\.ln_1\.bias'"):
        GPT_MAPPING.pair({"h.0.ln_1.bias.value": (16,)}, {"h.0.ln_1.bias": (16,)})


# -- nnx.Optimizer(model, zero(...), wrt=nnx.Param) under nnx.jit + nnx.shard_map -------------------
# every optimizer-state array with a dimension is this device's slice of a bucket; counts are scalars
OPT_SPEC = nnx.StateSharding({(lambda path, x: x.ndim > 0): P(AXIS), ...: P()})


@pytest.mark.parametrize("stage", [1, 2])
def test_nnx_optimizer_zero_equals_optax(stage, tmp_path):
    model = _model()
    tx = hj.zero(_tx(), AXIS, stage=stage)

    @nnx.jit
    @nnx.shard_map(mesh=MESH, in_specs=P(), out_specs=OPT_SPEC)
    def make_optimizer(model):
        return nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    @nnx.shard_map(mesh=MESH, in_specs=(P(), OPT_SPEC, P(AXIS), P(AXIS)), out_specs=P())
    def step(model, optimizer, idx, tgt):
        optimizer.update(model, hj.local_grad(nnx_loss, AXIS)(model, idx, tgt))  # this device's gradient
        return jax.lax.pmean(nnx_loss(model, idx, tgt), AXIS)

    optimizer = make_optimizer(model)
    for i in range(STEPS):
        step(model, optimizer, *_batch(i))
    _close(_params(model), _reference())
    held = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.ndim)
    whole = 2 * sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))  # Adam's mu and nu
    assert held < whole / 4 + 2 * 4 * len(jax.tree.leaves(optimizer.opt_state))  # 1/4, plus bucket padding
    assert int(optimizer.step[...]) == STEPS
    if stage == 2:  # the optimizer's own state (its arrays in nnx OptArray variables) saves and loads as it is
        from hybrid.checkpoint import jax as ckpt_jax
        path = str(tmp_path / "nnx-optimizer")
        ckpt_jax.save(path, nnx.state(model, nnx.Param), optimizer.opt_state, step=STEPS, mapping=GPT_MAPPING)
        params, state, step = ckpt_jax.load(path, nnx.state(model, nnx.Param), optimizer.opt_state, mapping=GPT_MAPPING)
        assert step == STEPS
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(optimizer.opt_state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the same idiom under a plain nnx.jit over the Mesh: zero(..., mesh=MESH), nnx.grad ---------------
def _collectives(text):
    """``{kind: count}`` of the compiled module's collectives."""
    kinds = re.findall(r"= .+? (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(", text)
    return {k: kinds.count(k) for k in set(kinds)}


@pytest.mark.parametrize("stage,jit", [(1, "nnx.jit"), (2, "nnx.jit"), (2, "jax.jit")])
def test_nnx_optimizer_zero_under_plain_jit(stage, jit):
    """nnx.Optimizer(model, zero(chain, "dp", stage=k, mesh=MESH)) and optimizer.update(model,
    nnx.grad(loss)(model, ...)) in a plain nnx.jit (or jax.jit over nnx.split / nnx.merge, flax's
    functional form), the batch sharded P("dp"), the model's arrays replicated: no shard_map, no
    local_grad. Equal to the unsharded nnx.Optimizer (RTOL, ATOL above: the gradient is XLA's
    partitioned sum over the devices' rows, another order than the reference's); the optimizer
    state 1/4 per device; the compiled step's collectives those of
    tests/jax/test_jax_zero_jit.py::test_compiled_step_collectives: one all-gather per bucket and one
    all-reduce of the gradient, nothing else (stages 1 and 2 are one program: stage 2's nnx.jit
    step is stage 1's, from the compilation cache)."""
    model = _model()
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(MESH, P())))
    tx = hj.zero(_tx(), AXIS, stage=stage, mesh=MESH)
    optimizer = nnx.jit(lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param))(model)
    rows = NamedSharding(MESH, P(AXIS))
    batch = lambda i: jax.device_put(_batch(i), rows)

    if jit == "nnx.jit":
        @nnx.jit
        def step(model, optimizer, idx, tgt):
            optimizer.update(model, nnx.grad(nnx_loss)(model, idx, tgt))   # plain nnx.grad over the global batch

        text = step.lower(model, optimizer, *batch(0)).compile().as_text()
        run = lambda i: step(model, optimizer, *batch(i))
    else:
        graphdef, state = nnx.split((model, optimizer))

        def pure_step(state, idx, tgt):
            model, optimizer = nnx.merge(graphdef, state)
            optimizer.update(model, nnx.grad(nnx_loss)(model, idx, tgt))
            return nnx.state((model, optimizer))

        compiled = jitted(pure_step).lower(state, *batch(0)).compile()  # the collectives: XLA's
        text = compiled.as_text()                                                   # passes, not its codegen

        def run(i):
            nnx.update((model, optimizer), compiled(nnx.state((model, optimizer)), *batch(i)))
    found = _collectives(text)
    num_buckets = shard_flat(plan_buckets(hj.specs(nnx.state(model, nnx.Param))), 4).bucket_plan.num_buckets
    assert found == {"all-gather": num_buckets, "all-reduce": 1}, found
    for i in range(STEPS):
        run(i)
    _close(_params(model), _reference())
    for x in jax.tree.leaves(nnx.state(optimizer.opt_state)):
        if x.ndim:  # a bucket of Adam's moments: a quarter of it on each device
            assert [s.data.shape for s in x.addressable_shards] == [(x.shape[0] // 4,)] * 4
    assert int(optimizer.step[...]) == STEPS


def test_nnx_optimizer_stage3_on_a_sharded_module(tmp_path):
    """nnx.Optimizer(ShardedModule(model), zero(chain, "dp", stage=3, mesh=MESH)) and
    optimizer.update(sharded, nnx.grad(loss)(sharded, ...)) in a plain nnx.jit: the model's Params
    held as ParamShards (1/4 of every bucket per device), equal to the unsharded nnx.Optimizer
    (RTOL, ATOL above; the gradient reduce-scattered per bucket, another order again), and saved and
    loaded as stage 3's ParamShards and state, bit for bit. The
    compiled step: one all-gather and one reduce-scatter per bucket (XLA:CPU merges the backward's
    gather with the forward's), nothing else (a step that returns the loss adds an all-reduce of
    its scalar sum)."""
    caps = dict(bucket_cap_bytes=8 << 10, first_bucket_cap_bytes=4 << 10)  # several buckets
    sharded = hj.ShardedModule(_model(), AXIS, mesh=MESH, **caps)
    shards = sharded.shards.get_value()
    assert len(shards.buckets) >= 3
    for x in shards.buckets:
        assert [s.data.shape for s in x.addressable_shards] == [(x.shape[0] // 4,)] * 4
    tx = hj.zero(_tx(), AXIS, stage=3, mesh=MESH)
    optimizer = nnx.jit(lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param))(sharded)

    @nnx.jit
    def step(model, optimizer, idx, tgt):
        optimizer.update(model, nnx.grad(nnx_loss)(model, idx, tgt))

    rows = NamedSharding(MESH, P(AXIS))
    batch = lambda i: jax.device_put(_batch(i), rows)
    text = step.lower(sharded, optimizer, *batch(0)).compile().as_text()
    found = _collectives(text)
    num_buckets = len(shards.buckets)
    assert found == {"all-gather": num_buckets, "reduce-scatter": num_buckets}, found
    for i in range(STEPS):
        step(sharded, optimizer, *batch(i))
    _close(nnx.to_pure_dict(nnx.state(sharded.unsharded(), nnx.Param)), _reference())
    assert int(optimizer.step[...]) == STEPS

    # its checkpoint: the ParamShards and the optimizer's ZeroState, as at stage 3, into a fresh pair
    from hybrid.checkpoint import jax as ckpt_jax
    shards = sharded.shards.get_value()
    ckpt_jax.save(tmp_path / "sharded", shards, optimizer.opt_state, step=STEPS, stage=3)
    fresh = hj.ShardedModule(NNXGPT(CONFIG, rngs=nnx.Rngs(1)), AXIS, mesh=MESH, **caps)
    fresh_optimizer = nnx.jit(lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param))(fresh)
    loaded, state, at = ckpt_jax.load(tmp_path / "sharded", fresh.shards.get_value(), fresh_optimizer.opt_state)
    assert at == STEPS
    fresh.shards.set_value(loaded)
    nnx.update(fresh_optimizer.opt_state, nnx.state(state))
    for a, b in zip(jax.tree.leaves((shards, nnx.state(optimizer.opt_state))),
                    jax.tree.leaves((fresh.shards.get_value(), nnx.state(fresh_optimizer.opt_state))), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mesh", [MESH, None], ids=["jit", "shard_map"])
def test_nnx_optimizer_refuses_a_plain_model_at_stage3(mesh):
    """At stage 3 nnx.Optimizer on the model itself would step its whole Params (what stage 3 does
    not keep): refused when it is built, the message naming why, ShardedModule and the functional
    step (the one test_stage3_on_nnx_state_equals_optax runs)."""
    tx = hj.zero(_tx(), AXIS, stage=3, mesh=mesh)
    make = lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param)
    if mesh is None:
        make = nnx.shard_map(make, mesh=MESH, in_specs=P(), out_specs=P(AXIS))
    with pytest.raises(TypeError, match=r"nnx\.Optimizer cannot step a plain NNX model at ZeRO stage 3.*"
                                        r"hybrid\.jax\.ShardedModule\(model.*shard_params.*gathered.*nnx\.merge"):
        nnx.jit(make)(_model())


def test_sharded_module_refuses_what_it_cannot_split():
    class Counting(nnx.Module):  # a forward that updates a variable other than a Param
        def __init__(self):
            self.linear, self.calls = nnx.Linear(4, 2, rngs=nnx.Rngs(0)), nnx.BatchStat(jnp.zeros(()))

    with pytest.raises(ValueError, match=r"variables other than nnx\.Param \(\['calls'\]\)"):
        hj.ShardedModule(Counting(), AXIS, mesh=MESH)
    sharded = hj.ShardedModule(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), AXIS, mesh=MESH)
    with pytest.raises(ValueError, match="argument 0 has 6 rows, not a multiple of the 4 devices"):
        sharded(jnp.ones((6, 4)))


def test_nnx_optimizer_accumulates_with_multi_steps():
    """The issue's case: nnx.Optimizer around MultiSteps(zero(...), k), local gradients of an NNX
    model (whose names carried '.value'), against the unsharded nnx.Optimizer(optax.MultiSteps)."""
    def run(tx, sharded):
        model = _model()
        if sharded:
            make = nnx.jit(nnx.shard_map(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), mesh=MESH, in_specs=P(),
                                         out_specs=OPT_SPEC))

            @nnx.jit
            @nnx.shard_map(mesh=MESH, in_specs=(P(), OPT_SPEC, P(AXIS), P(AXIS)), out_specs=P())
            def step(model, optimizer, idx, tgt):
                optimizer.update(model, hj.local_grad(nnx_loss, AXIS)(model, idx, tgt))
                return jax.lax.pmean(nnx_loss(model, idx, tgt), AXIS)
        else:
            make = lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param)

            @nnx.jit
            def step(model, optimizer, idx, tgt):
                optimizer.update(model, nnx.grad(nnx_loss)(model, idx, tgt))
        optimizer = make(model)
        for i in range(4):
            step(model, optimizer, *_batch(i))
        return _params(model)

    got = run(hj.MultiSteps(hj.zero(_tx(), AXIS, stage=2), 2), sharded=True)
    _close(got, run(optax.MultiSteps(_tx(), 2), sharded=False))


def test_functional_split_merge_under_jax_jit():
    """The functional NNX step (``nnx.split`` once, ``nnx.merge`` inside) under jax.jit + jax.shard_map."""
    graphdef, params = nnx.split(_model(), nnx.Param)
    tx = hj.zero(_tx(), AXIS, stage=2)
    specs = hj.state_specs(tx, params, AXIS, axis_size=4)

    def loss(params, idx, tgt):
        return nnx_loss(nnx.merge(graphdef, params), idx, tgt)

    def step(params, state, idx, tgt):
        updates, state = tx.update(hj.local_grad(loss, AXIS)(params, idx, tgt), state, params)
        return optax.apply_updates(params, updates), state

    init = jitted(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))
    step = jitted(jax.shard_map(step, mesh=MESH, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)))
    state = init(params)
    for i in range(STEPS):
        params, state = step(params, state, *_batch(i))
    assert isinstance(params, nnx.State)
    _close(nnx.to_pure_dict(params), _reference())


def _stage3_run(shards):
    """zero(stage=3) on ParamShards of an nnx.State, the loss gathering them into the model."""
    graphdef = nnx.graphdef(_model())
    tx = hj.zero(_tx(), AXIS, stage=3)
    specs = hj.state_specs(tx, shards, AXIS, axis_size=4)
    loss = hj.gathered(lambda params, idx, tgt: nnx_loss(nnx.merge(graphdef, params), idx, tgt))

    def step(shards, state, idx, tgt):
        updates, state = tx.update(jax.grad(loss)(shards, idx, tgt), state, shards)
        return optax.apply_updates(shards, updates), state

    init = jitted(jax.shard_map(tx.init, mesh=MESH, in_specs=P(AXIS), out_specs=specs))
    step = jitted(jax.shard_map(step, mesh=MESH, in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
                                out_specs=(P(AXIS), specs)))
    state = init(shards)
    for i in range(STEPS):
        shards, state = step(shards, state, *_batch(i))
    return hj.unshard_params(shards), state


def test_stage3_on_nnx_state_equals_optax():
    params = jax.jit(lambda: nnx.split(_model(), nnx.Param)[1])()  # init_shards' values are the jitted init's
    shards = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, AXIS), mesh=MESH, in_specs=P(),
                                   out_specs=P(AXIS)))(params)
    born = hj.init_shards(lambda: nnx.split(_model(), nnx.Param)[1], mesh=MESH, axis_name=AXIS)
    held = hj.ShardedModule(_model, AXIS, mesh=MESH).shards.get_value()  # given the function: born sharded alike
    assert born.layout == shards.layout == held.layout
    for a, b, c in zip(born.buckets, shards.buckets, held.buckets, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(b))
    trained, _ = _stage3_run(born)
    assert isinstance(trained, nnx.State)
    _close(nnx.to_pure_dict(trained), _reference())


def test_nnx_checkpoint_crosses_to_torch_and_linen(tmp_path):
    """An NNX run's zero state saved under torch's names loads into TorchGPT + torch Adam and into
    the linen tree; without a mapping its names carry no '.value'."""
    torch = pytest.importorskip("torch")
    from hybrid.checkpoint import jax as ckpt_jax, torch as ckpt_torch
    from hybrid.models import TorchGPT

    graphdef, params = nnx.split(_model(), nnx.Param)
    tx = hj.zero(optax.adam(1e-2), AXIS, stage=2)
    specs = hj.state_specs(tx, params, AXIS, axis_size=4)
    loss = lambda p, idx, tgt: nnx_loss(nnx.merge(graphdef, p), idx, tgt)

    def step(p, state, idx, tgt):
        updates, state = tx.update(hj.local_grad(loss, AXIS)(p, idx, tgt), state, p)
        return optax.apply_updates(p, updates), state

    state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(params)
    params, state = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                                          out_specs=(P(), specs)))(params, state, *_batch(0))
    path = str(tmp_path / "nnx")
    ckpt_jax.save(path, params, state, step=1, mapping=GPT_MAPPING)

    model = TorchGPT(CONFIG)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert ckpt_torch.load(path, model, adam) == 1
    kernel = np.asarray(params["h"][0]["attn"]["c_attn"]["kernel"][...])
    np.testing.assert_array_equal(model.h[0].attn.c_attn.weight.detach().numpy(), kernel.T)
    mu = ckpt_jax.load(path, params, tx_state_like := optax.adam(1e-2).init(params), mapping=GPT_MAPPING)[1][0].mu
    del tx_state_like
    np.testing.assert_array_equal(adam.state[model.h[0].attn.c_attn.weight]["exp_avg"].numpy(),
                                  np.asarray(mu["h"][0]["attn"]["c_attn"]["kernel"][...]).T)

    linen = jax.eval_shape(FlaxGPT(CONFIG).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    linen = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), linen)
    linen, _, _ = ckpt_jax.load(path, linen, optax.adam(1e-2).init(linen), mapping=GPT_MAPPING)
    np.testing.assert_array_equal(np.asarray(linen["h_0"]["attn"]["c_attn"]["kernel"]), kernel)

    torch_path = str(tmp_path / "torch")  # and back: torch's save into a fresh NNX state
    ckpt_torch.save(torch_path, model, adam, step=1, world_size=2)
    fresh = nnx.state(_model(), nnx.Param)
    fresh, _, got = ckpt_jax.load(torch_path, fresh, optax.adam(1e-2).init(fresh), mapping=GPT_MAPPING)
    assert got == 1 and isinstance(fresh, nnx.State)
    np.testing.assert_array_equal(np.asarray(fresh["h"][0]["attn"]["c_attn"]["kernel"][...]), kernel)

    plain = ckpt_jax.save(str(tmp_path / "plain"), params, state, step=1)  # NNX's own names
    names = [s.name for s in plain.plan.specs]
    assert "h.0.attn.c_attn.kernel" in names and not [n for n in names if n.endswith("value")]



def test_torch_param_groups_continue_on_nnx_state(tmp_path):
    """optax_from_manifest labels an NNX State's leaves by their variables' names (AdamW with no
    decay on vectors, two torch param groups): the same updates as on its nnx.to_pure_dict tree."""
    torch = pytest.importorskip("torch")
    from hybrid.checkpoint import jax as ckpt_jax, torch as ckpt_torch
    from hybrid.models import TorchGPT

    torch.manual_seed(0)
    model = TorchGPT(CONFIG)
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=1e-3)
    idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    adamw.zero_grad()
    model(idx, idx)[1].backward()
    adamw.step()
    path = str(tmp_path / "groups")
    ckpt_torch.save(path, model, adamw, step=1, world_size=1)

    def continued(params):
        tx = ckpt_jax.optax_from_manifest(path, params, mapping=GPT_MAPPING)
        params, state, _ = ckpt_jax.load(path, params, tx.init(params), mapping=GPT_MAPPING)
        return tx.update(jax.tree.map(jnp.ones_like, params), state, params)[0]

    state = nnx.state(_model(), nnx.Param)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(continued(state))), jax.tree.leaves(continued(nnx.to_pure_dict(state))),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
