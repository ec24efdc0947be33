"""The stage-3 part of ``python -m hybrid bench zero``: memory and step time of ZeRO-3 beside DDP,
FSDP2 and hybrid's ZeRO-1 and ZeRO-2, on two models, at 2 and 3 gloo ranks.

Models: the 8M-parameter MLP of the ZeRO-1/2 part, 100 small layers (``Linear(128, 128)`` + tanh
each: 1.65M parameters), where per-layer communication costs the most, and 100 ``Linear(32, 32)``
(the smallest layers, issue 36's memory comparison). Variants, each a full training step
(forward, backward, optimizer step, zero_grad) with Adam:

- ``ddp_adam``: torch DDP + ``torch.optim.Adam`` (the reference), timed twice per round for the
  A/A row (``ddp_adam'``);
- ``hybrid_zero1`` / ``hybrid_zero2``: hybrid DDP + ZeroRedundancyOptimizer / ZeRO2;
- ``hybrid_zero3``: ``hybrid.torch.ZeRO3`` + ``ZeRO3Optimizer``, default plan
  (``hybrid.core.zero3_plan``), prefetch 1, parameters freed after the forward;
- ``hybrid_zero3_memory``: ``ZeRO3(policy="memory")``: a bucket per layer (FSDP2's unit of
  gathering), nothing kept between forward and backward: the memory-first policy;
- ``fsdp2``: torch's ``fully_shard`` on every ``Linear`` and on the root, as torch recommends.

Memory is counted by the CPU allocator (``hybrid.bench._live``), per variant right after it is
built (so no other variant's step is inside its window): ``held`` between steps, and the
``peak`` over a whole step, both including what the variant's model and optimizer hold.
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from hybrid.cli._table import format_table, human_bytes
from hybrid.bench._stats import Ratio, ratio_table, rotated

VARIANTS = ("ddp_adam", "hybrid_zero1", "hybrid_zero2", "hybrid_zero3", "hybrid_zero3_memory", "fsdp2")
REFERENCE = "ddp_adam"
ROUND = (*VARIANTS, REFERENCE + "'")  # rotated every repetition
MODELS = {"mlp_8M": (1536, 2048, 1024, 1536, 768), "layers_100": (128,) * 101, "layers_100x32": (32,) * 101}
QUICK_MODELS = {"mlp_0.5M": (384, 512, 256, 384, 192), "layers_20": (64,) * 21}


def mlp(widths: tuple[int, ...]) -> nn.Module:
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


def build(name: str, widths: tuple[int, ...]):
    """``(module to call, optimizer, ZeRO3 or None)`` for one variant, from the same init."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hybrid.torch import DistributedDataParallel, ZeRO2, ZeRO3, ZeRO3Optimizer, ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = mlp(widths)
    if name == "ddp_adam":
        return TorchDDP(model), torch.optim.Adam(model.parameters(), lr=1e-3), None
    if name == "hybrid_zero1":
        return DistributedDataParallel(model), ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3), None
    if name == "hybrid_zero2":
        ddp = DistributedDataParallel(model)
        return ddp, ZeRO2(ddp, torch.optim.Adam, lr=1e-3), None
    if name in ("hybrid_zero3", "hybrid_zero3_memory"):
        zero3 = ZeRO3(model, policy="memory" if name == "hybrid_zero3_memory" else "speed")
        return zero3, ZeRO3Optimizer(zero3, torch.optim.Adam, lr=1e-3), zero3
    if name == "fsdp2":
        # A CPU mesh, named: without one fully_shard takes the default device's type, and on a machine
        # with a GPU it moves the model there while the other variants stay on the CPU.
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), None
    raise ValueError(f"unknown variant {name!r}")


def train_step(net, opt, x) -> None:
    """One step of the benches' MLPs: a squared-output loss, the optimizer's step, gradients freed."""
    net(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_rounds(runs: dict, rounds, x, *, warmup: int, reps: int) -> dict[str, list[float]]:
    """Each round name's step times (``runs[name]``: ``(net, opt)``; a name ending in ``'`` runs its
    variant again, the A/A row), the round rotated every repetition and each step started after a
    barrier, so every rank times the same step; the first ``warmup`` repetitions are not kept."""
    times = {name: [] for name in rounds}
    for it in range(warmup + reps):
        for name in rotated(list(rounds), it):
            net, opt = runs[name.rstrip("'")]
            dist.barrier()
            t0 = time.perf_counter()
            train_step(net, opt, x)
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def worker(rank: int, world: int, port: int, outdir: str, models: dict, batch: int, reps: int, warmup: int) -> None:
    from hybrid.bench import _live

    warnings.simplefilter("ignore", FutureWarning)  # torch's own calls in DDP, ZeRO-1 and FSDP2
    _live.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    result = {}
    for model_name, widths in models.items():
        x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(rank))
        runs, memory = {}, {}
        for name in VARIANTS:
            gc.collect()
            base = _live.live_bytes()
            net, opt, zero3 = build(name, widths)
            for _ in range(2):  # optimizer state exists after the first step
                train_step(net, opt, x)
            held = _live.live_bytes() - base
            _live.reset_peak()
            train_step(net, opt, x)
            memory[name] = {"held": held, "peak": _live.peak_bytes() - base}
            if zero3 is not None:
                memory[name].update(buckets=zero3.bucket_plan.num_buckets, **zero3.memory_stats())
            runs[name] = (net, opt)
            del net, opt, zero3  # the next variant's window must not see these go
        times = time_rounds(runs, ROUND, x, warmup=warmup, reps=reps)
        result[model_name] = {"memory": memory, "times": times}
        del runs  # this model's variants go before the next model's are built
    torch.save(result, os.path.join(outdir, f"stage3-world{world}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def memory_report(results: dict) -> str:
    """One row per (model, world size, variant): the larger rank's held and peak bytes, and their
    ratio to DDP's."""
    rows = []
    for (model, world), ranks in results.items():
        worst = {name: {k: max(r[model]["memory"][name][k] for r in ranks) for k in ("held", "peak")}
                 for name in VARIANTS}
        ref = worst[REFERENCE]
        for name in VARIANTS:
            m = worst[name]
            extra = ""
            if name.startswith("hybrid_zero3"):
                z = ranks[0][model]["memory"][name]
                extra = f"{z['buckets']} buckets, working set {human_bytes(z['working_set'])}"
            rows.append([model, world, name, human_bytes(m["held"]), f"{m['held'] / ref['held']:.3f}",
                         human_bytes(m["peak"]), f"{m['peak'] / ref['peak']:.3f}", extra])
    return format_table(["model", "ranks", "variant", "held", "/ DDP", "peak in a step", "/ DDP", ""], rows)


def step_report(results: dict) -> str:
    """Median step times (rank 0) per group, and the ratio table: every variant over DDP."""
    rows, groups = [], {}
    for (model, world), ranks in results.items():
        times = ranks[0][model]["times"]
        med = {name: statistics.median(t) for name, t in times.items()}
        group = f"{model}, {world} ranks"
        rows += [[group, name, round(med[name] * 1e3, 2), round(med[name] / med[REFERENCE], 3)] for name in VARIANTS]
        ratios = [Ratio(name, REFERENCE, times[name], times[REFERENCE]) for name in VARIANTS if name != REFERENCE]
        groups[group] = (ratios, Ratio(REFERENCE + "'", REFERENCE, times[REFERENCE + "'"], times[REFERENCE]))
    return "\n".join([format_table(["group", "variant", "ms", f"/ {REFERENCE} (medians)"], rows), "",
                      ratio_table(groups, group="group")])
