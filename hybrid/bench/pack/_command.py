"""``python -m hybrid bench pack``: batched copy into and out of buckets vs one contiguous copy.

Two workloads: a ~100M-parameter transformer's gradients (about 200 tensors) and 2000 small
tensors. Each is packed into its buckets (``hybrid.kernels.gather``) and unpacked back
(``hybrid.kernels.scatter``); the achieved bandwidth is divided by that of one contiguous copy of
the same bytes, measured in the same run, interleaved (copy, path, copy again, ...: the copy twice
for the A/A row), medians over repetitions and the ratio table of ``hybrid.bench._stats``.

On a GPU (and with the kernels built) the path is the CUDA kernels and the baseline a device
memcpy; ``cuda-op`` is the same kernels called through torch's custom-op dispatcher (as under
``torch.compile``), and each path is timed twice there: called from Python, and replayed from a
CUDA graph (the device's time alone, what ``--project`` models). Elsewhere the reference path
(torch ``_foreach_copy_`` into views) and, for numpy, ``hybrid.core.pack`` / ``unpack`` against
``np.copyto``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hybrid.cli._table import format_table
from hybrid.bench._stats import Ratio, ratio_table, rotated
from hybrid.core import TensorSpec, pack, plan_buckets, unpack


def transformer_shapes(layers: int = 12, width: int = 768, vocab: int = 16000) -> list[tuple[int, ...]]:
    """A GPT-2-small-like model: ~97M parameters in 12 * 16 + 3 = 195 tensors."""
    shapes: list[tuple[int, ...]] = [(vocab, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,),
                   (width // 12,), (width // 12,), (width,), (width,)]
    return shapes + [(width,), (width,)]


def small_shapes(num: int = 2000, seed: int = 0) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [(int(n),) for n in rng.integers(1, 2048, size=num)]


def _time_once(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _interleaved(path, copy, reps: int, sync) -> tuple[list[float], list[float], list[float]]:
    """Times of ``path``, ``copy`` and ``copy`` again (the A/A reference), interleaved in a rotating order."""
    path(), copy()  # warm up: allocations, caches, lazy registration
    times = ([], [], [])
    for rep in range(reps):
        for k in rotated((1, 0, 2), rep):
            times[k].append(_time_once(copy if k else path, sync))
    return times


def _copy_paths(plan, grads, flats, backend):
    """Pack and unpack of every bucket through ``backend``: ``hybrid.kernels`` (``reference`` or
    ``cuda``), or ``cuda-op``, the kernels through torch's custom-op dispatcher as
    ``torch.compile`` calls them."""
    from hybrid import kernels
    if backend != "cuda-op":
        def gather_all():
            for b, f in enumerate(flats):
                kernels.gather(plan, b, grads, f, backend=backend)

        def scatter_all():
            for b, f in enumerate(flats):
                kernels.scatter(plan, b, f, grads, backend=backend)

        return gather_all, scatter_all
    from hybrid.kernels._torch import _torch_ops
    _, gather_op, scatter_op = _torch_ops()
    members = [([grads[m] for m in b.members], list(b.offsets)) for b in plan.buckets]

    def gather_ops():
        for (ts, offsets), f in zip(members, flats):
            gather_op(ts, f, offsets, None)

    def scatter_ops():
        for (ts, offsets), f in zip(members, flats):
            scatter_op(f, ts, offsets, None)

    return gather_ops, scatter_ops


def _run_torch(name, shapes, device, backend, reps) -> list[tuple]:
    import torch
    specs = [TensorSpec(f"p{i}", s, "float32", device=device) for i, s in enumerate(shapes)]
    plan = plan_buckets(specs)
    grads = [torch.randn(s, device=device) for s in shapes]
    flats = [torch.empty(b.length, device=device) for b in plan.buckets]
    nbytes = sum(g.numel() for g in grads) * 4
    src, dst = torch.randn(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    gather_all, scatter_all = _copy_paths(plan, grads, flats, backend)

    def memcpy():
        dst.copy_(src)

    rows = []
    for what, fn in (("pack", gather_all), ("unpack", scatter_all)):
        rows.append((name, f"torch {backend} {what}", len(shapes), len(plan.buckets), nbytes,
                     *_interleaved(fn, memcpy, reps, sync)))
        if device == "cuda":
            # the same launches captured once in a CUDA graph and replayed: the device's time
            # alone, without the host's per-call work (what the projection models)
            replay = _captured(fn, torch)
            rows.append((name, f"torch {backend} {what} graph", len(shapes), len(plan.buckets), nbytes,
                         *_interleaved(replay, memcpy, reps, sync)))
    return rows


def _captured(fn, torch):
    """``fn``'s launches as a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up outside capture (lazy registration, first allocations)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _run_numpy(name, shapes, reps) -> list[tuple]:
    specs = [TensorSpec(f"p{i}", s, "float32") for i, s in enumerate(shapes)]
    plan = plan_buckets(specs)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    flats = [pack(plan, b, grads) for b in range(len(plan.buckets))]
    nbytes = sum(g.size for g in grads) * 4
    src, dst = rng.standard_normal(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, np.float32)

    def pack_all():
        for b in range(len(plan.buckets)):
            flats[b] = pack(plan, b, grads)

    def unpack_all():
        for b, f in enumerate(flats):
            for m, v in unpack(plan, b, f).items():
                np.copyto(grads[m], v)

    def memcpy():
        np.copyto(dst, src)

    rows = []
    for what, fn in (("pack", pack_all), ("unpack", unpack_all)):
        rows.append((name, f"numpy core {what}", len(shapes), len(plan.buckets), nbytes,
                     *_interleaved(fn, memcpy, reps, lambda: None)))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 3 repetitions")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--project", action="store_true",
                        help="no timing: project the CUDA kernels' time on a GPU (--gpu) from the plans' bytes and launches")
    parser.add_argument("--gpu", choices=("h100", "h200"), default="h100", help="--project: the device model")
    parser.add_argument("--tokens", type=int, default=8192, help="--project: tokens per GPU in the GPT-2 step")
    parser.add_argument("--mfu", type=float, default=0.4, help="--project: the GPT-2 step's model FLOPs utilization")
    parser.add_argument("--json", action="store_true", help="--project: print JSON")
    args = parser.parse_args(argv)
    if args.project:
        if args.tokens <= 0 or not 0 < args.mfu <= 1:
            parser.error(f"--tokens must be positive and --mfu in (0, 1], got {args.tokens} and {args.mfu}")
        from hybrid.bench.pack import _projection
        from hybrid.kernels._projection import DEVICES
        specs = {name: [TensorSpec(f"p{i}", s, "float32") for i, s in enumerate(shapes)]
                 for name, shapes in (("transformer", transformer_shapes()), ("2000 small", small_shapes()))}
        return _projection.main(specs, tokens=args.tokens, mfu=args.mfu, as_json=args.json,
                                     device=DEVICES[args.gpu])
    import torch
    from hybrid import kernels
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    reps = 3 if args.quick else args.reps
    workloads = [("transformer", transformer_shapes(2, 128, 1000) if args.quick else transformer_shapes()),
                 ("2000 small", small_shapes(200 if args.quick else 2000))]
    backends = ["reference"] + (["cuda", "cuda-op"] if device == "cuda" and kernels.available() else [])
    print(f"device={device} torch_threads={torch.get_num_threads()} reps={reps} backends={backends}")
    rows = []
    for name, shapes in workloads:
        for backend in backends:
            rows += _run_torch(name, shapes, device, backend, reps)
        if device == "cpu":
            rows += _run_numpy(name, shapes, reps)
    print(report(rows))
    return 0


def report(rows) -> str:
    """Medians and bandwidths of ``rows`` ``(workload, path, tensors, buckets, bytes, times, copy times,
    copy times again)``, then the ratio table: copy time / path time is the path's bandwidth over
    one contiguous copy's."""
    table, groups = [], {}
    for name, path, n, nb, nbytes, t, tc, tc2 in rows:
        med, med_copy = statistics.median(t), statistics.median(tc)
        table.append([name, path, n, nb, round(nbytes / 1e6, 1), round(med * 1e3, 2), round(nbytes / med / 1e9, 2),
                      round(nbytes / med_copy / 1e9, 2)])
        what = path.rsplit(" ", 1)[1]
        groups[f"{name}, {path}"] = ([Ratio("copy", what, tc, t, better=">")], Ratio("copy'", "copy", tc2, tc))
    return "\n".join([format_table(["workload", "path", "tensors", "buckets", "MB", "ms", "GB/s", "copy GB/s"], table), "",
                      ratio_table(groups, group="workload, path"),
                      "copy/pack, copy/unpack: the path's bandwidth over that of one contiguous copy of the same bytes"])
