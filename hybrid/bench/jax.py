"""``python -m hybrid bench jax``: bucketed all-reduce and ZeRO against plain optax, 4 host devices.

Every variant is a full jitted shard_map train step (forward, per-device gradient, reduction,
optimizer, apply) on the same MLP and batch. Variants run interleaved (A, B, C, ... repeated),
each timed over a few steps per repetition; the medians and their ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "jax" not in sys.modules:  # host devices must be configured before jax is first imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _model(width: int, depth: int, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np
    r = np.random.default_rng(seed)
    return {"layers": [{"weight": jnp.asarray(r.normal(size=(width, width)).astype(np.float32) / np.sqrt(width)),
                        "bias": jnp.zeros(width, jnp.float32)} for _ in range(depth)]}


def _loss(params, x):
    import jax.numpy as jnp
    h = x
    for layer in params["layers"]:
        h = jnp.tanh(h @ layer["weight"] + layer["bias"])
    return jnp.mean(h * h)


def _bytes_per_device(state, device) -> int:
    import jax
    return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(state) for s in x.addressable_shards
               if s.device == device)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench jax")
    parser.add_argument("--quick", action="store_true", help="a tiny model and few repetitions")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over devices)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per repetition")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.reps, args.steps = 128, 4, 3, 2

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    import hybrid.jax as hj
    from hybrid.core import plan_buckets

    devices = jax.devices()
    if len(devices) < 4:
        print(f"bench jax needs 4 devices, found {len(devices)}; set "
              f"XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported", file=sys.stderr)
        return 1
    mesh = Mesh(np.array(devices[:4]), ("dp",))
    params = _model(args.width, args.depth)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(args.batch, args.width)).astype(np.float32))
    num_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    plan = plan_buckets(hj.specs(params))

    def pmean_tree(axis):  # the baseline DDP-style reduction: one pmean per leaf
        def update(u, s, p=None):
            del p
            return jax.lax.pmean(u, axis), s
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    adam = lambda: optax.adam(1e-3)
    variants = {
        "psum_sgd": optax.chain(pmean_tree("dp"), optax.sgd(1e-3)),
        "bucketed_sgd": optax.chain(hj.bucketed_all_reduce("dp"), optax.sgd(1e-3)),
        "unsharded_adam": optax.chain(pmean_tree("dp"), adam()),
        "zero1_adam": hj.zero(adam(), "dp", stage=1),
        "zero2_adam": hj.zero(adam(), "dp", stage=2),
    }
    steps, states = {}, {}
    for name, tx in variants.items():
        if name.startswith("zero"):
            specs = hj.zero_state_specs(tx, params, "dp", axis_size=4)
        else:
            specs = jax.tree_util.tree_map(lambda _: P(), jax.eval_shape(tx.init, params))

        def step(params, state, x, tx=tx):
            g = hj.local_grad(_loss, "dp")(params, x)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state

        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        steps[name] = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("dp")),
                                            out_specs=(P(), specs)), donate_argnums=(1,))
        states[name] = (params, init(params))
        states[name] = jax.block_until_ready(steps[name](*states[name], x))  # compile + warm up

    times = {name: [] for name in variants}
    for _ in range(args.reps):
        for name in variants:  # interleaved: every repetition times every variant once
            p, s = states[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                p, s = steps[name](p, s, x)
            jax.block_until_ready((p, s))
            times[name].append((time.perf_counter() - t0) / args.steps)
            states[name] = (p, s)
    med = {name: statistics.median(t) for name, t in times.items()}

    print(f"bench jax: 4 host devices ({jax.devices()[0].platform}), MLP {args.depth} x {args.width}^2, "
          f"{num_params} float32 params in {plan.num_buckets} buckets (25 MiB / 1 MiB caps), "
          f"global batch {args.batch}, {args.reps} reps x {args.steps} steps, medians")
    for name in variants:
        print(f"  {name:16s} {med[name] * 1e3:9.2f} ms/step  (min {min(times[name]) * 1e3:.2f}, "
              f"max {max(times[name]) * 1e3:.2f})")
    print(f"  bucketed_all_reduce / psum step : {med['bucketed_sgd'] / med['psum_sgd']:.3f}  (target <= 1.05)")
    print(f"  zero stage 1 / unsharded adam   : {med['zero1_adam'] / med['unsharded_adam']:.3f}")
    print(f"  zero stage 2 / unsharded adam   : {med['zero2_adam'] / med['unsharded_adam']:.3f}")
    dev = devices[0]
    full = _bytes_per_device(states["unsharded_adam"][1], dev)
    for name in ("zero1_adam", "zero2_adam"):
        b = _bytes_per_device(states[name][1], dev)
        print(f"  optimizer state bytes/device {name}: {b} / unsharded {full} = {b / full:.4f} "
              f"(1/world_size = 0.25)")
    return 0
