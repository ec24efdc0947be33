"""torch.compile on hybrid's DDP: graph split at the buckets vs not split vs eager vs torch's DDPOptimizer.

World size 2 on gloo. Four variants of one model, stepped interleaved (forward, backward and the
gradient reduction), rank 0's times:

- ``split``: ``torch.compile(hybrid DDP)``, pieces cut at the reducer's buckets (hybrid.core);
- ``whole``: the same with ``torch._dynamo.config.optimize_ddp = False`` (one graph);
- ``eager``: hybrid DDP, not compiled;
- ``torch``: ``torch.compile(torch's DDP)``, split by torch's ``DDPOptimizer``.

The first step of each variant is its compile time (plus one step), printed apart (after a
throwaway compile warms dynamo; kernels inductor compiled for one variant are reused by the next
within the process, so the first variant's figure still holds more of that cost), with the
number of graphs dynamo captured for it and of frames its callback converted (``counters["frames"]
["total"]``: frames traced, and frames looked at once and skipped). Every variant compiles its own graphs: dynamo matches
cache entries by backend, and the model is a class of this file, because under torch's DDP (and,
before ``hybrid.torch.dynamo._compile._own_code``, under hybrid's with ``optimize_ddp`` off) a bare
``nn.Sequential`` ran eagerly: dynamo skips top-level ``torch.nn`` frames. Frames converted
during the timed steps are counted and printed: 0 means no recompilation. ``split`` is stepped a
second time in every round (``split'``, right after ``whole``) for the A/A row of the ratio table.
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
from hybrid.bench._stats import Ratio, ratio_table, rotated

_MB = 1 << 20


class _MLP(nn.Module):
    """``depth`` x (Linear, ReLU), its forward in this file: dynamo traces it under torch's DDP too."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _worker(rank, world, port, outdir, args):
    from hybrid.torch import DistributedDataParallel as HybridDDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    base = _MLP(args.width, args.depth)
    x = torch.randn(args.batch, args.width)
    cap = args.bucket_cap_mb
    import copy
    mods = {"split": HybridDDP(copy.deepcopy(base), bucket_cap_mb=cap),
            "whole": HybridDDP(copy.deepcopy(base), bucket_cap_mb=cap),
            "eager": HybridDDP(copy.deepcopy(base), bucket_cap_mb=cap),
            "torch": torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)}
    run = {"split": torch.compile(mods["split"], backend=args.backend),
           "whole": torch.compile(mods["whole"], backend=args.backend),
           "eager": mods["eager"],
           "torch": torch.compile(mods["torch"], backend=args.backend)}
    # The A/A reference: split stepped again, right after whole as whole is after split.
    order = ("split", "whole", "split'", "eager", "torch")

    def step(k):
        if k == "whole":
            with torch._dynamo.config.patch(optimize_ddp=False):
                run[k](x).sum().backward()
        else:
            run[k](x).sum().backward()

    # Warm dynamo and the backend (imports, lazy initialisation) on a throwaway model, so the first
    # variant's first step does not pay it for all four.
    torch.compile(_MLP(args.width, 1), backend=args.backend)(x).sum().backward()
    from torch._dynamo.utils import counters
    times = {k: [] for k in order}
    first, graphs, first_frames, frames = {}, {}, {}, 0
    for it in range(args.reps + 3):  # the first step compiles, the second rebuilds buckets
        for name in rotated(order, it):
            k = name.rstrip("'")
            for p in mods[k].parameters():
                p.grad = None
            dist.barrier()
            before = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
            t0 = time.perf_counter()
            step(k)
            dt = time.perf_counter() - t0
            if it == 0 and k == name:
                first[k], graphs[k] = dt, counters["stats"]["unique_graphs"] - before[0]
                first_frames[k] = counters["frames"]["total"] - before[1]
            elif it >= 3:
                times[name].append(dt)
                frames += counters["frames"]["total"] - before[1]
    from hybrid.torch import split_reports
    pieces = split_reports(mods["split"])[0].num_pieces
    if rank == 0:
        torch.save({"times": times, "first": first, "graphs": graphs, "first_frames": first_frames, "frames": frames,
                    "pieces": pieces,
                    "buckets": mods["split"].bucket_plan.num_buckets,
                    "params": sum(p.numel() for p in base.parameters())}, os.path.join(outdir, "res.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench compile", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", help="dynamo backend (default aot_eager)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-cap-mb", type=float, default=2.0,
                        help="DDP bucket cap, also the split cap (torch's DDPOptimizer needs >= 1)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a small model, 3 repetitions")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.reps = 512, 4, 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outdir = tempfile.mkdtemp(prefix="hybrid_bench_compile_")
    mp.spawn(_worker, args=(2, port, outdir, args), nprocs=2, join=True)
    res = torch.load(os.path.join(outdir, "res.pt"))
    print(f"world size 2, gloo, backend {args.backend}, MLP {args.depth}x{args.width} ({res['params']} params), "
          f"cap {args.bucket_cap_mb} MiB: {res['pieces']} pieces, {res['buckets']} buckets; "
          f"medians of {args.reps} interleaved steps, rank 0")
    print(report(res))
    return 0


def report(res: dict) -> str:
    """Step medians, first steps and graphs per variant, recompiles, and the ratio table."""
    t = res["times"]
    rows = [[k, round(statistics.median(t[k]) * 1e3, 2), round(res["first"][k], 2), res["graphs"][k],
             res["first_frames"][k]] for k in res["first"]]
    ratios = [Ratio("split", other, t["split"], t[other]) for other in ("whole", "eager", "torch")]
    return "\n".join([format_table(["variant", "step ms", "first step (compile) s", "graphs captured",
                                     "frames converted"], rows),
                      f"frames converted during the timed steps (recompiles): {res['frames']}", "",
                      ratio_table({"step": (ratios, Ratio("split'", "split", t["split'"], t["split"]))})])
