"""``python -m hybrid bench zero --part budget``: a model whose training state no rank can hold,
trained from a meta-device build under a per-rank memory budget, beside torch's FSDP2 doing the
same (its meta build, ``fully_shard`` per layer, ``to_empty`` and each layer's
``reset_parameters``).

The model: ``depth`` layers of ``Linear(width, width)`` + tanh, float32, Adam: its parameters,
gradients and Adam's two moments take ``16 P`` bytes, and the per-rank budget is a third of that
(rounded down to a KiB), at every world size. A ZeRO-3 rank that keeps its share of all four
holds ``16 P / N`` during a step: more than the budget at 2 and 3 ranks before any working set.
One that steps each bucket inside the backward (``step_in_backward=True``) never holds its share
of the gradient, so ``12 P / N`` in training: under the budget from 3 ranks on, with a quarter of
``16 P / 3`` left for the gathered layers, the gradient bucket and the activations; but its load
reads the slices into numpy buffers beside the state it loads, over the budget at 3 ranks. At 2
ranks nothing that keeps the state on the rank fits (``12 P / 2`` is 1.125 budgets): that takes
offloading. With ``offload_dir=`` Adam's moments live in memory-mapped files (DeepSpeed's NVMe
offload; the page cache may keep them in RAM, outside the budget as host memory is outside a
GPU's), so a rank holds its ``4 P / N`` of parameter slices, its ``4 P / N`` of gradient slices
until the step (0.75 budgets at 2 ranks) and one bucket's working set; stepping in the backward
too, one bucket's gradient instead of its share.

Each variant, on every rank, in its own allocator-counted window (``hybrid.bench._live``, and
``tracemalloc`` for the load's buffers outside torch's allocator): build
on the meta device, materialise, load a checkpoint (hybrid's own files for ZeRO3, torch's
``torch.distributed.checkpoint`` for FSDP2, both written earlier in the run by the same variant),
and 3 training steps; the peak over the window is compared with the budget. Then their steps are
timed interleaved, FSDP2 twice per round for the A/A row.

Variants: ``fsdp2``; ``hybrid_zero3`` (``ZeRO3(meta_model)``, the speed-first default);
``hybrid_zero3_memory`` (``policy="memory"``); ``hybrid_zero3_in_backward`` (the default plan with
``ZeRO3Optimizer(step_in_backward=True)``); ``hybrid_zero3_offload`` (the default plan with Adam's
moments in files under the run's directory, ``offload_dir=``, stepped after the backward);
``hybrid_zero3_offload_in_backward`` (both). The report gives each variant's bytes in files beside
its peak.
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import statistics
import time
import tracemalloc
import warnings

import torch
import torch.distributed as dist
from torch import nn

from hybrid.cli._table import format_table, human_bytes
from hybrid.bench._stats import Ratio, ratio_table
from hybrid.bench.zero._zero3 import time_rounds, train_step

VARIANTS = ("fsdp2", "hybrid_zero3", "hybrid_zero3_memory", "hybrid_zero3_in_backward", "hybrid_zero3_offload",
            "hybrid_zero3_offload_in_backward")
STATE_PER_BUDGET = 3  # the model's training state, in budgets (issue 36.6)
REFERENCE = "fsdp2"
ROUND = (*VARIANTS, REFERENCE + "'")
MODEL = {"width": 1024, "depth": 12}
# The JAX runs, each in a process of its own (argv of hybrid.bench.zero._zero3_budget_jax), and their labels.
JAX_LABELS = {"default": "jax_zero3", "memory-first": "jax_zero3 memory-first",
              "memory-first offload": "jax_offloaded_zero3 memory-first"}
QUICK_MODEL = {"width": 256, "depth": 8}


def num_params(width: int, depth: int) -> int:
    return depth * (width * width + width)


def budget_bytes(width: int, depth: int) -> int:
    """The per-rank budget: a third of the model's training state (parameters, gradients and Adam's
    two moments, float32), rounded down to a KiB; the same at every world size (the model's size,
    not the world's, sets it)."""
    state = 16 * num_params(width, depth)
    return state // STATE_PER_BUDGET // 2**10 * 2**10


def _mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _build(name: str, width: int, depth: int, offload_dir: str):
    """``(module, optimizer)`` of a variant, from a meta-device build (``offload_dir``: where the
    offload variants keep Adam's moments)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybrid.torch import ZeRO3, ZeRO3Optimizer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _mlp(width, depth)
    if name == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # named: a GPU host's default is CUDA
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    zero3 = ZeRO3(model, policy="memory" if name == "hybrid_zero3_memory" else "speed")
    offload = name.startswith("hybrid_zero3_offload")
    in_backward = name.endswith("in_backward")
    return zero3, ZeRO3Optimizer(zero3, torch.optim.Adam, lr=1e-3, offload_dir=offload_dir if offload else None,
                                 step_in_backward=in_backward)


def _save(name: str, net, opt, path: str) -> None:
    if name == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        from hybrid.checkpoint import torch as checkpoint

        checkpoint.save(path, net, opt, step=1)


def _load(name: str, net, opt, path: str) -> None:
    if name == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        from hybrid.checkpoint import torch as checkpoint

        checkpoint.load(path, net, opt)




def worker(rank: int, world: int, port: int, outdir: str, model: dict, batch: int, reps: int, warmup: int) -> None:
    from hybrid.bench import _live

    warnings.simplefilter("ignore")  # torch's own FutureWarnings and UserWarnings in FSDP2 and DCP
    _live.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    width, depth = model["width"], model["depth"]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    paths = {name: os.path.join(outdir, f"ckpt-{world}-{name}") for name in VARIANTS}
    offload_dir = os.path.join(outdir, f"offload-{world}-{rank}")
    os.makedirs(offload_dir)
    for name in VARIANTS:  # the checkpoints the measured loads read, written outside their windows
        net, opt = _build(name, width, depth, offload_dir)
        train_step(net, opt, x)
        _save(name, net, opt, paths[name])
        del net, opt
    memory, runs = {}, {}
    for name in VARIANTS:
        gc.collect()
        base = _live.live_bytes()
        _live.reset_peak()
        t0 = time.perf_counter()
        net, opt = _build(name, width, depth, offload_dir)
        build = (_live.peak_bytes() - base, time.perf_counter() - t0)
        # The load's read buffers (numpy's, and Python's own objects) are outside torch's
        # allocator: tracemalloc counts them (numpy reports its data to it), and their peak is
        # added to the load's, an upper bound of the two together.
        tracemalloc.start()
        _load(name, net, opt, paths[name])
        read_buffers = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        load = _live.peak_bytes() - base
        for _ in range(3):
            train_step(net, opt, x)
        memory[name] = {"build": build[0], "build_s": build[1], "load": load, "read_buffers": read_buffers,
                        "peak": _live.peak_bytes() - base,
                        "held": _live.live_bytes() - base,
                        "in_files": opt.offloaded_bytes() if hasattr(opt, "offloaded_bytes") else 0}
        runs[name] = (net, opt)
        del net, opt
    times = time_rounds(runs, ROUND, x, warmup=warmup, reps=reps)
    torch.save({"memory": memory, "times": times}, os.path.join(outdir, f"budget-world{world}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def report(results: dict, model: dict, jax_rows: dict | None = None) -> str:
    """``results[world]``: every rank's saved dict. The fullest rank's bytes per variant against
    the budget and FSDP2, then the step times and the ratio table."""
    width, depth = model["width"], model["depth"]
    p = num_params(width, depth)
    lines = [f"model: {depth} x Linear({width}, {width}) + tanh, {p} parameters; parameters, gradients and "
             f"Adam's moments {human_bytes(16 * p)} (float32)"]
    rows, step_rows, groups, notes = [], [], {}, []
    for world, ranks in results.items():
        budget = budget_bytes(width, depth)
        fullest = {}
        for name in VARIANTS:
            mem = [r["memory"][name] for r in ranks]
            m = {k: max(x[k] for x in mem) for k in ("build", "load", "read_buffers", "peak", "held", "in_files")}
            # the window's peak with the load's read buffers (outside torch's allocator) on top of the load's: a bound
            m["peak"] = max(m["peak"], max(x["load"] + x["read_buffers"] for x in mem))
            fullest[name] = m
        for name in VARIANTS:
            m = fullest[name]
            rows.append([world, f"{human_bytes(budget)} ({16 * p / budget:.2f}x)", name, human_bytes(m["build"]),
                         human_bytes(m["load"]), human_bytes(m["read_buffers"]), human_bytes(m["peak"]),
                         f"{m['peak'] / budget:.3f}", f"{m['peak'] / fullest[REFERENCE]['peak']:.3f}",
                         "yes" if m["peak"] <= budget else "NO", human_bytes(m["in_files"]) if m["in_files"] else ""])
        times = ranks[0]["times"]
        med = {name: statistics.median(t) for name, t in times.items()}
        group = f"{world} ranks"
        step_rows += [[group, name, round(med[name] * 1e3, 1), round(med[name] / med[REFERENCE], 3)]
                      for name in VARIANTS]
        groups[group] = ([Ratio(name, REFERENCE, times[name], times[REFERENCE]) for name in VARIANTS[1:]],
                         Ratio(REFERENCE + "'", REFERENCE, times[REFERENCE + "'"], times[REFERENCE]))
        jax_runs = (jax_rows or {}).get(world, {})
        for flags, j in jax_runs.items():
            label = JAX_LABELS[flags]
            # the step's bound, and where a load ran (offload), the load's held bytes and read buffers
            load = j.get("load_held", 0) + j.get("read_buffers", 0)
            with_temp = max(j["held"] + j["step_temp"], load)
            in_files = human_bytes(j["in_files"]) if j.get("in_files") else ""
            loaded = [human_bytes(j["load_held"]), human_bytes(j["read_buffers"])] if "load_held" in j else ["", ""]
            rows.append([world, f"{human_bytes(budget)}", f"{label} (held)", human_bytes(j["init_held"]), *loaded,
                         human_bytes(j["held"]), f"{j['held'] / budget:.3f}", "",
                         "yes" if j["held"] <= budget else "NO", in_files])
            rows.append([world, "", f"{label} (+ step temp)", human_bytes(j["init_held"] + j["init_temp"]), "", "",
                         human_bytes(with_temp), f"{with_temp / budget:.3f}", "",
                         "yes" if with_temp <= budget else "NO", in_files])
            step_rows.append([f"{world} devices (JAX, its own process)", label, round(j["step_s"] * 1e3, 1), ""])
        if {"default", "memory-first"} <= jax_runs.keys():
            same = jax_runs["default"]["checksum"] == jax_runs["memory-first"]["checksum"]
            notes.append(f"{world} devices: JAX's trained parameters with and without the memory-first flags "
                         f"{'sum to the same float64 value' if same else 'DIFFER'}")
        if {"memory-first", "memory-first offload"} <= jax_runs.keys():
            a, b = jax_runs["memory-first"]["checksum"], jax_runs["memory-first offload"]["checksum"]
            notes.append(f"{world} devices: offloaded and resident, the trained parameters' float64 sums differ by "
                         f"{abs(a - b):.3g} ({abs(a - b) / abs(a):.2g} of the sum: each bucket's update is a program "
                         f"of its own, which XLA:CPU rounds apart by an ulp in some elements)")
    lines += ["", "peak per rank (the fullest rank), allocator-counted, from before the meta build: through the build, "
              "the load, and 3 steps; 'read buffers': what the load held outside torch's allocator (numpy's read "
              "buffers, tracemalloc's peak), added to the load's peak in the window's", format_table(
                  ["ranks", "budget (model / budget)", "variant", "build", "+ load", "read buffers",
                   "+ 3 steps (peak)", "/ budget", "/ FSDP2", "within", "in files"], rows),
              "", "step time, rank 0, medians of interleaved steps (forward + backward + Adam + zero_grad)",
              format_table(["group", "variant", "ms", "/ fsdp2 (medians)"], step_rows), "",
              ratio_table(groups, group="group"), *([""] + notes if notes else [])]
    return "\n".join(lines)
