"""``python -m hybrid plan --project``: the model's step communication at scale, on paper.

For DDP and ZeRO stages 1-3 at N ranks on named networks (and on this machine's measured process
group, ``--cost``): bytes each rank sends per step, time on the wire, and the part of it the
backward does not hide (hybrid.core.step_cost; formulas in docs/core.md). Compute is
``6 * parameters * tokens`` FLOPs per step at ``--mfu`` of ``--device-tflops``, a third forward.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybrid._table import format_table, human_bytes
from hybrid.core import NETWORKS, STAGES, CostModel, Link, collective_seconds, plan_buckets, step_cost


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("projection (--project)")
    g.add_argument("--project", action="store_true",
                   help="project per-step communication at scale: DDP and ZeRO-1/2/3 on named networks")
    g.add_argument("--ranks", default="8,64,512", help="comma-separated world sizes to project (default 8,64,512)")
    g.add_argument("--tokens", type=int, default=8192, help="tokens (or samples) per rank per step")
    g.add_argument("--mfu", type=float, default=0.4, help="fraction of the device's peak the compute reaches")
    g.add_argument("--device-tflops", type=float, default=989.0, help="peak dense TFLOP/s (H100 bf16: 989)")
    g.add_argument("--cost", metavar="FILE|measure",
                   help="add this machine's process group: a CostModel JSON (hybrid.torch.measure_collectives "
                        "caches one under ~/.cache/hybrid), or 'measure' to measure 2 gloo ranks here now")


def _check(args) -> list[int]:
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise SystemExit(f"hybrid plan: --ranks wants comma-separated integers, got {args.ranks!r}")
    if min(ranks) < 1:
        raise SystemExit(f"hybrid plan: --ranks must all be >= 1, got {args.ranks!r}")
    for name, value in (("tokens", args.tokens), ("device-tflops", args.device_tflops)):
        if not value > 0:
            raise SystemExit(f"hybrid plan: --{name} must be > 0, got {value}")
    if not 0 < args.mfu <= 1:
        raise SystemExit(f"hybrid plan: --mfu must be in (0, 1], got {args.mfu}")
    return ranks


def _measured(source: str) -> CostModel:
    if source == "measure":
        from hybrid.torch._cost_probe import measure_local
        return measure_local(world_size=2)
    try:
        return CostModel.from_json(Path(source).read_text())
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"hybrid plan: --cost {source}: not a readable CostModel JSON ({e})")


def projection_report(specs, args) -> dict:
    """Rows of (network, ranks, stage) with bytes sent, communication and exposed seconds."""
    ranks = _check(args)
    plan = plan_buckets(specs)  # torch's default caps: what a user's run gets without tuning
    num_params = sum(s.numel for s in specs)
    compute_s = 6 * num_params * args.tokens / (args.mfu * args.device_tflops * 1e12)
    forward_s, backward_s = compute_s / 3, 2 * compute_s / 3
    links: dict[str, dict[str, Link] | Link] = dict(NETWORKS)
    names = {k: v.name for k, v in NETWORKS.items()}
    if args.cost:
        model = _measured(args.cost)
        links["measured"] = {kind: model.link(kind) for kind in model.fits}
        names["measured"] = (f"this machine: {model.about.get('backend', '?')} at {model.world_size} ranks, "
                             f"all-reduce {model.link('all_reduce').latency_s * 1e6:.0f} us, "
                             f"{model.link('all_reduce').bytes_per_s / 1e9:.2f} GB/s")
    rows = []
    for key, link in links.items():
        for n in ranks:
            def seconds(kind, nbytes, link=link, n=n):
                return collective_seconds(kind, nbytes, n, link[kind] if isinstance(link, dict) else link)
            for stage in STAGES:
                c = step_cost(plan, n, stage, seconds, forward_s=forward_s, backward_s=backward_s)
                rows.append({"network": key, "ranks": n, "stage": stage if stage == "ddp" else f"zero{stage}",
                             "bytes_sent_per_rank": c.wire_bytes, "comm_s": c.comm_s, "exposed_s": c.exposed_s,
                             "step_s": c.step_s})
    return {"networks": names, "tokens_per_rank": args.tokens, "mfu": args.mfu, "device_tflops": args.device_tflops,
            "compute_s": compute_s, "num_buckets": plan.num_buckets, "rows": rows}


def print_projection(p: dict) -> None:
    print(f"\nProjected communication per step at torch's default caps ({p['num_buckets']} buckets), "
          f"{p['tokens_per_rank']} tokens per rank, compute {p['compute_s'] * 1e3:.1f} ms "
          f"({p['mfu']:.0%} of {p['device_tflops']:.0f} TFLOP/s):")
    for key, name in p["networks"].items():
        rows = [r for r in p["rows"] if r["network"] == key]
        print(f"\n{name}")
        print(format_table(["ranks", "stage", "sent/rank", "comm ms", "exposed ms", "step ms"],
                           [[r["ranks"], r["stage"], human_bytes(r["bytes_sent_per_rank"]), f"{r['comm_s'] * 1e3:.2f}",
                             f"{r['exposed_s'] * 1e3:.2f}", f"{r['step_s'] * 1e3:.2f}"] for r in rows]))
    print("\nsent/rank: bytes each rank puts on the wire (ring algorithms); comm: every collective's time added up; "
          "exposed: what the compute does not hide (step = compute + exposed). ZeRO-1 is torch's "
          "ZeroRedundancyOptimizer over DDP (all-reduce, then each rank broadcasts its share); ZeRO-3 gathers each "
          "bucket before its forward and its backward, one bucket ahead.")
