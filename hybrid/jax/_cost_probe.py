"""Measure a mesh axis's collectives into a :class:`hybrid.core.CostModel`, as
``hybrid.torch.measure_collectives`` does for a process group.

Each collective is one jitted ``shard_map`` over the axis (``psum``, ``psum_scatter``,
``all_gather``; a broadcast is a ``psum`` of a buffer that only the axis's first device fills,
what a JAX program writes for one), timed to ``block_until_ready`` after a compiled warm-up.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hybrid.core import CostModel
from hybrid.core.cost._collectives import PROBE_SIZES


def _collective(kind: str, axis_name: str):
    def body(x):
        if kind == "all_reduce":
            return jax.lax.psum(x, axis_name)
        if kind == "reduce_scatter":
            return jax.lax.psum_scatter(x, axis_name, tiled=True)
        if kind == "all_gather":
            return jax.lax.all_gather(x, axis_name, tiled=True)
        first = jax.lax.axis_index(axis_name) == 0
        return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axis_name)
    return body


def measure_collectives(mesh, axis_name: str, *, sizes=PROBE_SIZES, reps: int = 5) -> CostModel:
    """The cost model of ``mesh``'s axis ``axis_name``: all-reduce, reduce-scatter, all-gather and
    broadcast at ``sizes`` bytes (the full buffer; an all-gather's output), medians of ``reps``.

    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> model = measure_collectives(mesh, "dp", sizes=(1 << 12, 1 << 16), reps=2)
    >>> model.world_size, sorted(model.fits)
    (2, ['all_gather', 'all_reduce', 'broadcast', 'reduce_scatter'])
    """
    if reps < 1 or not sizes or min(sizes) <= 0:
        raise ValueError(f"measure_collectives needs reps >= 1 and positive sizes, got reps={reps}, sizes={sizes}")
    world = mesh.shape[axis_name]
    rows = []
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        # per device: the full buffer, except an all-gather's input, which is one device's slice
        in_spec = P(axis_name)
        fn = jax.jit(jax.shard_map(_collective(kind, axis_name), mesh=mesh, in_specs=in_spec, out_specs=P(axis_name)))
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)
            per_device = numel // world if kind == "all_gather" else numel
            x = jax.device_put(np.ones(per_device * world, np.float32),
                               jax.sharding.NamedSharding(mesh, in_spec))
            fn(x).block_until_ready()  # compile and warm up
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(x).block_until_ready()
                times.append(time.perf_counter() - t0)
            rows.append((kind, numel * 4, statistics.median(times)))
    about = {"backend": f"jax {jax.default_backend()}", "world_size": world, "jax": jax.__version__,
             "devices": sorted({d.device_kind for d in mesh.devices.flat}), "sizes": sorted(int(s) for s in sizes),
             "reps": reps, "processes": jax.process_count()}
    return CostModel.fit(rows, world_size=world, about=about)
