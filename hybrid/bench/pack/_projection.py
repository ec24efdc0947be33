"""``python -m hybrid bench pack --project``: what the CUDA kernels should take on an H100.

No GPU is needed: the plan's buckets are cut into launches as the host code will cut them
(hybrid.kernels._tables), and bytes and launches become time under the stated device model
(hybrid.kernels._projection). The first GPU run has these figures to meet.
"""

from __future__ import annotations

import json

from hybrid.models._examples import gpt2_small
from hybrid.core import TensorSpec, plan_buckets
from hybrid.kernels._projection import H100_SXM, Device, project_plan, transformer_step_seconds

GPT2 = dict(layers=12, width=768, context=1024)


def projection(workloads: dict[str, list[TensorSpec]], *, tokens: int, mfu: float,
               device: Device = H100_SXM) -> dict:
    """Per workload at torch's default caps: buckets, launches, bytes moved, projected time, and
    that time as a fraction of a GPT-2-small training step on the same device."""
    step = transformer_step_seconds(sum(s.numel for s in gpt2_small()), tokens=tokens, mfu=mfu, device=device,
                                    **GPT2)
    rows = []
    for name, specs in workloads.items():
        copies = project_plan(plan_buckets(specs), device)
        seconds = sum(c.seconds for c in copies)
        rows.append({"workload": name, "tensors": len(specs), "buckets": len(copies),
                     "launches": sum(c.launches for c in copies), "bytes_moved": sum(c.bytes_moved for c in copies),
                     "seconds": seconds, "fraction_of_gpt2_step": seconds / step})
    return {"device": device.name, "hbm_bytes_per_s": device.hbm_bytes_per_s,
            "copy_efficiency": device.copy_efficiency, "launch_s": device.launch_s,
            "gpt2_step": {"tokens": tokens, "mfu": mfu, "seconds": step}, "rows": rows}


def print_projection(report: dict) -> None:
    step = report["gpt2_step"]
    print(f"projected on {report['device']}: copies at {report['copy_efficiency']:.0%} of peak bandwidth, "
          f"{report['launch_s'] * 1e6:.0f} us per launch")
    print(f"against a GPT-2-small step of {step['tokens']} tokens at {step['mfu']:.0%} MFU: "
          f"{step['seconds'] * 1e3:.1f} ms")
    print(f"{'workload':<14} {'tensors':>7} {'buckets':>7} {'launches':>8} {'GB moved':>8} {'ms':>7} {'of step':>8}")
    for r in report["rows"]:
        print(f"{r['workload']:<14} {r['tensors']:>7} {r['buckets']:>7} {r['launches']:>8} "
              f"{r['bytes_moved'] / 1e9:>8.3f} {r['seconds'] * 1e3:>7.3f} {r['fraction_of_gpt2_step']:>8.1%}")
    print("each row: every bucket gathered (gradients in) and scattered (results out) once; "
          "GB moved = bytes read + written")


def main(workloads: dict[str, list[TensorSpec]], *, tokens: int, mfu: float, as_json: bool,
         device: Device = H100_SXM) -> int:
    report = projection({"gpt2-small": gpt2_small(), **workloads}, tokens=tokens, mfu=mfu, device=device)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_projection(report)
    return 0
