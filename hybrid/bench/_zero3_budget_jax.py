"""The JAX side of ``bench zero --part budget``: the same model at stage 3 on ``N`` host devices,
born sharded (``hybrid.jax.init_shards``), 3 steps of ``zero(adam, stage=3)``; what each device
holds (its slices of the parameters and of Adam's state, counted from the arrays' shards) and the
temporaries XLA's compiled init and step say they need (``memory_analysis``), per device.

    python -m hybrid.bench._zero3_budget_jax N WIDTH DEPTH BATCH OUT.json [memory-first]

``memory-first``: with :func:`hybrid.jax.use_memory_first_xla_cpu`'s XLA:CPU flags. Run in a
process of its own: the device count and the flags must be set before JAX starts. OUT.json also
holds the median step time over 5 more steps and a checksum of the trained parameters (their
float64 sum), so runs with and without the flags can be compared.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(world: int, width: int, depth: int, batch: int, out: str, memory_first: bool = False) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    import hybrid.jax as hj
    from hybrid.jax.sharded._init import born_sharded

    if memory_first:
        hj.use_memory_first_xla_cpu()

    mesh = Mesh(np.array(jax.devices()[:world]), ("dp",))
    bound = 1 / width ** 0.5

    def init(key):
        keys = jax.random.split(key, 2 * depth)
        return {"layers": [{"w": jax.random.uniform(keys[2 * i], (width, width), minval=-bound, maxval=bound),
                            "b": jax.random.uniform(keys[2 * i + 1], (width,), minval=-bound, maxval=bound)}
                           for i in range(depth)]}

    def loss(params, x):
        for layer in params["layers"]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean(x ** 2)

    order = [f"layers.{i}.{k}" for i in range(depth) for k in ("w", "b")]  # torch's registration order
    device = mesh.devices.flat[0]

    def held(*trees) -> int:
        return sum(s.data.nbytes for x in jax.tree.leaves(trees) for s in x.addressable_shards if s.device == device)

    key = jax.random.key(0)
    born = born_sharded(init, key, mesh=mesh, axis_name="dp", order=order, pairing=None, plan=None,
                        bucket_cap_bytes=None, first_bucket_cap_bytes=None)  # init_shards' programs, compiled once
    init_temp = born.temp_bytes(key)
    shards = born(key)
    init_held = held(shards)
    tx = hj.zero(optax.adam(1e-3), "dp", stage=3)
    specs = hj.state_specs(tx, shards, "dp", axis_size=world)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))(shards)

    def step(s, st, x):
        u, st = tx.update(jax.grad(hj.gathered(loss))(s, x), st, s)
        return optax.apply_updates(s, u), st

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp")), out_specs=(P("dp"), specs)),
                   donate_argnums=(0, 1))
    x = jax.random.normal(jax.random.key(1), (batch * world, width))
    step_temp = step.lower(shards, state, x).compile().memory_analysis().temp_size_in_bytes
    for _ in range(3):
        shards, state = step(shards, state, x)
    jax.block_until_ready(shards)
    held_after = held(shards, state)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        shards, state = jax.block_until_ready(step(shards, state, x))
        times.append(time.perf_counter() - t0)
    checksum = sum(float(np.asarray(b, np.float64).sum()) for b in shards.buckets)
    with open(out, "w") as f:
        json.dump({"init_held": init_held, "init_temp": init_temp, "held": held_after, "step_temp": step_temp,
                   "step_s": statistics.median(times), "checksum": checksum}, f)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5], memory_first=sys.argv[6:] == ["memory-first"])
