"""Stage-3 parameters born sharded (issue 36, item 3): ``init_shards`` gives, bit for bit, what
``shard_params(jax.jit(model.init)(...))`` gives, with each device holding only its slices (the
jitted init is the oracle: XLA:CPU's fused float ops round flax's normal init an ulp away from the
eager one, in ~25% of the GPT's elements); and
``abstract_shards`` (from ``jax.eval_shape``) is a template a checkpoint loads straight into; and
each device computes its share of the init, not whole buckets (XLA's ``memory_analysis`` of the
compiled programs, per device).
The flax GPT (its own init through torch's pairing, so the plan is ZeRO3's) and a flax MLP, on
4 host devices; the multi-process case is in tests/checkpoint/test_jax_processes.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import jax as checkpoint
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig
from tests._xla import DEFAULT_CODEGEN

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _gpt():
    """The flax GPT's own init (its "params" collection), planned over torch's names and layouts."""
    import torch

    from hybrid.jax._specs import _leaves
    from hybrid.models import TorchGPT

    model = FlaxGPT(GPT)
    init = lambda key, idx: model.init(key, idx)["params"]
    args = (jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
    names, leaves, _ = _leaves(jax.eval_shape(init, *args))
    with torch.device("meta"):
        torch_shapes = {n: tuple(p.shape) for n, p in TorchGPT(GPT).named_parameters()}
    pairing = GPT_MAPPING.pair(dict(zip(names, (tuple(x.shape) for x in leaves))), torch_shapes)
    return init, args, dict(pairing=pairing)


def _mlp():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (48, 64, 8):
                x = nn.tanh(nn.Dense(width)(x))
            return x

    return MLP().init, (jax.random.key(3), jnp.ones((2, 24))), dict(bucket_cap_bytes=8192)


MODELS = {"flax_gpt": _gpt, "flax_mlp": _mlp}


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("dp",))


def _cut(mesh, params, plan):
    return jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "dp", **plan), mesh=mesh, in_specs=P(),
                                 out_specs=P("dp")))(params)


@pytest.mark.parametrize("model,n", [("flax_gpt", 3), ("flax_mlp", 4)])
def test_born_sharded_is_shard_params_of_init(model, n):
    init, args, plan = MODELS[model]()
    mesh = _mesh(n)
    born = hj.init_shards(init, *args, mesh=mesh, axis_name="dp", **plan)
    want = _cut(mesh, jax.jit(init)(*args), plan)
    assert born.layout == want.layout
    for b, (x, y) in enumerate(zip(born.buckets, want.buckets)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"bucket {b}")
        size = born.layout.shards.shard_sizes[b]
        assert {s.device for s in x.addressable_shards} == set(mesh.devices.flat)
        assert all(s.data.shape == (size,) for s in x.addressable_shards), (b, size)  # a slice per device


def test_each_device_computes_its_share_of_the_init():
    # 4 layers of 512 x 512 in 5 buckets, where a slice of a bucket is part of one weight: a program
    # from the init straight to the slices computed every whole weight on every device (its
    # temporaries were the model's size at any device count); per-parameter shardings cut them by N.
    # Each layer adds the same share to every device count's temporaries, so 4 layers check what 12
    # did (measured: 1.0006, 1.0033, 1.0019 of 1/N at 2, 3, 4 devices; 12 layers: 1.0008, 1.0035,
    # 1.0023) in a third of the compiles' time
    from hybrid.jax.sharded._init import born_sharded

    width, depth = 512, 4
    bound = width ** -0.5

    def init(key):
        keys = jax.random.split(key, 2 * depth)
        return [{"w": jax.random.uniform(keys[2 * i], (width, width), minval=-bound, maxval=bound),
                 "b": jax.random.uniform(keys[2 * i + 1], (width,), minval=-bound, maxval=bound)} for i in range(depth)]

    model_bytes = 4 * depth * (width * width + width)
    key = jax.random.key(0)
    one = born_sharded(init, key, mesh=_mesh(1), axis_name="dp", order=None, pairing=None, plan=None,
                       bucket_cap_bytes=None, first_bucket_cap_bytes=None).temp_bytes(key)
    assert one >= model_bytes  # one device: the whole init, random bits beside the values
    for n in (2, 3, 4):  # 3: rows padded to a multiple of the devices
        born = born_sharded(init, key, mesh=_mesh(n), axis_name="dp", order=None, pairing=None, plan=None,
                            bucket_cap_bytes=None, first_bucket_cap_bytes=None)
        assert born.temp_bytes(key) <= one / n * 1.05, (n, born.temp_bytes(key), one)
        # Bit for bit under XLA's default code generation, which users get; the suite's quick
        # codegen (tests/_xla.py) rounds the uniform's scale and shift 1 ulp apart in the two
        # programs (measured), so both inits are compiled with the default here.
        program = born.init_program
        born.init_program = lambda k: program.lower(k).compile(DEFAULT_CODEGEN)(k)
        want = _cut(_mesh(n), jax.jit(init).lower(key).compile(DEFAULT_CODEGEN)(key), {})
        for x, y in zip(born(key).buckets, want.buckets):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_step_from_born_shards_is_a_step_from_shard_params():
    init, args, plan = MODELS["flax_mlp"]()
    mesh = _mesh(4)
    apply = lambda params, x: jnp.mean(jnp.square(init.__self__.apply(params, x)))
    tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
    x = jax.random.normal(jax.random.key(9), (8, 24))

    def run(shards):
        specs = hj.state_specs(tx, shards, "dp", axis_size=4)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))(shards)

        def step(s, st, x):
            u, st = tx.update(jax.grad(hj.gathered(apply))(s, x), st, s)
            return optax.apply_updates(s, u), st
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp")), out_specs=(P("dp"), specs)))
        for _ in range(2):
            shards, state = step(shards, state, x)
        return shards

    born = run(hj.init_shards(init, *args, mesh=mesh, axis_name="dp", **plan))
    cut = run(_cut(mesh, init(*args), plan))
    for a, b in zip(born.buckets, cut.buckets):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_loads_into_abstract_shards(tmp_path):
    init, args, plan = MODELS["flax_gpt"]()
    mesh = _mesh(4)
    born = hj.init_shards(init, *args, mesh=mesh, axis_name="dp", **plan)
    checkpoint.save(tmp_path / "ckpt", born, step=5, stage=3, **plan)
    template = hj.abstract_shards(jax.eval_shape(init, *args), mesh=_mesh(2), axis_name="dp", **plan)
    assert all(isinstance(b, jax.ShapeDtypeStruct) for b in template.buckets)
    loaded, _, step = checkpoint.load(tmp_path / "ckpt", template, **plan)
    assert step == 5 and loaded.layout == template.layout
    want = _cut(_mesh(2), jax.jit(init)(*args), plan)
    for b, (x, y) in enumerate(zip(loaded.buckets, want.buckets)):
        assert x.sharding == template.buckets[b].sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"bucket {b}")


def test_errors_name_the_culprit():
    init, args, plan = MODELS["flax_mlp"]()
    with pytest.raises(ValueError, match=r"the mesh has axes \('dp',\), not 'tp'"):
        hj.init_shards(init, *args, mesh=_mesh(2), axis_name="tp")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        hj.abstract_shards(jax.eval_shape(init, *args), mesh=jax.devices(), axis_name="dp")
