"""``python -m hybrid demo``: one model trained by both frontends, compared, and handed over.

1. the plan both frontends execute (buckets and each rank's flat shard);
2. torch: DDP + ZeRO on a spawned gloo world; it saves a sharded checkpoint midway;
3. JAX: ``hybrid.jax.zero`` over host devices, from the same numpy init and batches;
4. losses side by side and the parity figure (max |torch - jax| of the parameters);
5. JAX resumes the torch checkpoint at another world size and continues the curve;
6. a PNG of the loss curves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from hybrid._table import format_table, human_bytes

# Parameters may differ by float32 rounding of two implementations (tests/parity's tolerances).
PARITY_RTOL, PARITY_ATOL = 1e-4, 1e-5


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="train one model with the torch and the JAX frontend, compare, hand over a checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--world-size", type=int, default=2, help="torch ranks and JAX devices (default 2)")
    p.add_argument("--resume-world-size", type=int, default=None,
                   help="JAX devices that resume the torch checkpoint (default world size + 1)")
    p.add_argument("--save-at", type=int, default=None, help="step after which torch saves (default steps / 2)")
    p.add_argument("--stage", type=int, choices=(1, 2), default=1, help="ZeRO stage (default 1)")
    p.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--batch-size", type=int, default=48, help="global batch rows, split evenly (default 48)")
    p.add_argument("--out", default="hybrid-demo", help="folder for the checkpoint and the plot (default ./hybrid-demo)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _check(args) -> None:
    resume = args.resume_world_size or args.world_size + 1
    for name, value in (("--world-size", args.world_size), ("--resume-world-size", resume)):
        if value < 1 or args.batch_size % value:
            raise SystemExit(f"hybrid demo: {name} {value} must be >= 1 and divide --batch-size {args.batch_size}")
    if args.steps < 2:
        raise SystemExit(f"hybrid demo: --steps must be at least 2, got {args.steps}")
    save_at = args.steps // 2 if args.save_at is None else args.save_at
    if not 0 < save_at < args.steps:
        raise SystemExit(f"hybrid demo: --save-at must be in 1..{args.steps - 1}, got {save_at}")
    args.resume_world_size, args.save_at = resume, save_at


def _host_devices(n: int) -> None:
    # JAX fixes its CPU device count when it starts: ask for enough before anything imports it.
    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _print_plan(config, world_size: int) -> None:
    from hybrid.core import plan_buckets, shard_flat
    from hybrid.demo import param_specs

    specs = param_specs(config.sizes)
    plan = plan_buckets(specs, bucket_cap_bytes=config.bucket_cap_bytes, first_bucket_cap_bytes=config.bucket_cap_bytes)
    shards = shard_flat(plan, world_size)
    print(f"Model: MLP {'-'.join(map(str, config.sizes))}, {len(specs)} tensors, "
          f"{sum(s.numel for s in specs):,} parameters; plan {plan.fingerprint()} "
          f"(bucket cap {config.bucket_cap_bytes} B: one tensor per bucket, so torch's rebuilt buckets equal JAX's)")
    rows = []
    for b, bucket in enumerate(plan.buckets):
        names = ", ".join(specs[m].name for m in bucket.members)
        rows.append([b, names, bucket.length, human_bytes(bucket.nbytes),
                     " ".join(f"[{lo}:{hi})" for _, lo, hi in (shards.rank_shards(r)[b] for r in range(world_size)))])
    print(format_table(["bucket", "tensors", "elements", "bytes", f"flat shard of ranks 0..{world_size - 1}"], rows))


def _bar(desc: str, total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True)


def _run_torch(config, args, checkpoint: Path):
    from hybrid.demo import launch_torch

    bar = _bar(f"torch  DDP + ZeRO-{args.stage}, {args.world_size} gloo ranks", config.num_steps)
    with bar:
        def progress(step, loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        return launch_torch(config, world_size=args.world_size, progress=progress,
                            save_to=str(checkpoint), save_at=args.save_at)


def _run_jax(config, num_devices: int, desc: str, resume: Path | None = None):
    from hybrid.demo import train_jax

    total = config.num_steps - (0 if resume is None else _saved_step(resume))
    bar = _bar(desc, total)
    with bar:
        def progress(step, loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        return train_jax(config, num_devices=num_devices, progress=progress,
                         resume=None if resume is None else str(resume))


def _saved_step(path: Path) -> int:
    from hybrid.checkpoint import Checkpoint
    return Checkpoint(path).manifest.step


def _print_losses(torch_run, jax_run, resumed, save_at: int) -> None:
    rows = []
    steps = len(torch_run.losses)
    shown = range(steps) if steps <= 60 else sorted(set(range(0, steps, max(1, steps // 20))) | {save_at, steps - 1})
    for i in shown:
        r = resumed.losses[i - save_at] if i >= save_at else None
        rows.append([i, f"{torch_run.losses[i]:.6f}", f"{jax_run.losses[i]:.6f}",
                     f"{abs(torch_run.losses[i] - jax_run.losses[i]):.1e}",
                     "" if r is None else f"{r:.6f}", "" if r is None else f"{abs(r - torch_run.losses[i]):.1e}"])
    print(format_table(["step", "torch", "jax", "|torch-jax|", "jax, resumed", "|resumed-torch|"], rows))


def _plot(path: Path, torch_run, jax_run, resumed, save_at: int, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(len(torch_run.losses))
    ax.plot(steps, torch_run.losses, label=f"torch: DDP + ZeRO-{args.stage}, {args.world_size} ranks", lw=2.5, alpha=0.6)
    ax.plot(steps, jax_run.losses, "--", label=f"JAX: zero stage {args.stage}, {args.world_size} devices")
    ax.plot(steps[save_at:], resumed.losses, ":", lw=2.5,
            label=f"JAX, {args.resume_world_size} devices, resumed from torch's checkpoint")
    ax.axvline(save_at, color="grey", lw=0.8)
    ax.annotate("checkpoint", (save_at, ax.get_ylim()[1]), ha="left", va="top", fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (global batch)")
    ax.set_title("hybrid: one plan, two frameworks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    """The demo; returns the exit status (1 with a message on stderr when anything fails)."""
    t0 = time.perf_counter()
    _check(args)
    _host_devices(max(args.world_size, args.resume_world_size))
    try:
        return _demo(args, t0)
    except Exception as e:  # noqa: BLE001 - the command's contract: a clear message, non-zero exit
        print(f"\nhybrid demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _demo(args, t0: float) -> int:
    from hybrid.demo import TrainConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "checkpoint"
    config = TrainConfig(seed=args.seed, global_batch_size=args.batch_size, num_steps=args.steps,
                         optimizer=args.optimizer, lr=args.lr, stage=args.stage,
                         weight_decay=0.01 if args.optimizer == "adamw" else 0.0)
    _print_plan(config, args.world_size)
    print()
    torch_run = _run_torch(config, args, checkpoint)
    jax_run = _run_jax(config, args.world_size, f"jax    zero stage {args.stage}, {args.world_size} devices")
    resumed = _run_jax(config, args.resume_world_size,
                       f"jax    resume torch's step-{args.save_at} checkpoint on {args.resume_world_size} devices",
                       resume=checkpoint)
    print()
    _print_losses(torch_run, jax_run, resumed, args.save_at)
    params_diff = max(float(np.max(np.abs(torch_run.params[k] - jax_run.params[k]))) for k in torch_run.params)
    resumed_diff = max(float(np.max(np.abs(torch_run.params[k] - resumed.params[k]))) for k in torch_run.params)
    same_plan = torch_run.plan_fingerprint == jax_run.plan_fingerprint
    print(f"\nPlan fingerprints: torch {torch_run.plan_fingerprint}, jax {jax_run.plan_fingerprint} "
          f"({'equal' if same_plan else 'DIFFERENT'})")
    print(f"Parity, max |torch - jax| over all parameters after {args.steps} steps: {params_diff:.2e}")
    print(f"Hand-over, max |torch - jax resumed at {args.resume_world_size} devices| of the final parameters: "
          f"{resumed_diff:.2e}")
    print(f"Checkpoint (torch, {args.world_size} rank files + manifest.json): {checkpoint}")
    plot = out / "loss_curves.png"
    _plot(plot, torch_run, jax_run, resumed, args.save_at, args)
    print(f"Plot of the loss curves: {plot}")
    ok = all(np.allclose(torch_run.params[k], run.params[k], rtol=PARITY_RTOL, atol=PARITY_ATOL)
             for run in (jax_run, resumed) for k in torch_run.params)
    print(f"Done in {time.perf_counter() - t0:.1f} s.")
    if not ok or not same_plan:
        print(f"hybrid demo failed: the frameworks disagree beyond rtol {PARITY_RTOL} / atol {PARITY_ATOL} "
              f"(or their plans differ)", file=sys.stderr)
        return 1
    return 0
