"""One process of a jax.distributed job (2 local devices): stage-3 parameters born sharded over the
mesh of every process's devices, saved, and loaded into abstract shards; each process checks the
slices its devices hold against ``shard_params`` of the jitted init, computed on its own.

    python _jax_born_sharded_worker.py PORT NUM_PROCESSES PROCESS_ID DIR
"""

import os
import sys

from tests._procs import join_jax_job  # before jax: it sets the device count jax starts with

jax = join_jax_job(2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import hybrid.jax as hj  # noqa: E402
from hybrid.checkpoint import jax as checkpoint  # noqa: E402
from hybrid.core import shard_flat  # noqa: E402
from hybrid.jax._copy import pack_bucket  # noqa: E402

MESH = Mesh(np.array(jax.devices()), ("dp",))  # process 0's devices first: device r is rank r
PLAN = dict(bucket_cap_bytes=4096)


def init(key):
    k = jax.random.split(key, 3)
    return {"emb": jax.random.normal(k[0], (40, 16)) * 0.02, "w": jax.random.uniform(k[1], (16, 24)),
            "b": jnp.zeros(24), "head": jax.random.normal(k[2], (24, 7))}


def check(shards, what: str) -> None:
    """Each device of this process holds its rank's slice of every bucket, as shard_params cuts it."""
    params = jax.jit(init)(jax.random.key(0))  # host-local, the same in every process
    layout = shards.layout.layout
    cut = shard_flat(layout.plan, MESH.size)
    arrays = layout.spec_arrays(params)
    for b, flat in enumerate(shards.buckets):
        full = np.asarray(pack_bucket(layout.plan, b, arrays, length=cut.padded_length(b), cuda=False))
        for s in flat.addressable_shards:
            rank = list(MESH.devices.flat).index(s.device)
            lo, hi = cut.shard_range(b, rank)
            assert s.data.shape == (hi - lo,), (what, b, s.data.shape)
            np.testing.assert_array_equal(np.asarray(s.data), full[lo:hi], err_msg=f"{what}: bucket {b} rank {rank}")


born = hj.init_shards(init, jax.random.key(0), mesh=MESH, axis_name="dp", **PLAN)
check(born, "born sharded")
tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
specs = hj.state_specs(tx, born, "dp", axis_size=MESH.size)
state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P("dp"), out_specs=specs))(born)
path = os.path.join(sys.argv[4], "ckpt")
checkpoint.save(path, born, state, step=3, stage=3, **PLAN)  # each process writes its devices' files
template = hj.abstract_shards(jax.eval_shape(init, jax.random.key(0)), mesh=MESH, axis_name="dp", **PLAN)
loaded, _, step = checkpoint.load(path, template, **PLAN)  # each process reads its devices' slices
assert step == 3
check(loaded, "loaded")
print(f"process {jax.process_index()}: ok, {len(born.buckets)} buckets over {MESH.size} devices", flush=True)
jax.distributed.shutdown()
