"""``python -m hybrid bench ddp``: hybrid's DDP vs torch's C++ reducer, and bucketing vs per-tensor.

Two gloo processes on this machine. For each model (a ~20M-parameter MLP, and a model with ~200
small parameters) one step (forward, backward, gradients reduced) is timed for three variants,
interleaved A, B, C, A, B, C, ... so drift hits all of them alike:

- ``torch``:      torch.nn.parallel.DistributedDataParallel (the C++ reducer);
- ``hybrid``:     hybrid.torch.DistributedDataParallel (buckets from hybrid.core, Python hooks);
- ``auto``:       the same with ``bucket_cap_mb="auto"``: buckets planned from the measured cost
  model and the first iteration's gradient times (hybrid.core.auto_plan), paired with ``hybrid``
  (torch's default caps, same reducer) and with ``torch``;
- ``per_tensor``: the plain module, then one blocking ``all_reduce`` per gradient (no buckets).

torch's step is timed a second time in every repetition (``torch'``, right after hybrid's), for the
A/A row: the same path against itself, what noise alone does to a ratio. Medians over ``--reps``
repetitions (after warm-up, which includes hybrid's bucket rebuild) are printed, then the ratios
hybrid/torch, auto/hybrid, auto/torch and per_tensor/hybrid with the A/A row and a legend
(``hybrid.bench._stats``); under the medians, the auto plan and what its model predicted.

With ``--device cuda`` (or ``cpu``) it times GPT training steps instead (GPT-2 small by default,
float32 and bf16): hybrid's DDP against torch's, NCCL ranks one per GPU, peak memory beside the
times (``hybrid.bench.gpt``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hybrid.cli._table import format_table
from hybrid.bench import gpt
from hybrid.bench._stats import Ratio, ratio_table, rotated


def _big_mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _many_small(n_layers: int, width: int) -> nn.Module:
    layers = []
    for _ in range(n_layers):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _models(quick: bool):
    if quick:
        return {"mlp_2M": (lambda: _big_mlp(512, 8), 512, 8), "small_x200": (lambda: _many_small(100, 16), 16, 8)}
    # 5 x (2048*2048 + 2048) = 21.0M parameters; 100 x (32*32 + 32) = 200 parameters, 106k elements.
    return {"mlp_21M": (lambda: _big_mlp(2048, 5), 2048, 32), "small_x200": (lambda: _many_small(100, 32), 32, 32)}


def _worker(rank, world, port, outdir, quick, reps):
    from hybrid.torch import DistributedDataParallel as HybridDDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for name, (build, width, batch) in _models(quick).items():
        torch.manual_seed(0)
        x = torch.randn(batch, width)
        variants = {}
        variants["torch"] = torch.nn.parallel.DistributedDataParallel(build())
        variants["hybrid"] = HybridDDP(build())
        variants["auto"] = HybridDDP(build(), bucket_cap_mb="auto")
        plain = build()

        def per_tensor_step(m=plain):
            m(x).sum().backward()
            for p in m.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)

        steps = {k: (lambda m=m: m(x).sum().backward()) for k, m in variants.items()}
        # The A/A reference: torch's step again, right after hybrid's as hybrid's is after torch's.
        steps["torch'"] = steps["torch"]
        steps["per_tensor"] = per_tensor_step
        mods = dict(variants, per_tensor=plain)
        mods["torch'"] = mods["torch"]
        times = {k: [] for k in steps}
        for it in range(reps + 3):  # 3 warm-up steps: the first builds and rebuilds buckets
            for k in rotated(list(steps), it):
                step = steps[k]
                for p in mods[k].parameters():
                    p.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                if it >= 3:
                    times[k].append(dt)
        n_params = sum(p.numel() for p in plain.parameters())
        n_tensors = len(list(plain.parameters()))
        rows.append((name, n_params, n_tensors, times, variants["hybrid"].bucket_plan.num_buckets,
                     _auto_summary(variants["auto"])))
    if rank == 0:
        torch.save(rows, os.path.join(outdir, "rows.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _auto_summary(ddp) -> str:
    """The auto plan in one line: its buckets, how many skip the copy, and what its model predicted."""
    plan, report = ddp.bucket_plan, ddp._auto_report
    predicted = report["predicted_exposed_s"]
    return (f"{plan.num_buckets} buckets ({sum(b.in_place for b in plan.buckets)} in place), predicted exposed "
            f"{predicted['auto'] * 1e3:.2f} ms vs {predicted['torch default caps'] * 1e3:.2f} ms at torch's caps "
            f"(overlap {report['overlap']:.2f}, a pass over a gradient {report['copy'].seconds_per_byte * 1e12:.0f} "
            f"ps/byte, a launch {report['copy'].seconds_per_bucket * 1e6:.0f} us)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 3 repetitions (--device: its model, 5 rounds after 2)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 15; --device: 20)")
    gpt.add_arguments(parser)
    args = parser.parse_args(argv)
    bench = gpt.config_from_args(parser, args)
    if bench is not None:
        from hybrid.bench.gpt._torch import DDP_PAIRS
        return gpt.torch_main(parser, bench, "ddp", DDP_PAIRS)
    reps = args.reps or (3 if args.quick else 15)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outdir = tempfile.mkdtemp(prefix="hybrid_bench_ddp_")
    mp.spawn(_worker, args=(2, port, outdir, args.quick, reps), nprocs=2, join=True)
    rows = torch.load(os.path.join(outdir, "rows.pt"))
    print(f"world size 2, gloo, medians of {reps} interleaved steps (forward+backward+reduction), rank 0")
    print(report(rows))
    return 0


def report(rows) -> str:
    """The table of medians and the ratio table of ``rows``: ``(model, params, tensors, times, buckets, auto)``."""
    variants = ("torch", "hybrid", "auto", "per_tensor")
    med = [[name, n, k, nb, *(round(statistics.median(t[v]) * 1e3, 2) for v in variants)]
           for name, n, k, t, nb, _ in rows]
    groups = {name: ([Ratio("hybrid", "torch", t["hybrid"], t["torch"]),
                      Ratio("auto", "hybrid", t["auto"], t["hybrid"]),
                      Ratio("auto", "torch", t["auto"], t["torch"]),
                      Ratio("per_tensor", "hybrid", t["per_tensor"], t["hybrid"], better=">")],
                     Ratio("torch'", "torch", t["torch'"], t["torch"]))
              for name, _, _, t, _, _ in rows}
    auto = [f"auto on {name}: {summary}" for name, *_, summary in rows]
    return "\n".join([format_table(["model", "params", "tensors", "buckets", *(f"{v} ms" for v in variants)], med),
                      *auto, "", ratio_table(groups, group="model")])
