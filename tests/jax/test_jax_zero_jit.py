"""zero(inner, axis, stage=k, mesh=mesh) inside a plain jax.jit: no shard_map, plain jax.grad of the
loss over the globally sharded batch, against the unsharded inner transform; the plan (and state
fingerprint) of the shard_map path and of torch; 1/N per device; the collectives in the compiled HLO.

Tolerance: float32, same framework; the jitted step's gradient is XLA's partitioned sum over the
devices' rows where the reference sums the batch in one program (the order of the sums differs),
the tolerance of tests/jax/test_jax_zero.py (rtol 1e-6, atol 2e-7, see its note) over 20 steps.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import plan_buckets, shard_flat, zero3_plan
from tests.jax._jax_model import CAPS, assert_trees_close, loss, make_batch, make_params, reference, shard_map_train

NUM_STEPS = 20
RTOL, ATOL = 1e-6, 2e-7
AXIS = "data"
decay = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # weight decay on matrices only

INNER = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    # optax's own clip, a small max_norm so it triggers every step: inside zero it sees whole buckets
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1)),
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=decay),
    # param groups: labels per leaf, rewritten per element of the whole bucket
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adamw(1e-2, weight_decay=0.1), "vector": optax.sgd(1e-2, momentum=0.9)},
        lambda params: jax.tree.map(lambda p: "matrix" if p.ndim > 1 else "vector", params)),
}


def _mesh(world_size):
    return Mesh(np.array(jax.devices()[:world_size]), (AXIS,))


@functools.cache
def reference_history(name):
    return reference(INNER[name](), make_params(), NUM_STEPS)


def _train_step(tx, loss_fn):
    def step(params, state, x, y):
        g = jax.grad(loss_fn)(params, x, y)       # plain jax.grad over the global batch
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state
    return jax.jit(step)  # not donated: the tests keep every step's parameters


def _start(stage, world_size, name="adamw", params=None):
    """``(tx, params or ParamShards, state, step, mesh)`` as a user writes the plain-jit loop."""
    mesh = _mesh(world_size)
    params = make_params() if params is None else params
    if stage == 3:
        tx = hj.zero(INNER[name](), AXIS, stage=3, mesh=mesh)
        params = hj.shard_params(params, AXIS, mesh=mesh, **CAPS)
        loss_fn = hj.gathered(loss)
    else:
        tx = hj.zero(INNER[name](), AXIS, stage=stage, mesh=mesh, **CAPS)
        params = jax.device_put(params, NamedSharding(mesh, P()))
        loss_fn = loss
    return tx, params, jax.jit(tx.init)(params), _train_step(tx, loss_fn), mesh


def _batch(i, mesh):
    return jax.device_put(make_batch(i), NamedSharding(mesh, P(AXIS)))


@functools.cache
def run_jit(name, stage, world_size):
    tx, params, state, step, mesh = _start(stage, world_size, name)
    history = []
    for i in range(NUM_STEPS):
        params, state = step(params, state, *_batch(i, mesh))
        history.append(hj.unshard_params(params) if stage == 3 else params)
    return history, params, state


# Stages 1 and 2 are one program (both shard the state; the gradient is reduced by XLA either way),
# so stage 1 runs with one inner transform; 3 devices: padding in every bucket.
CASES = ([(name, stage, 4) for name in INNER for stage in (2, 3)] + [("adamw", 1, 4)]
         + [("clip_adamw", 2, 3), ("adamw_masked", 3, 3)])


@pytest.mark.parametrize("name,stage,world_size", CASES)
def test_jit_zero_equals_unsharded(name, stage, world_size):
    history, _, _ = run_jit(name, stage, world_size)
    for i, (got, want) in enumerate(zip(history, reference_history(name))):
        assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"stage {stage}, step {i}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_and_stage3_params_are_one_nth_per_device(stage):
    """Every bucket-long state array (and stage 3's parameter buckets) holds padded / N elements on
    each device: its addressable shards, not a claim about its sharding."""
    _, params, state = run_jit("adamw", stage, 4)
    arrays = [x for x in jax.tree.leaves(state) if x.ndim]
    if stage == 3:
        arrays += list(params.buckets)
    shards = shard_flat(zero3_plan(hj.specs(make_params()), **CAPS) if stage == 3
                        else plan_buckets(hj.specs(make_params()), **CAPS), 4)
    padded = {shards.padded_length(b) for b in range(shards.bucket_plan.num_buckets)}
    assert len(arrays) >= 2 * len(padded)  # adam's mu and nu per bucket
    for x in arrays:
        assert x.shape[0] in padded
        sizes = sorted((s.device.id, s.data.shape) for s in x.addressable_shards)
        assert [shape for _, shape in sizes] == [(x.shape[0] // 4,)] * 4, sizes
    if stage != 3:  # the parameters stay whole (replicated), as ZeRO-1/2's do
        assert all(s.data.shape == x.shape for x in jax.tree.leaves(params) for s in x.addressable_shards)


@pytest.mark.parametrize("stage", [2, 3])
def test_same_plan_and_state_as_the_shard_map_path(stage):
    """The state's fingerprint and arrays are the shard_map path's: what checkpoints store."""
    _, _, jit_state = run_jit("adamw", stage, 4)
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    params = make_params()
    if stage == 3:
        shards = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "dp", **CAPS), mesh=mesh,
                                       in_specs=P(), out_specs=P("dp")))(params)
        tx = hj.zero(INNER["adamw"](), "dp", stage=3)
        specs = hj.state_specs(tx, shards, "dp", axis_size=4)
        loss_of = hj.gathered(loss)

        def step(s, state, x, y):
            u, state = tx.update(jax.grad(loss_of)(s, x, y), state, s)
            return optax.apply_updates(s, u), state
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))(shards)
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp"), P("dp")),
                                     out_specs=(P("dp"), specs)))
        p = shards
    else:
        tx = hj.zero(INNER["adamw"](), "dp", stage=stage, **CAPS)
        init, step = shard_map_train(tx, mesh, params)
        p, state = params, init(params)
    for i in range(NUM_STEPS):
        p, state = step(p, state, *make_batch(i))
    assert jit_state.plan_fingerprint == state.plan_fingerprint
    assert jax.tree.structure(jit_state) == jax.tree.structure(state)
    assert_trees_close(jit_state, state, rtol=RTOL, atol=ATOL, what="state")


def test_plan_is_torchs_for_a_paired_model():
    """With torch's registration order, the jit path's plans are torch DDP's (stages 1-2) and torch
    ZeRO3's (stage 3), by fingerprint (hybrid.core plans over torch's own specs)."""
    torch = pytest.importorskip("torch")
    import hybrid.torch
    module = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    params = {str(i): {"weight": jnp.asarray(m.weight.detach().numpy()), "bias": jnp.asarray(m.bias.detach().numpy())}
              for i, m in enumerate(module)}
    order = [name for name, _ in module.named_parameters()]
    torch_specs = hybrid.torch.specs(module)
    mesh = _mesh(4)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = jax.jit(hj.zero(optax.adam(1e-3), AXIS, stage=2, mesh=mesh, order=order, **CAPS).init)(params)
    assert state.plan_fingerprint == shard_flat(plan_buckets(torch_specs, **CAPS), 4).fingerprint()
    shards = hj.shard_params(params, AXIS, mesh=mesh, order=order, **CAPS)
    assert shards.layout.shards.fingerprint() == shard_flat(zero3_plan(torch_specs, **CAPS), 4).fingerprint()
    state3 = jax.jit(hj.zero(optax.adam(1e-3), AXIS, stage=3, mesh=mesh).init)(shards)
    assert state3.plan_fingerprint == shards.layout.shards.fingerprint()


def _collectives(text):
    """``{kind: [elements of each operand]}`` of the compiled module's collectives."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
                     r"(?:-start)?\(", line)
        if m:
            shapes = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", m.group(1))
            out.setdefault(m.group(2), []).append([int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes])
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_step_collectives(stage):
    """What XLA:CPU emits for the plain-jit step, counted in the compiled HLO.

    Stage 3: one all-gather and one reduce-scatter per bucket, nothing else (``gathered`` runs the
    loss per device, so jax.grad's transpose of each gather is a reduce-scatter). Stages 1-2: one
    all-gather per bucket of the updates, and the gradient reduced once (every gradient element in
    one reduction) by an all-reduce: the gradient is plain jax.grad of the loss, whose reduction
    XLA:CPU places at the dots, and XLA:CPU has no pass turning an all-reduce and a slice into a
    reduce-scatter (GSPMD's own ZeRO-1 reduces the same way there; `python -m hybrid bench jax
    --part jit` prints its collectives). No all-to-all or collective-permute resharding.
    """
    tx, params, state, step, mesh = _start(stage, 4)
    text = step.lower(params, state, *_batch(0, mesh)).compile().as_text()
    found = _collectives(text)
    layout = params.layout.shards if stage == 3 else shard_flat(plan_buckets(hj.specs(make_params()), **CAPS), 4)
    lengths = sorted(layout.padded_length(b) for b in range(layout.bucket_plan.num_buckets))
    gathered = sorted(ops[0] for ops in found.get("all-gather", []))
    assert gathered == lengths, (gathered, lengths)  # the all-gather's result: the whole padded bucket
    if stage == 3:
        assert set(found) == {"all-gather", "reduce-scatter"}, found
        scattered = sorted(ops[0] * 4 for ops in found["reduce-scatter"])  # its result: one device's slice
        assert scattered == lengths, (scattered, lengths)
        return
    assert set(found) == {"all-reduce", "all-gather"}, found
    num_params = sum(x.size for x in jax.tree.leaves(make_params()))
    assert len(found["all-reduce"]) == 1 and sum(found["all-reduce"][0]) == num_params, found["all-reduce"]


def test_init_outside_jit_and_eager_update_agree_with_jitted():
    """``tx.init`` called eagerly gives the sharded state jit gives."""
    tx, params, jitted_state, _, mesh = _start(2, 4)
    eager = tx.init(params)
    assert jax.tree.structure(eager) == jax.tree.structure(jitted_state)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if a.ndim:
            assert {s.data.shape for s in a.addressable_shards} == {(a.shape[0] // 4,)}


def test_errors_name_the_fix():
    mesh = _mesh(4)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        hj.zero(optax.adam(1e-3), "dp", mesh=mesh)
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        hj.zero(optax.adam(1e-3), AXIS, mesh="data")
    with pytest.raises(ValueError, match="mean=False"):
        hj.zero(optax.adam(1e-3), AXIS, mesh=mesh, mean=False)
    with pytest.raises(ValueError, match="shard_params"):
        hj.zero(optax.adam(1e-3), AXIS, stage=3, mesh=mesh, bucket_cap_bytes=64)
    with pytest.raises(ValueError, match="trust ratio"):
        hj.zero(optax.lamb(1e-3), AXIS, mesh=mesh)
    with pytest.raises(TypeError, match="ParamShards"):
        hj.zero(optax.adam(1e-3), AXIS, stage=3, mesh=mesh).init(make_params())
    tx = hj.zero(optax.adam(1e-3), AXIS, stage=2, mesh=mesh)
    state = tx.init(make_params())
    other = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="re-run init"):
        tx.update(other, state, other)


def test_misuse_under_jit_names_the_fix():
    """hybrid's axis-aware clip (made for a device's slices) and a gathered loss given what it cannot
    split over the devices."""
    tx = hj.zero(optax.chain(hj.clip_by_global_norm(1.0, AXIS), optax.adam(1e-2)), AXIS, stage=2, mesh=_mesh(4))
    params = make_params()
    with pytest.raises(ValueError, match="optax.clip_by_global_norm"):
        jax.jit(tx.update)(params, jax.jit(tx.init)(params), params)
    shards = hj.shard_params(params, AXIS, mesh=_mesh(4), **CAPS)
    x, y = make_batch(0)
    with pytest.raises(TypeError, match="positionally"):
        jax.jit(lambda s, x, y: hj.gathered(loss)(s, x, y=y))(shards, x, y)
    with pytest.raises(ValueError, match="not a multiple of the 4 devices"):
        jax.jit(hj.gathered(loss))(shards, x[:10], y[:10])


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_round_trip(stage, tmp_path):
    """hybrid.checkpoint.jax saves the plain-jit state as the shard_map path's (global arrays, one
    file per device's slices) and loads it back into the jit path's own template, bit for bit."""
    from hybrid.checkpoint.jax import load, save
    _, params, state = run_jit("adamw", stage, 4)
    save(tmp_path / "ckpt", params, state, step=NUM_STEPS, stage=stage, **({} if stage == 3 else CAPS))
    _, fresh, template, _, _ = _start(stage, 4)
    got_params, got_state, step = load(tmp_path / "ckpt", fresh, template, **({} if stage == 3 else CAPS))
    assert step == NUM_STEPS
    for a, b in zip(jax.tree.leaves((got_params, got_state)), jax.tree.leaves((params, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding


@functools.cache
def _nnx_gpt():
    """A small GPT-style decoder in the NNX idiom (embeddings, LayerNorm, attention, MLP): its
    graphdef, its ``nnx.split(model, nnx.Param)`` state and a loss of that state."""
    nnx = pytest.importorskip("flax.nnx")
    from hybrid.models import GPTConfig, NNXGPT, nnx_loss
    graphdef, state = nnx.split(NNXGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16),
                                       rngs=nnx.Rngs(0)), nnx.Param)

    def nnx_gpt_loss(params, idx, targets):
        return nnx_loss(nnx.merge(graphdef, params), idx, targets)
    return state, nnx_gpt_loss


def _tokens(i):
    r = np.random.default_rng(100 + i)
    idx = r.integers(0, 32, size=(8, 8)).astype(np.int32)
    return jnp.asarray(idx), jnp.asarray(np.roll(idx, -1, axis=1))


def _nnx_chain():
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay)


@functools.cache
def _nnx_reference():
    """Plain optax in the user's own jitted step (parameters replicated, the batch split), 5 steps:
    the oracle of every stage, compiled and run once."""
    params, nnx_gpt_loss = _nnx_gpt()
    mesh = _mesh(4)
    ref, ref_tx = jax.device_put(params, NamedSharding(mesh, P())), _nnx_chain()
    ref_state, ref_step = jax.jit(ref_tx.init)(ref), _train_step(ref_tx, nnx_gpt_loss)
    for i in range(5):
        ref, ref_state = ref_step(ref, ref_state, *jax.device_put(_tokens(i), NamedSharding(mesh, P(AXIS))))
    return ref


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nnx_gpt_in_a_plain_jit(stage):
    """NNX state from nnx.split goes through zero(mesh=...) as a params tree: 5 AdamW steps equal plain
    optax within the stage tolerance, and the compiled step's collectives are counted as above.

    The reference is plain optax in the user's own jitted step (parameters replicated, the batch
    split). Tolerance rtol 1.3e-6, atol 5e-5 (the float32 bound): the attention's key bias has a
    gradient of zero up to rounding (softmax ignores a constant added to every key), which AdamW
    divides by its own tiny root mean square, so those elements move by rounding noise alone
    (measured after 5 steps, where a parameter is of order 0.02-1: 6.7e-6 apart under XLA's
    default code generation, 1.2e-5 under the suite's quick one); every other element is within rtol 1e-6, atol
    2e-7 at stages 1-2 and 7.1e-7 at stage 3 (its reduce-scatter sums in another order than the
    reference's all-reduce)."""
    params, nnx_gpt_loss = _nnx_gpt()
    mesh = _mesh(4)
    tx = hj.zero(_nnx_chain(), AXIS, stage=stage, mesh=mesh)
    if stage == 3:
        p, loss_fn = hj.shard_params(params, AXIS, mesh=mesh), hj.gathered(nnx_gpt_loss)
    else:
        p, loss_fn = jax.device_put(params, NamedSharding(mesh, P())), nnx_gpt_loss
    state, step = jax.jit(tx.init)(p), _train_step(tx, loss_fn)
    batch = jax.device_put(_tokens(0), NamedSharding(mesh, P(AXIS)))
    found = _collectives(step.lower(p, state, *batch).compile().as_text())
    num_buckets = (p.layout.shards if stage == 3 else shard_flat(plan_buckets(hj.specs(params)), 4)).bucket_plan.num_buckets
    assert len(found["all-gather"]) == num_buckets
    assert len(found.get("reduce-scatter", [])) == (num_buckets if stage == 3 else 0)
    assert len(found.get("all-reduce", [])) == (0 if stage == 3 else 1), found
    for i in range(5):
        p, state = step(p, state, *jax.device_put(_tokens(i), NamedSharding(mesh, P(AXIS))))
    assert_trees_close(hj.unshard_params(p) if stage == 3 else p, _nnx_reference(), rtol=1.3e-6, atol=5e-5,
                       what=f"stage {stage}")


WIDE, LAYERS = 512, 8
LAYER_BYTES = (WIDE * WIDE + WIDE) * 4  # one layer: a bucket of the stage-3 plan


@pytest.fixture(scope="module")
def bench_temps():
    """Compiled temporaries per device (``memory_analysis().temp_size_in_bytes``) of the steps of
    ``python -m hybrid bench jax --jit-only`` (8 x Linear(512), tanh, AdamW, a global batch of 64
    over 4 host devices), each hybrid step beside GSPMD's own of the same sharding. The size
    matters: the shard_map stage-2 step's whole parameter bucket showed with a second bucket of
    several MiB, never with one bucket (4 x Linear(256))."""
    from hybrid.bench.jax._jit import compile_variants
    names = ("gspmd_zero1", "gspmd_fsdp", "jit_zero2", "sm_zero2", "jit_zero3", "sm_zero3")
    steps, _, _ = compile_variants(WIDE, LAYERS, 64, Mesh(np.array(jax.devices()[:4]), ("dp",)), only=names)
    return {name: steps[name].memory_analysis().temp_size_in_bytes for name in names}


def test_stage2_temporaries_as_gspmd_zero1(bench_temps):
    """The compiled plain-jit stage-2 AdamW step needs the temporaries per device of GSPMD's own
    ZeRO-1 (AdamW's state sharded on its first axis) on the same model and batch, to within 1 KiB
    (measured: 512 bytes more, of 16.03 MiB). Before the gradients and the parameters were sliced
    in one branch, XLA:CPU copied the parameters' slices early and held them through the
    backward: 2 MiB more."""
    assert bench_temps["jit_zero2"] <= bench_temps["gspmd_zero1"] + 1024, bench_temps


def test_shard_map_stage2_temporaries_under_gspmd_zero1(bench_temps):
    """The shard_map stage-2 step (``local_grad``) needs no more temporaries than GSPMD's ZeRO-1:
    14.06 MiB against 16.03. It was 22.16: ``update`` packed the whole parameter bucket (7 MiB)
    during the forward to slice this device's part from it, and XLA:CPU copied a weight (1 MiB)
    that the last bucket's backward still read after the first bucket's update could write it.
    Now the parameters' slices are static copies of this device's part, in one conditional with
    the reduced gradients (``hybrid.jax.sharded._global.own_slices``)."""
    assert bench_temps["sm_zero2"] <= bench_temps["gspmd_zero1"], bench_temps


def test_stage3_temporaries_hold_the_model_once(bench_temps):
    """Stage 3, under jit and shard_map alike, holds the gathered model once, plus a few buckets
    (the one being split, a full gradient and its pack): 10.20 MiB of temporaries for 8.02 MiB of
    parameters. It held it twice (15.05): every gathered bucket was kept for the bias its add
    read from it, beside the weight copies its dots need. Now each bucket is split inside a
    conditional on XLA:CPU and dies once split, and no regather is asked for where XLA:CPU's CSE
    would merge it with the forward's gather. Not yet at GSPMD's FSDP (7.33), whose gathered
    weights are the all-gathers' own buffers: XLA:CPU's default scheduler gathers every bucket at
    the step's start (docs/jax-zero.md)."""
    params = LAYERS * LAYER_BYTES
    for name in ("jit_zero3", "sm_zero3"):
        assert params <= bench_temps[name] <= params + 3 * LAYER_BYTES, bench_temps
    assert bench_temps["gspmd_fsdp"] < bench_temps["sm_zero3"], bench_temps  # the gap that remains
