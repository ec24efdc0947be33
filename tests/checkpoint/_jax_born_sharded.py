"""Stage-3 parameters born sharded over the mesh of every process's devices, saved, and loaded into
abstract shards; each process checks the slices its devices hold against ``shard_params`` of the
jitted init, computed on its own. Run by ``_jax_mp_worker.py`` in a job of 2 processes x 2 devices
(its ``"born_sharded": DIR``), after that job's training: the job's processes are started once.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import jax as checkpoint
from hybrid.core import shard_flat
from hybrid.jax._copy import pack_bucket

PLAN = dict(bucket_cap_bytes=4096)


def init(key):
    k = jax.random.split(key, 3)
    return {"emb": jax.random.normal(k[0], (40, 16)) * 0.02, "w": jax.random.uniform(k[1], (16, 24)),
            "b": jnp.zeros(24), "head": jax.random.normal(k[2], (24, 7))}


def check(mesh, shards, what: str) -> None:
    """Each device of this process holds its rank's slice of every bucket, as shard_params cuts it."""
    params = jax.jit(init)(jax.random.key(0))  # host-local, the same in every process
    layout = shards.layout.layout
    cut = shard_flat(layout.plan, mesh.size)
    arrays = layout.spec_arrays(params)
    for b, flat in enumerate(shards.buckets):
        full = np.asarray(pack_bucket(layout.plan, b, arrays, length=cut.padded_length(b), cuda=False))
        for s in flat.addressable_shards:
            rank = list(mesh.devices.flat).index(s.device)
            lo, hi = cut.shard_range(b, rank)
            assert s.data.shape == (hi - lo,), (what, b, s.data.shape)
            np.testing.assert_array_equal(np.asarray(s.data), full[lo:hi], err_msg=f"{what}: bucket {b} rank {rank}")


def born_sharded(mesh, directory: str) -> str:
    """Born sharded, checked, saved (each process its devices' files), loaded into abstract shards
    (each process reads its devices' slices), checked again; the line the test looks for."""
    born = hj.init_shards(init, jax.random.key(0), mesh=mesh, axis_name="dp", **PLAN)
    check(mesh, born, "born sharded")
    tx = hj.zero(optax.adam(1e-2), "dp", stage=3)
    specs = hj.state_specs(tx, born, "dp", axis_size=mesh.size)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))(born)
    path = os.path.join(directory, "ckpt")
    checkpoint.save(path, born, state, step=3, stage=3, **PLAN)
    template = hj.abstract_shards(jax.eval_shape(init, jax.random.key(0)), mesh=mesh, axis_name="dp", **PLAN)
    loaded, _, step = checkpoint.load(path, template, **PLAN)
    assert step == 3
    check(mesh, loaded, "loaded")
    return f"process {jax.process_index()}: born sharded ok, {len(born.buckets)} buckets over {mesh.size} devices"
