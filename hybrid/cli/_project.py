"""``python -m hybrid plan --project``: the model's step communication at scale, on paper.

For DDP and ZeRO stages 1-3 at N ranks on named networks (and on this machine's measured process
group, ``--cost``): bytes each rank sends per step, time on the wire, and the part of it the
backward does not hide (hybrid.core.step_cost; formulas in docs/core.md). Compute is
``6 * parameters * tokens`` FLOPs per step at ``--mfu`` of ``--device-tflops``, a third forward.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hybrid.cli._table import format_table, human_bytes
from hybrid.core import NETWORKS, STAGES, CostModel, Link, collective_seconds, plan_buckets, step_cost


@dataclasses.dataclass(frozen=True, slots=True)
class Projection:
    """What ``--project`` projects at: world sizes, tokens per rank per step, the compute's speed,
    and this machine's measured process group (``cost``: a CostModel JSON, or ``"measure"``).

    >>> Projection(ranks=(8, 64)).ranks
    (8, 64)
    >>> Projection(ranks=(0,))
    Traceback (most recent call last):
    ...
    ValueError: --ranks must all be >= 1, got (0,)
    """

    ranks: tuple[int, ...] = (8, 64, 512)
    tokens: int = 8192
    mfu: float = 0.4
    device_tflops: float = 989.0
    cost: str | None = None

    def __post_init__(self):
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"--ranks must all be >= 1, got {self.ranks}")
        for name, value in (("tokens", self.tokens), ("device-tflops", self.device_tflops)):
            if not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {self.mfu}")


def _measured(source: str) -> CostModel:
    if source == "measure":
        from hybrid.torch._cost_probe import measure_local
        return measure_local(world_size=2)
    try:
        return CostModel.from_json(Path(source).read_text())
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"hybrid plan: --cost {source}: not a readable CostModel JSON ({e})")


def projection_report(specs, projection: Projection) -> dict:
    """Rows of (network, ranks, stage) with bytes sent, communication and exposed seconds."""
    ranks = projection.ranks
    plan = plan_buckets(specs)  # torch's default caps: what a user's run gets without tuning
    num_params = sum(s.numel for s in specs)
    compute_s = 6 * num_params * projection.tokens / (projection.mfu * projection.device_tflops * 1e12)
    forward_s, backward_s = compute_s / 3, 2 * compute_s / 3
    links: dict[str, dict[str, Link] | Link] = dict(NETWORKS)
    names = {k: v.name for k, v in NETWORKS.items()}
    if projection.cost:
        model = _measured(projection.cost)
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
    return {"networks": names, "tokens_per_rank": projection.tokens, "mfu": projection.mfu, "device_tflops": projection.device_tflops,
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
