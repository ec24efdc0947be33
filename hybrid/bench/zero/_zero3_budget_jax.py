"""The JAX side of ``bench zero --part budget``: the same model at stage 3 on ``N`` host devices,
born sharded (``hybrid.jax.init_shards``), 3 steps of ``zero(adam, stage=3)``; what each device
holds (its slices of the parameters and of Adam's state, counted from the arrays' shards) and the
temporaries XLA's compiled init and step say they need (``memory_analysis``), per device.

    python -m hybrid.bench.zero._zero3_budget_jax N WIDTH DEPTH BATCH OUT.json [memory-first] [offload]

``memory-first``: with :func:`hybrid.jax.use_memory_first_xla_cpu`'s XLA:CPU flags. ``offload``:
Adam's state in files (:class:`hybrid.jax.OffloadedZero3`, under a temporary directory beside
OUT.json; ``in_files``: their bytes per device), saved and loaded back before the steps
(``hybrid.checkpoint.jax.load`` into the optimizer: a slot at a time into the files, then the
parameters into a template of shapes; ``load_held`` and ``read_buffers``, numpy's per device),
the gradients from a jitted program of their own, then the update bucket by bucket;
its ``step_temp`` is the larger of the gradient program's needs (temporaries and the gradient
slices it returns) and the gradient slices plus the largest bucket update's (its state in, new
state and parameters out, temporaries), counted without the aliasing XLA may do: a bound. Run
in a process of its own: the device count and the flags must be set before JAX starts. OUT.json
also holds the median step time over 5 more steps and a checksum of the trained parameters
(their float64 sum), so runs with and without the flags can be compared.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import time
import tracemalloc


def main(world: int, width: int, depth: int, batch: int, out: str, memory_first: bool = False,
         offload: bool = False) -> None:
    # this run's device count; the caller's other XLA flags kept (its code generation, say)
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={world}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

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
    x = jax.random.normal(jax.random.key(1), (batch * world, width))
    loaded = {}
    if offload:
        directory = os.path.dirname(os.path.abspath(out))
        step, step_temp, in_files = _offloaded(hj, mesh, loss, shards, x, directory)
        # Saved, dropped, and loaded straight into slices and files: a template of shapes, the
        # state a slot at a time (numpy's read buffers counted by tracemalloc, per device).
        from hybrid.checkpoint import jax as ckpt_jax

        path = os.path.join(directory, f"jax-ckpt-{world}")
        ckpt_jax.save(path, shards, step.opt.zero_state(), step=0, stage=3)
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), shards)
        del shards
        gc.collect()
        tracemalloc.start()
        shards, _, _ = ckpt_jax.load(path, template, step.opt)
        loaded = {"load_held": held(shards), "read_buffers": tracemalloc.get_traced_memory()[1] // world}
        tracemalloc.stop()
        shutil.rmtree(path)
    else:
        step, step_temp, in_files = _resident(hj, mesh, loss, shards, x)
    for _ in range(3):
        shards = step(shards, x)
    jax.block_until_ready(shards)
    held_after = held(shards, *step.state())
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        shards = jax.block_until_ready(step(shards, x))
        times.append(time.perf_counter() - t0)
    checksum = sum(float(np.asarray(b, np.float64).sum()) for b in shards.buckets)
    if offload:
        os.rmdir(step.opt.directory)  # empty: each file was unlinked as it was mapped
    with open(out, "w") as f:
        json.dump({"init_held": init_held, "init_temp": init_temp, "held": held_after, "step_temp": step_temp,
                   "in_files": in_files(), "step_s": statistics.median(times), "checksum": checksum, **loaded}, f)


def _resident(hj, mesh, loss, shards, x):
    """``zero(adam, stage=3)``'s one jitted step, the state on the devices: ``(step, temp, in_files)``."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    world = mesh.size
    tx = hj.zero(optax.adam(1e-3), "dp", stage=3)
    specs = hj.state_specs(tx, shards, "dp", axis_size=world)
    box = [jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))(shards)]

    def update(s, st, x):
        u, st = tx.update(jax.grad(hj.gathered(loss))(s, x), st, s)
        return optax.apply_updates(s, u), st

    program = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("dp"), specs, P("dp")),
                                    out_specs=(P("dp"), specs)), donate_argnums=(0, 1))
    temp = program.lower(shards, box[0], x).compile().memory_analysis().temp_size_in_bytes

    def step(s, x):
        s, box[0] = program(s, box[0], x)
        return s

    step.state = lambda: (box[0],)
    return step, temp, lambda: 0


def _offloaded(hj, mesh, loss, shards, x, directory):
    """:class:`hybrid.jax.OffloadedZero3`'s step: ``(step, bound on its device bytes beyond the
    parameter slices, bytes in files)``; see the module docstring."""
    import tempfile

    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    device = mesh.devices.flat[0]
    mine = lambda arrays: sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)
    opt = hj.OffloadedZero3(optax.adam(1e-3), mesh, "dp", tempfile.mkdtemp(prefix="jax-offload-", dir=directory))
    opt.init(shards)
    grad = jax.jit(jax.shard_map(jax.grad(hj.gathered(loss)), mesh=mesh, in_specs=(P("dp"), P("dp")),
                                 out_specs=P("dp")))
    g_mem = grad.lower(shards, x).compile().memory_analysis()
    grads = grad(shards, x)
    share = mine(grads.buckets)
    worst = 0
    for b, meta in enumerate(opt._buckets):
        state = opt._files[b].read(meta.shardings, meta.shapes)
        # adam alone makes no global decision (no clip or skip to measure first): no totals
        m = opt._program(b, "update").lower(shards.buckets[b], grads.buckets[b], state, []).compile().memory_analysis()
        worst = max(worst, mine(state) + m.temp_size_in_bytes + m.output_size_in_bytes)
        del state
    del grads
    temp = max(g_mem.temp_size_in_bytes + g_mem.output_size_in_bytes, share + worst)

    def step(s, x):
        return opt.step(s, grad(s, x))

    step.state, step.opt = (lambda: ()), opt
    return step, temp, lambda: opt.offloaded_bytes() // mesh.size  # the process's files, per device


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5], memory_first="memory-first" in sys.argv[6:],
         offload="offload" in sys.argv[6:])
