"""The report ``python -m hybrid plan`` prints: a model's buckets at given caps and its ZeRO view.

Plain values in, a JSON-able dict out (``build_report``), and its text (``print_report``): the
command (``plan.py``) turns the command line into a :class:`Caps` and a :class:`ZeroView`.
"""

from __future__ import annotations

from hybrid.cli._plan_compile import print_compile
from hybrid.cli._plan_options import Caps, ZeroView
from hybrid.cli._plan_pair import print_pairing
from hybrid.cli._table import format_table, human_bytes
from hybrid.core import (BucketPlan, STAGES, forward_order, itemsize, partition_params, plan_buckets, shard_flat,
                         step_cost, zero3_memory, zero3_plan, zero_memory)


LEGEND = """\
What the words mean:
  plan <fingerprint>  a hash of the bucket plan (names, shapes, dtypes, buckets, offsets); ranks, and the
                      torch and JAX frontends, build the same plan exactly when their fingerprints match
  limit               the byte cap the bucket was filled up to; torch's DDP closes a bucket once its bytes
                      reach it. A first-bucket cap at or above --bucket-cap-mb is ignored, as in torch
  owned (greedy)      ZeRO-1 (torch's ZeroRedundancyOptimizer): whole tensors per rank, largest first to
                      the least-loaded rank
  imbalance           a rank's owned bytes against an even split (total / world size)
  flat shard          ZeRO-2: every bucket cut in world-size equal slices (padded); the same on every rank
  ZeRO-1/2 state      optimizer-state bytes a rank keeps; "total" adds parameters and gradients
  ZeRO-3              parameters, gradients and optimizer state all as the rank's flat slices; "gathered":
                      the full buckets held at once during a step, the bucket computing and --prefetch
                      more (their all-gathers overlap its compute) and, in the backward, the full
                      gradient being reduce-scattered; "kept" holds the forward's buckets for the
                      backward instead of gathering them again (FSDP's reshard_after_forward=False)
  forward order       the buckets in the order the forward first uses them (the plan's reverse)
  sent per step       bytes each rank sends per step over ring collectives: DDP one all-reduce per bucket,
                      ZeRO-1 (torch) all-reduce + broadcast of the shares, ZeRO-2 reduce-scatter +
                      all-gather, ZeRO-3 an all-gather in the forward and in the backward + reduce-scatter
  paper formulas      bytes per rank by the ZeRO paper (Rajbhandari et al. 2020, sec. 5), with W the
                      parameter bytes (gradients as many), K optimizer-state bytes per parameter, P
                      parameters, N ranks: DDP W + W + K P, ZeRO-1 W + W + K P / N, ZeRO-2 W + W / N + K P / N,
                      ZeRO-3 (W + W + K P) / N (without the gathered working set)"""

NEXT = """\
Next: python -m hybrid demo trains one model with both frontends; examples/torch_train.py (launch with
torchrun) and examples/jax_train.py (jax.distributed) are training scripts to start from."""


def build_report(label: str, specs, view: ZeroView, caps: Caps, plan: BucketPlan | None = None) -> dict:
    """The report of ``specs``: its buckets at ``caps`` (``plan``: one planned already, e.g. in a
    gradient-ready order) and the ZeRO view of ``view``.

    >>> from hybrid.core import TensorSpec
    >>> r = build_report("two", [TensorSpec("w", (1024, 1024), "float32"), TensorSpec("b", (1024,), "float32")],
    ...                  ZeroView(world_size=2), Caps())
    >>> r["num_params"], len(r["buckets"]), r["ranks"][0]["zero2_state_bytes"]
    (1049600, 2, 4198400)
    """
    if plan is None:
        plan = plan_buckets(specs, bucket_cap_bytes=caps.bucket_cap_bytes,
                            first_bucket_cap_bytes=caps.first_bucket_cap_bytes)
    partition = partition_params(specs, view.world_size)
    shards = shard_flat(plan, view.world_size)
    memory = zero_memory(specs, view.world_size, view.optimizer, master_weights=view.master_weights)
    k = memory.state_bytes_per_param
    owned = partition.numel_per_rank()
    owned_bytes = partition.bytes_per_rank()
    ideal = sum(s.nbytes for s in specs) / view.world_size
    # Every rank's flat shard has the same size: one equal slice of each bucket.
    flat_shard_bytes = sum(size * itemsize(b.dtype) for size, b in zip(shards.shard_sizes, plan.buckets))
    ranks = []
    for r in range(view.world_size):
        ranks.append({
            "rank": r, "params_owned": owned[r], "bytes_owned": owned_bytes[r],
            "imbalance_vs_ideal": owned_bytes[r] / ideal - 1 if ideal else 0.0,
            "flat_shard_bytes": flat_shard_bytes,
            "zero1_state_bytes": k * owned[r],
            "zero1_total_bytes": memory.param_bytes + memory.grad_bytes + k * owned[r],
            "zero2_state_bytes": k * sum(shards.shard_sizes),
            "zero2_total_bytes": memory.param_bytes + flat_shard_bytes + k * sum(shards.shard_sizes),
        })
    buckets = [{
        "index": i, "dtype": b.dtype, "device": b.device, "tensors": len(b.members),
        "bytes": b.nbytes, "size_limit": b.size_limit,
        "first": specs[b.members[0]].name, "last": specs[b.members[-1]].name,
    } for i, b in enumerate(plan.buckets)]
    return {
        "source": label, "num_tensors": len(specs), "num_params": memory.num_params,
        "param_bytes": memory.param_bytes, "fingerprint": plan.fingerprint(),
        "bucket_cap_bytes": caps.bucket_cap_bytes, "first_bucket_cap_bytes": caps.first_bucket_cap_bytes,
        "size_limits": list(plan.size_limits),
        "buckets": buckets, "world_size": view.world_size, "optimizer": view.optimizer,
        "state_bytes_per_param": k,
        "formula_bytes_per_rank": {"ddp": memory.ddp, "zero1": memory.zero1, "zero2": memory.zero2,
                                   "zero3": memory.zero3},
        "ranks": ranks, **zero3_report(plan, shards, k, view.prefetch),
    }


def zero3_report(plan, shards, k: int, prefetch: int) -> dict:
    """Stage 3's bytes per rank (every rank alike) and each stage's bytes sent per rank per step."""
    def memory(reshard):
        m = zero3_memory(shards, k, prefetch=prefetch, reshard_after_forward=reshard)
        return {"param_bytes": m.param_bytes, "grad_bytes": m.grad_bytes, "state_bytes": m.state_bytes,
                "gathered_bytes": m.gathered_bytes, "total_bytes": m.total}

    def sent(stage, reshard=True):  # bytes only: the collectives' time does not matter here
        return step_cost(plan, shards.world_size, stage, lambda kind, n: 0.0, forward_s=0.0, backward_s=0.0,
                         reshard_after_forward=reshard, prefetch=prefetch).wire_bytes

    volume = {stage if stage == "ddp" else f"zero{stage}": sent(stage) for stage in STAGES}
    return {"prefetch": prefetch, "forward_order": list(forward_order(plan)),
            "zero3_fingerprint": zero3_plan(plan.specs).fingerprint(),
            "zero3_bytes_per_rank": memory(True), "zero3_kept_bytes_per_rank": memory(False),
            "sent_bytes_per_rank_per_step": {**volume, "zero3_kept": sent(3, reshard=False)}}


def print_report(report: dict) -> None:
    print(f"{report['source']}: {report['num_tensors']} tensors, {report['num_params']:,} parameters, "
          f"{human_bytes(report['param_bytes'])}; plan {report['fingerprint']}")
    print(f"\nBuckets (reduced in this order; {_caps_used(report)}):")
    print(format_table(["#", "dtype", "device", "tensors", "bytes", "limit", "first tensor", "last tensor"],
                       [[b["index"], b["dtype"], b["device"], b["tensors"], human_bytes(b["bytes"]),
                         human_bytes(b["size_limit"]), b["first"], b["last"]] for b in report["buckets"]]))
    f = report["formula_bytes_per_rank"]
    print(f"\nZeRO view, world size {report['world_size']}, {report['optimizer']} "
          f"({report['state_bytes_per_param']} B of optimizer state per parameter):")
    print(format_table(["rank", "owned (greedy)", "imbalance", "flat shard", "ZeRO-1 state", "ZeRO-1 total", "ZeRO-2 state",
                        "ZeRO-2 total"],
                       [[r["rank"], human_bytes(r["bytes_owned"]), f"{100 * r['imbalance_vs_ideal']:+.2f}%",
                         human_bytes(r["flat_shard_bytes"]), human_bytes(r["zero1_state_bytes"]),
                         human_bytes(r["zero1_total_bytes"]), human_bytes(r["zero2_state_bytes"]),
                         human_bytes(r["zero2_total_bytes"])] for r in report["ranks"]]))
    z3, kept = report["zero3_bytes_per_rank"], report["zero3_kept_bytes_per_rank"]
    print(f"\nZeRO-3 per rank (every rank alike), prefetch {report['prefetch']}; forward order of the buckets: "
          f"{_order_text(report['forward_order'])}; of the plan above (ZeRO3's own plan at its default cap, what "
          f"parity --stage 3 reports: plan {report['zero3_fingerprint']}):")
    print(format_table(["ZeRO-3", "param slices", "grad slices", "state", "gathered", "total"],
                       [[name, *(human_bytes(m[key]) for key in ("param_bytes", "grad_bytes", "state_bytes",
                                                                  "gathered_bytes", "total_bytes"))]
                        for name, m in (("regathered in the backward", z3), ("kept for the backward", kept))]))
    sent = report["sent_bytes_per_rank_per_step"]
    print("\nSent per rank per step (ring collectives), and against DDP:")
    names = {"ddp": "DDP", "zero1": "ZeRO-1 (torch)", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3_kept": "ZeRO-3 kept"}
    print(format_table(list(names.values()), [[human_bytes(sent[k]) for k in names],
                                              [f"{sent[k] / sent['ddp']:.2f}x" if sent["ddp"] else "-" for k in names]]))
    print(f"\nPaper formulas per rank: DDP {human_bytes(f['ddp'])}, ZeRO-1 {human_bytes(f['zero1'])}, "
          f"ZeRO-2 {human_bytes(f['zero2'])}, ZeRO-3 {human_bytes(f['zero3'])}")
    if "pairing" in report:
        print_pairing(report["pairing"])
    if "compile" in report:
        print_compile(report["compile"])
    print(f"\n{LEGEND}\n\n{NEXT}")


def _order_text(order: list[int]) -> str:
    return " ".join(map(str, order)) if len(order) <= 12 else f"{' '.join(map(str, order[:12]))} ... ({len(order)})"


def _caps_used(report: dict) -> str:
    """The caps the plan was built with, in words (a first cap not below the cap is dropped, as in torch)."""
    limits = report["size_limits"]
    if len(limits) == 1:
        dropped = ""
        if report["first_bucket_cap_bytes"] != report["bucket_cap_bytes"]:
            dropped = (f"; the first-bucket cap {human_bytes(report['first_bucket_cap_bytes'])} is not below it, "
                       "so it is ignored, as in torch")
        return f"cap {human_bytes(limits[0])} for every bucket{dropped}"
    return f"caps {human_bytes(limits[0])} for the first bucket of each dtype and device, then {human_bytes(limits[1])}"


