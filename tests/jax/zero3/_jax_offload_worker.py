"""One process of a jax.distributed job (2 local devices): ``hybrid.jax.OffloadedZero3`` over the
mesh of every process's devices. Each process keeps its own devices' state in its own files: it
trains 4 steps beside ``zero(adam, stage=3)`` on the same gradients and checks the slices its
devices hold; then it saves (a collective), loads into a second optimizer through a template of
shapes (its devices' slices, a slot at a time into its files), and checks that both take the same
next step bit for bit.

    python _jax_offload_worker.py PORT NUM_PROCESSES PROCESS_ID DIR
"""

import os
import sys

from tests._procs import join_jax_job  # before jax: it sets the device count jax starts with

jax = join_jax_job(2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import hybrid.jax as hj  # noqa: E402
from hybrid.checkpoint import jax as checkpoint  # noqa: E402

MESH = Mesh(np.array(jax.devices()), ("dp",))
PLAN = dict(bucket_cap_bytes=1024)  # 3 buckets
# float32, as tests/jax/zero3/test_jax_zero3.py: a program per bucket rounds some elements an ulp apart
# from zero(stage=3)'s one program.
RTOL, ATOL = 1e-6, 2e-7


def init(key):
    k = jax.random.split(key, 3)
    return {"w1": jax.random.normal(k[0], (16, 40)) * 0.2, "b1": jnp.zeros(40),
            "w2": jax.random.normal(k[1], (40, 8)) * 0.2, "b2": jnp.zeros(8)}


def loss(p, x):
    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) ** 2)


def batch(i):
    x = np.random.default_rng(i).normal(size=(8 * MESH.size, 16)).astype(np.float32)
    return jax.make_array_from_callback(x.shape, NamedSharding(MESH, P("dp")), lambda index: x[index])


def local(shards):
    return [np.asarray(s.data) for b in shards.buckets for s in b.addressable_shards]


grad = jax.jit(jax.shard_map(jax.grad(hj.gathered(loss)), mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P("dp")))
tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
resident = hj.init_shards(init, jax.random.key(0), mesh=MESH, axis_name="dp", **PLAN)
specs = hj.state_specs(tx, resident, "dp", axis_size=MESH.size)
state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P("dp"), out_specs=specs))(resident)
update = jax.jit(jax.shard_map(lambda s, st, g: (lambda u, st: (optax.apply_updates(s, u), st))(*tx.update(g, st, s)),
                               mesh=MESH, in_specs=(P("dp"), specs, P("dp")), out_specs=(P("dp"), specs)))

first = hj.OffloadedZero3(optax.adam(1e-2), MESH, "dp", sys.argv[4])
shards = hj.init_shards(init, jax.random.key(0), mesh=MESH, axis_name="dp", **PLAN)
first.init(shards)
for i in range(4):
    resident, state = update(resident, state, grad(resident, batch(i)))
    shards = first.step(shards, grad(shards, batch(i)))
    for a, b in zip(local(shards), local(resident), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"step {i}")

path = os.path.join(sys.argv[4], "ckpt")
checkpoint.save(path, shards, first.zero_state(), step=4, stage=3)  # each process its devices' files
second = hj.OffloadedZero3(optax.adam(1e-2), MESH, "dp", sys.argv[4])
template = hj.abstract_shards(jax.eval_shape(init, jax.random.key(0)), mesh=MESH, axis_name="dp", **PLAN)
second.init(template)
loaded, _, step = checkpoint.load(path, template, second)
assert step == 4
for a, b in zip(local(loaded), local(shards), strict=True):
    np.testing.assert_array_equal(a, b)
shards = first.step(shards, grad(shards, batch(4)))
loaded = second.step(loaded, grad(loaded, batch(4)))
for a, b in zip(local(loaded), local(shards), strict=True):
    np.testing.assert_array_equal(a, b)
assert sorted(os.listdir(sys.argv[4])) == ["ckpt"]  # the state files were unlinked as they were mapped
print(f"process {jax.process_index()}: ok, {len(shards.buckets)} buckets over {MESH.size} devices, "
      f"{first.offloaded_bytes()} bytes of state in this process's files", flush=True)
jax.distributed.shutdown()
