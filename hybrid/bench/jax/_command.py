"""``python -m hybrid bench jax``: bucketed all-reduce and ZeRO against plain optax, 4 host devices.

Every variant is a full jitted shard_map train step (forward, per-device gradient, reduction,
optimizer, apply) with params and state donated, as a training loop does. Two measurements, each
with its variants run interleaved (A, B, C, A, B, C...) and timed per repetition, its reference
(the unsharded or per-leaf step) twice per repetition for the A/A row; medians are printed, and at
the end the ratio table of both (``hybrid.bench._stats``):

1. data-parallel SGD on a ~10M-parameter MLP (3 buckets at DDP's 25 MiB / 1 MiB caps) with a
   global batch of 1024 rows, so the step does the forward and backward work of training rather
   than only moving gradients: per-leaf ``pmean`` (the baseline) against ``bucketed_all_reduce``
   with persistent buckets (the default) and with buckets concatenated afresh every step.
   ``--breakdown`` adds a step without any reduction (the compute floor) and one that packs and
   unpacks the buckets without reducing them (what the copies alone cost).
2. ZeRO stages 1, 2 and 3 against unsharded adam on a 4.2M-parameter MLP, and the bytes a
   device holds between steps (stage 3: its parameter slices too, gathered inside the loss).
3. ZeRO inside a plain ``jax.jit`` (``zero(..., mesh=mesh)``, stages 1-3) and the ``shard_map``
   path against GSPMD's own ZeRO-1 and FSDP and the replicated step, on 8 x Linear(512) with
   AdamW: times, compiled temporaries, bytes held, collectives (``hybrid.bench.jax._jit``).

The optimized HLO of the SGD steps is summarised too (collectives after XLA's all-reduce
combiner, concatenates, in-place updates): on host devices the per-leaf psums are merged into one
all-reduce of the leaves in place, so bucketing's one extra cost there is filling the buckets.

With ``--device cuda`` (or ``cpu``) it times GPT training steps instead (GPT-2 small by default,
float32 and bf16, AdamW): ``zero`` stages 1-3 against unsharded optax on every GPU (or host
device), the bucket copies through the CUDA kernels where they are built (``hybrid.bench.gpt``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from hybrid.bench import gpt
from hybrid.bench.jax import _jit, _steps
from hybrid.bench.jax._steps import bytes_per_device, pmean_tree, print_times, run_interleaved
from hybrid.bench._stats import Ratio, ratio_table


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


def _entry_ops(text: str) -> list[tuple[str, str]]:
    """``(instruction name, opcode)`` of the ENTRY computation of an optimized HLO module."""
    entry = text[text.index("\nENTRY "):]
    ops = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        op = re.search(r"\s([a-z][a-z0-9\-]*)\(", line[m.end() - 1:]) if m else None
        if op:
            ops.append((m.group(1), op.group(1)))
    return ops


def _hlo_summary(text: str) -> str:
    """Counts of the ops that decide the copy and communication cost."""
    ops = _entry_ops(text)
    count = lambda opcode: sum(op == opcode for _, op in ops)
    concats = sum(op == "concatenate" or (op == "fusion" and "concatenate" in name) for name, op in ops)
    in_place = sum(op == "fusion" and "dynamic-update-slice" in name for name, op in ops)
    return (f"{count('all-reduce')} all-reduce, {concats} concatenate (incl. fused), "
            f"{in_place} dynamic-update-slice fusions, {count('copy')} copy, {count('pad')} pad, "
            f"{count('fusion')} fusions")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench jax")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and few repetitions (--device: its model, 5 rounds after 2)")
    parser.add_argument("--width", type=int, default=1024, help="SGD model: layer width")
    parser.add_argument("--depth", type=int, default=10, help="SGD model: layers")
    parser.add_argument("--batch", type=int, default=None,
                        help="SGD model: global batch, split over devices (default 1024); --device: sequences per device (default 8)")
    parser.add_argument("--reps", type=int, default=None,
                        help="SGD measurement: interleaved repetitions (default 15); --device: rounds (default 20)")
    parser.add_argument("--steps", type=int, default=1, help="SGD measurement: steps timed per repetition")
    parser.add_argument("--breakdown", action="store_true", help="also time steps without reduction, with and without packing")
    parser.add_argument("--zero-width", type=int, default=512)
    parser.add_argument("--zero-depth", type=int, default=16)
    parser.add_argument("--zero-batch", type=int, default=64)
    parser.add_argument("--zero-reps", type=int, default=7)
    parser.add_argument("--zero-steps", type=int, default=3)
    parser.add_argument("--skip-zero", action="store_true", help="only the SGD measurement")
    parser.add_argument("--jit-width", type=int, default=512, help="[3] ZeRO in a plain jit: layer width")
    parser.add_argument("--jit-depth", type=int, default=8, help="[3]: layers")
    parser.add_argument("--jit-batch", type=int, default=64, help="[3]: global batch")
    parser.add_argument("--jit-reps", type=int, default=7, help="[3]: interleaved repetitions")
    parser.add_argument("--jit-steps", type=int, default=3, help="[3]: steps timed per repetition")
    parser.add_argument("--skip-jit", action="store_true", help="without [3]")
    parser.add_argument("--jit-only", action="store_true", help="only [3]: ZeRO in a plain jit against GSPMD's own")
    gpt.add_arguments(parser, batch=False)
    parser.add_argument("--copy-backend", choices=("auto", "cuda", "reference"), default=None,
                        help="with --device: zero's bucket copies (default: $HYBRID_KERNELS, else auto)")
    args = parser.parse_args(argv)
    bench = gpt.config_from_args(parser, args)
    if bench is None and args.copy_backend is not None:
        parser.error("--copy-backend only with --device, for the GPT training-step bench")
    if "jax" not in sys.modules and (bench is None or bench.device == "cpu"):
        # host devices are configured before jax is first imported
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if bench is not None:
        return gpt.jax_main(parser, bench, args.copy_backend)
    args.batch = 1024 if args.batch is None else args.batch
    args.reps = 15 if args.reps is None else args.reps
    if args.quick:
        args.width, args.depth, args.batch, args.reps, args.steps = 256, 4, 64, 3, 2
        args.zero_width, args.zero_depth, args.zero_reps, args.zero_steps = 128, 4, 3, 2
        args.jit_width, args.jit_depth, args.jit_reps, args.jit_steps = 128, 4, 3, 2

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import hybrid.jax as hj
    from hybrid.core import plan_buckets

    devices = jax.devices()
    if len(devices) < 4:
        print(f"bench jax needs 4 devices, found {len(devices)}; set "
              f"XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported", file=sys.stderr)
        return 1
    mesh = Mesh(np.array(devices[:4]), ("dp",))

    def with_jit(groups):  # [3] ZeRO inside a plain jit against GSPMD's own ZeRO-1 and FSDP
        if not args.skip_jit:
            groups.update(_jit.run(args.jit_width, args.jit_depth, args.jit_batch, args.jit_reps, args.jit_steps, mesh))
        return groups

    if args.jit_only:
        print("\n" + ratio_table(with_jit({})))
        return 0

    def pack_only():  # bucketed_all_reduce without its collective: what packing alone costs
        from hybrid.core import pack, unpack
        from hybrid.jax._specs import _Layout

        def update(u, s, p=None):
            del p
            layout = _Layout.of(u, what="bench", order=None, bucket_cap_bytes=25 << 20,
                                first_bucket_cap_bytes=1 << 20)
            arrays, out = layout.spec_arrays(u), {}
            for b in range(layout.plan.num_buckets):
                # The barrier stands in for the collective: without it XLA folds slice(concat)
                # back into the leaves and nothing is copied.
                flat = jax.lax.optimization_barrier(pack(layout.plan, b, arrays))
                out.update(unpack(layout.plan, b, flat))
            return layout.unflatten(out), s
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    def batch(rows, width):
        return jnp.asarray(np.random.default_rng(1).normal(size=(rows, width)).astype(np.float32))

    # 1. bucketed all-reduce vs per-leaf pmean, SGD
    params, x = _model(args.width, args.depth), batch(args.batch, args.width)
    num_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    plan = plan_buckets(hj.specs(params))
    variants = {"psum_sgd": (optax.chain(pmean_tree("dp"), optax.sgd(1e-3)), True),
                "bucketed_sgd": (optax.chain(hj.bucketed_all_reduce("dp"), optax.sgd(1e-3)), True),
                "bucketed_per_step_sgd": (optax.chain(hj.bucketed_all_reduce("dp", persistent_buckets=False),
                                                      optax.sgd(1e-3)), True)}
    if args.breakdown:
        variants["local_sgd"] = (optax.sgd(1e-3), False)
        variants["pack_only_sgd"] = (optax.chain(pack_only(), optax.sgd(1e-3)), False)
    steps, states = _steps.compile_steps(variants, params, x, mesh, _loss)
    # psum_sgd again right after bucketed_sgd, as bucketed_sgd is after psum_sgd: the A/A row.
    order = ["psum_sgd", "bucketed_sgd", "psum_sgd'", *list(variants)[2:]]
    times, cpu = run_interleaved(steps, states, x, args.reps, args.steps, order)
    print(f"bench jax: 4 host devices ({devices[0].platform}), {os.cpu_count()} CPU cores")
    print(f"[1] data-parallel SGD step: MLP {args.depth} x {args.width}^2, {num_params} float32 params "
          f"in {plan.num_buckets} buckets (25 MiB / 1 MiB caps), global batch {args.batch}, "
          f"{args.reps} reps x {args.steps} steps interleaved, medians; target bucketed_sgd/psum_sgd <= 1.05")
    med, cpu_med = print_times(times, cpu)
    for name in ("bucketed_sgd", "bucketed_per_step_sgd"):
        print(f"  {name}/psum_sgd: of minima {min(times[name]) / min(times['psum_sgd']):.3f}, "
              f"of CPU time {cpu_med[name] / cpu_med['psum_sgd']:.3f} (wall time: the ratio table below)")
    groups = {"[1] sgd": ([Ratio(name, "psum_sgd", times[name], times["psum_sgd"])
                           for name in ("bucketed_sgd", "bucketed_per_step_sgd")],
                          Ratio("psum_sgd'", "psum_sgd", times["psum_sgd'"], times["psum_sgd"]))}
    if args.breakdown:
        print(f"  reduction cost (psum - local)   : {(med['psum_sgd'] - med['local_sgd']) * 1e3:.2f} ms; "
              f"bucketing overhead (bucketed - psum): {(med['bucketed_sgd'] - med['psum_sgd']) * 1e3:.2f} ms; "
              f"pack + unpack alone (pack_only - local): {(med['pack_only_sgd'] - med['local_sgd']) * 1e3:.2f} ms")
    for name in ("psum_sgd", "bucketed_sgd", "bucketed_per_step_sgd"):
        print(f"  optimized HLO {name:22s}: {_hlo_summary(steps[name].as_text())}")
    del steps, states

    if args.skip_zero:
        print("\n" + ratio_table(groups))
        return 0
    # 2. ZeRO vs unsharded adam
    params, x = _model(args.zero_width, args.zero_depth), batch(args.zero_batch, args.zero_width)
    num_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    adam = lambda: optax.adam(1e-3)
    variants = {"unsharded_adam": (optax.chain(pmean_tree("dp"), adam()), True),
                "zero1_adam": (hj.zero(adam(), "dp", stage=1), True),
                "zero2_adam": (hj.zero(adam(), "dp", stage=2), True)}
    steps, states = _steps.compile_steps(variants, params, x, mesh, _loss)
    steps["zero3_adam"], states["zero3_adam"] = _steps.compile_zero3(hj.zero(adam(), "dp", stage=3), params, x, mesh, _loss)
    order = ["unsharded_adam", "zero1_adam", "unsharded_adam'", "zero2_adam", "zero3_adam"]
    times, cpu = run_interleaved(steps, states, x, args.zero_reps, args.zero_steps, order)
    print(f"[2] ZeRO: MLP {args.zero_depth} x {args.zero_width}^2, {num_params} float32 params, global batch "
          f"{args.zero_batch}, {args.zero_reps} reps x {args.zero_steps} steps interleaved, medians")
    print_times(times, cpu)
    groups["[2] zero"] = ([Ratio(f"zero{stage}_adam", "unsharded_adam", times[f"zero{stage}_adam"],
                                 times["unsharded_adam"]) for stage in (1, 2, 3)]
                          + [Ratio("zero3_adam", "zero2_adam", times["zero3_adam"], times["zero2_adam"])],
                          Ratio("unsharded_adam'", "unsharded_adam", times["unsharded_adam'"], times["unsharded_adam"]))
    dev = devices[0]
    full = bytes_per_device(states["unsharded_adam"][1], dev)
    for name in ("zero1_adam", "zero2_adam"):
        b = bytes_per_device(states[name][1], dev)
        print(f"  optimizer state bytes/device {name}: {b} / unsharded {full} = {b / full:.4f} "
              f"(1/world_size = 0.25)")
    # Held between steps: params and state (stage 3: both as slices; the others keep full params).
    held = {name: bytes_per_device(states[name], dev) for name in ("unsharded_adam", "zero2_adam", "zero3_adam")}
    for name in ("zero2_adam", "zero3_adam"):
        print(f"  params + state bytes/device {name}: {held[name]} / unsharded {held['unsharded_adam']} = "
              f"{held[name] / held['unsharded_adam']:.4f}")
    print("\n" + ratio_table(with_jit(groups)))
    return 0
