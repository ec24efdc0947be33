"""GPT training steps of hybrid's torch classes against torch's own, one rank per device.

``bench ddp --device D``: ``hybrid_ddp`` (hybrid.torch.DistributedDataParallel) against
``torch_ddp`` (torch.nn.parallel.DistributedDataParallel). ``bench zero --device D``:
``hybrid_zero1`` (hybrid's DDP + ZeroRedundancyOptimizer) against ``torch_zero1`` (torch's DDP +
torch's ZeroRedundancyOptimizer), and ``hybrid_zero3`` (hybrid.torch.ZeRO3 + ZeRO3Optimizer, its
default plan) against ``fsdp2`` (``fully_shard`` on every block, then on the root, as torch
recommends). Every variant is built from the same seed on the device, with AdamW.

A step is what a training loop does: forward and loss (under ``torch.autocast(bfloat16)`` for
bf16), backward (the reduction in it), ``optimizer.step()``, ``zero_grad(set_to_none=True)``; it is
timed from a barrier to the device's end (``torch.cuda.synchronize``). Each pair is timed in the
round reference, hybrid, reference again (the A/A), rotated every round.

Memory, per variant right after it is built (the other variants alive but idle, so none of theirs
moves inside its window), from the bytes live before the build: ``held`` after two steps (params,
optimizer state, DDP's buckets: what stays between steps) and ``peak`` over the third step
(``torch.cuda.max_memory_allocated``; on the CPU, ``hybrid.bench._live``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid.bench._stats import rotated
from hybrid.bench.gpt import _report
from hybrid.bench.gpt._config import LR, StepBench
from hybrid.bench.gpt._device import TorchDevice

# (hybrid, torch) pairs; the torch class is the reference of its pair. bench zero's --part picks
# among its pairs ("1-2": ZeRO-1, torch having no ZeRO-2 class; "3"; "all").
DDP_PAIRS = (("hybrid_ddp", "torch_ddp"),)
ZERO_PAIRS = {"1-2": (("hybrid_zero1", "torch_zero1"),), "3": (("hybrid_zero3", "fsdp2"),)}
ZERO_PAIRS["all"] = ZERO_PAIRS["1-2"] + ZERO_PAIRS["3"]


def round_of(pairs) -> list[str]:
    """A round of timed steps: per pair the reference, hybrid's, the reference again (``'``).

    >>> round_of(ZERO_PAIRS["all"])
    ['torch_zero1', 'hybrid_zero1', "torch_zero1'", 'fsdp2', 'hybrid_zero3', "fsdp2'"]
    """
    return [name for ours, ref in pairs for name in (ref, ours, ref + "'")]


def build(name: str, bench: StepBench, device: torch.device):
    """``(module to call, optimizer)`` of one variant, on ``device``, from seed 0."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hybrid.models import TorchGPT
    from hybrid.torch import DistributedDataParallel, ZeRO3, ZeRO3Optimizer, ZeroRedundancyOptimizer

    torch.manual_seed(0)
    with device:  # parameters made and initialised on the device: no host copy to move over
        model = TorchGPT(bench.gpt)
    ids = [device.index] if device.type == "cuda" else None
    adamw = torch.optim.AdamW
    if name == "torch_ddp":
        return TorchDDP(model, device_ids=ids), adamw(model.parameters(), lr=LR)
    if name == "hybrid_ddp":
        return DistributedDataParallel(model, device_ids=ids), adamw(model.parameters(), lr=LR)
    if name == "torch_zero1":
        return TorchDDP(model, device_ids=ids), TorchZeRO(model.parameters(), optimizer_class=adamw, lr=LR)
    if name == "hybrid_zero1":
        return (DistributedDataParallel(model, device_ids=ids),
                ZeroRedundancyOptimizer(model.parameters(), optimizer_class=adamw, lr=LR))
    if name == "hybrid_zero3":
        zero3 = ZeRO3(model)
        return zero3, ZeRO3Optimizer(zero3, adamw, lr=LR)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The mesh named: without one fully_shard takes the default device's type.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embeddings (the tied head), ln_f
        return model, adamw(model.parameters(), lr=LR)
    raise ValueError(f"unknown variant {name!r}")


def step(net, opt, batch, autocast) -> None:
    """One training step as a loop runs it."""
    idx, targets = batch
    with autocast():
        _, loss = net(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _autocast(dtype: str, device: torch.device):
    if dtype == "float32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _facts(name: str, net) -> dict:
    """What a variant's own plan says, for the header: buckets, and whether the kernels copy."""
    if name in ("hybrid_ddp", "hybrid_zero1"):
        return {"buckets": net.bucket_plan.num_buckets, "kernels": bool(net._kernel_copy)}
    if name == "hybrid_zero3":
        return {"buckets": net.bucket_plan.num_buckets}
    return {}


def _prepare(name: str, bench: StepBench, dev: TorchDevice, batch, autocast):
    """Build one variant and count its memory: ``(net, opt, {"held", "peak"})``."""
    gc.collect()
    dev.release()
    dev.sync()
    base = dev.allocated()
    net, opt = build(name, bench, dev.device)
    for _ in range(2):  # optimizer state exists after the first step; DDP rebuilds its buckets
        step(net, opt, batch, autocast)
    dev.sync()
    held = dev.allocated() - base
    dev.reset_peak()
    step(net, opt, batch, autocast)
    dev.sync()
    return net, opt, {"held": held, "peak": dev.peak() - base}


def measure(bench: StepBench, pairs, dev: TorchDevice, batch, dtype: str) -> dict:
    """Memory and interleaved step times of every variant of ``pairs``, for one dtype, this rank.

    A variant that fails to build or step is reported (``failed``: its error) and its pair left
    out of the rounds: on a lent GPU one broken variant must not cost the others' figures.
    """
    autocast = _autocast(dtype, dev.device)
    runs, memory, facts, failed = {}, {}, {}, {}
    for name in [name for pair in pairs for name in pair]:
        try:
            net, opt, memory[name] = _prepare(name, bench, dev, batch, autocast)
        except Exception as e:  # noqa: BLE001 (reported in the table, the run goes on)
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        facts[name] = _facts(name, net)
        runs[name] = (net, opt)
        del net, opt  # only runs holds them: nothing of this variant is freed in the next one's window
    order = round_of([pair for pair in pairs if not set(pair) & set(failed)])
    times = {name: [] for name in order}
    for it in range(bench.warmup + bench.reps):
        for name in rotated(order, it):
            net, opt = runs[name.rstrip("'")]
            dev.sync()
            dist.barrier()  # ranks start each step together, as the others' collectives wait for them
            t0 = time.perf_counter()
            step(net, opt, batch, autocast)
            dev.sync()
            if it >= bench.warmup:
                times[name].append(time.perf_counter() - t0)
    runs.clear()
    gc.collect()
    dev.release()
    return {"memory": memory, "times": times, "facts": facts, "failed": failed}


def worker(rank: int, world: int, port: int, outdir: str, bench: StepBench, pairs, bench_name: str) -> None:
    """One rank: its process group, its batch, every dtype measured. After each dtype rank 0 has
    every rank's results and writes the goal records (``bench.json``), so a run cut short keeps
    what it measured; at the end it saves them to ``outdir``."""
    warnings.simplefilter("ignore", FutureWarning)  # torch's own calls in ZeroRedundancyOptimizer, FSDP2
    dev = TorchDevice(bench.device, rank)
    kwargs = {"device_id": dev.device} if dev.is_cuda else {}
    dist.init_process_group("nccl" if dev.is_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300), **kwargs)
    try:
        g = torch.Generator().manual_seed(rank)  # each rank its own data, as data parallelism has
        idx = torch.randint(bench.gpt.vocab_size, (bench.batch, bench.seq + 1), generator=g).to(dev.device)
        batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())  # next-token targets
        result = {"rank": rank, "device": dev.name, "dtypes": {}}
        for dtype in bench.dtypes:
            result["dtypes"][dtype] = measure(bench, pairs, dev, batch, dtype)
            results = [None] * world
            dist.all_gather_object(results, result)
            if rank == 0 and bench.json:
                memory = "max_memory_allocated" if dev.is_cuda else "hybrid.bench._live"
                _report.write_json(bench.json, _report.records(bench_name, where(bench, dev.name), results, pairs,
                                                               memory=memory))
        if rank == 0:
            torch.save(results, os.path.join(outdir, "ranks.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def where(bench: StepBench, device_name: str) -> str:
    """The run in a few words, for its records: ``"gpt2-small, 1 rank (nccl), NVIDIA H100"``."""
    backend = "nccl" if bench.device == "cuda" else "gloo"
    return f"{bench.model}, {bench.ranks} rank{'s' * (bench.ranks != 1)} ({backend}), {device_name}"


def run(bench: StepBench, pairs, bench_name: str) -> list[dict]:
    """Start ``bench.ranks`` processes (resolved: not ``None``), one per device; their results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="hybrid_bench_gpt_") as outdir:
        mp.spawn(worker, args=(bench.ranks, port, outdir, bench, pairs, bench_name), nprocs=bench.ranks, join=True)
        return torch.load(os.path.join(outdir, "ranks.pt"))


def environment() -> dict:
    """The software the times come from, for the report's header."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "tf32 matmul": torch.backends.cuda.matmul.allow_tf32}
