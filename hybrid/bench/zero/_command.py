"""``python -m hybrid bench zero``: ZeRO-1, -2 and -3 memory per rank, and step time, vs DDP + Adam.

Two gloo processes on this machine, one MLP, Adam. Variants, each a full training step
(forward, backward, gradient reduction, optimizer step, zero_grad), interleaved A, B, C, ...
so drift hits all of them alike:

- ``ddp_adam``:     torch DDP + torch.optim.Adam over all parameters (the unsharded reference);
- ``torch_zero1``:  torch DDP + torch's ZeroRedundancyOptimizer(Adam);
- ``hybrid_zero1``: hybrid DDP + hybrid's ZeroRedundancyOptimizer(Adam) (greedy whole-tensor
  partition, parameters broadcast by their owners);
- ``hybrid_zero2``: hybrid DDP + hybrid's ZeRO2(Adam) (buckets reduced, each rank keeps and
  updates its flat slices, parameters gathered);
- ``hybrid_zero3``: hybrid's ZeRO3 + ZeRO3Optimizer(Adam) (parameters sharded too: gathered per
  bucket while used); its memory and step time beside DDP and FSDP2 are the stage-3 part below;
- ``hybrid_overlap`` / ``hybrid_overlap_interleaved``: hybrid DDP + ZeroRedundancyOptimizer(Adam,
  overlap_with_ddp=True) stepped inside backward by ``hook_with_zero_step`` / ``_interleaved``
  (torch's own refuse gloo, so they have no torch counterpart here); ``hybrid_overlap_shard``
  is ``hook_with_zero_step(..., shard_buckets=True)``;
- ``hybrid_zero1_auto`` / ``hybrid_zero2_auto``: ``hybrid_zero1`` / ``hybrid_zero2`` over a DDP
  with ``bucket_cap_mb="auto"``, each also paired with its default-caps twin.

Memory is counted from the live tensors of rank 0 and rank 1 (the larger is printed): optimizer
state is every tensor in the optimizer's state; gradients are what a rank keeps for the optimizer
between backward and step (``.grad`` for DDP and ZeRO-1, the gradient slices for ZeRO-2).
DDP's own communication buckets (full size in every variant, as in torch) are listed apart.

``torch_zero1`` is stepped a second time in every round (``torch_zero1'``, right after
``hybrid_zero1``) for the A/A row of the ratio table: the reference against itself.

Then the stage-3 part (``hybrid.bench.zero._zero3``): ZeRO-3 beside DDP, FSDP2, ZeRO-1 and ZeRO-2 on
the MLP and on 100 small layers, at 2 and 3 ranks: allocator-counted memory and step times.
``--part budget`` (``hybrid.bench.zero._zero3_budget``): a model no rank can hold, built on the meta
device under a per-rank budget, beside FSDP2's meta build, at 2, 3 and 4 ranks, and JAX's stage 3.

With ``--device cuda`` (or ``cpu``) it times GPT training steps instead (GPT-2 small by default,
float32 and bf16, AdamW): hybrid's ZeRO-1 against torch's ZeroRedundancyOptimizer and ZeRO3
against FSDP2 (``--part`` picks), NCCL ranks one per GPU, peak memory beside the times
(``hybrid.bench.gpt``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hybrid.cli._table import format_table, human_bytes
from hybrid.bench import gpt
from hybrid.bench._stats import Ratio, ratio_table, rotated
from hybrid.demo._world import free_port

WORLD_SIZE = 2
VARIANTS = ("ddp_adam", "torch_zero1", "hybrid_zero1", "hybrid_zero2", "hybrid_zero3", "hybrid_overlap",
            "hybrid_overlap_shard", "hybrid_overlap_interleaved", "hybrid_zero1_auto", "hybrid_zero2_auto")
AUTO = {"hybrid_zero1_auto": "hybrid_zero1", "hybrid_zero2_auto": "hybrid_zero2"}  # auto caps -> torch's caps
REFERENCE = "torch_zero1"
# The order of a round: the reference again right after hybrid_zero1, as hybrid_zero1 follows it.
ROUND = (*VARIANTS[:3], REFERENCE + "'", *VARIANTS[3:])


def _mlp(widths: tuple[int, ...]) -> nn.Module:
    # Unequal layers, so that the greedy whole-tensor partition (ZeRO-1) cannot balance exactly.
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


def _state_bytes(opt) -> int:
    if isinstance(opt, _Overlapped):
        states = [s for o in opt.zero._overlap_runtime.optims.values() for s in o.state.values()]
    else:
        states = (opt.optim.state if hasattr(opt, "optim") else opt.state).values()
    return sum(v.nbytes for s in states for v in s.values() if isinstance(v, torch.Tensor))


def _grad_bytes(model: nn.Module, opt) -> int:
    if hasattr(opt, "grad_numel"):  # ZeRO2 and ZeRO3 keep float32 slices; .grad is a stand-in
        return 4 * opt.grad_numel()
    return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


class _Overlapped:
    """The training loop's optimizer when the step runs in backward: step() is skipped."""

    def __init__(self, zero):
        self.zero = zero

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        self.zero.zero_grad(set_to_none=set_to_none)


def _build(name: str, widths: tuple[int, ...]):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hybrid.torch import DistributedDataParallel, ZeRO2, ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = _mlp(widths)
    lr = 1e-3
    if name == "ddp_adam":
        ddp = TorchDDP(model)
        return model, ddp, torch.optim.Adam(model.parameters(), lr=lr)
    if name == "torch_zero1":
        ddp = TorchDDP(model)
        return model, ddp, TorchZero(model.parameters(), torch.optim.Adam, lr=lr)
    caps = {"bucket_cap_mb": "auto"} if name in AUTO else {}
    if name in ("hybrid_zero1", "hybrid_zero1_auto"):
        ddp = DistributedDataParallel(model, **caps)
        return model, ddp, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    if name in ("hybrid_zero2", "hybrid_zero2_auto"):
        ddp = DistributedDataParallel(model, **caps)
        return model, ddp, ZeRO2(ddp, torch.optim.Adam, lr=lr)
    if name == "hybrid_zero3":
        from hybrid.torch import ZeRO3, ZeRO3Optimizer
        zero3 = ZeRO3(model)
        return model, zero3, ZeRO3Optimizer(zero3, torch.optim.Adam, lr=lr)
    if name in ("hybrid_overlap", "hybrid_overlap_shard", "hybrid_overlap_interleaved"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from hybrid.torch import hook_with_zero_step, hook_with_zero_step_interleaved
        ddp = DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=lr)
        wrap = hook_with_zero_step if name == "hybrid_overlap" else hook_with_zero_step_interleaved
        ddp.register_comm_hook(None, wrap(allreduce_hook, ddp, zero, shard_buckets=name.endswith("_shard")))
        return model, ddp, _Overlapped(zero)
    raise ValueError(f"unknown variant {name!r}")


def _worker(rank, world, port, outdir, widths, batch, reps, warmup):
    warnings.simplefilter("ignore", FutureWarning)
    # DDP's first plan is one bucket, which shard_buckets cannot cut into world_size runs: the
    # overlap hook says so once and assigns it whole (documented); the timed steps come later.
    warnings.filterwarnings("ignore", message=r"bucket \d+ splits into more than world_size")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    built = {name: _build(name, widths) for name in VARIANTS}
    runs = {name: built[name.rstrip("'")] for name in ROUND}
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(rank))
    times = {name: [] for name in ROUND}
    memory = {}
    for it in range(warmup + reps):
        for name in rotated(list(runs), it):
            model, ddp, opt = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            ddp(x).pow(2).mean().backward()
            grad_bytes = _grad_bytes(model, opt) if it == warmup else None  # not timed: cheap sums
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
            if it == warmup:
                # hybrid's DDP: its bucket buffers (torch's keeps them in its C++ reducer)
                buckets = (sum(b.numel() * b.element_size() for b in ddp._reducer.buckets.flat)
                           if hasattr(ddp, "_reducer") else None)
                memory[name] = (_state_bytes(opt), grad_bytes, buckets)
    params = list(runs["ddp_adam"][0].parameters())
    numels = [p.numel() for p in params]
    greedy = runs["hybrid_zero1"][2].partition.numel_per_rank()
    result = {"rank": rank, "memory": memory, "times": times,
              "numel": sum(numels), "num_tensors": len(numels), "greedy_numel_per_rank": greedy,
              "zero2_buckets": runs["hybrid_zero2"][1].bucket_plan.num_buckets,
              "auto_plans": {name: [len(b.members) if not b.in_place else "1 in place" for b in
                                    runs[name][1].bucket_plan.buckets] for name in AUTO}}
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid bench zero", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP, 3 repetitions (--device: its model, 5 rounds after 2)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 25; --device: 20)")
    parser.add_argument("--widths", type=str, default=None,
                        help="comma-separated layer widths of the MLP (default 1536,2048,1024,1536,768)")
    parser.add_argument("--part", choices=("all", "1-2", "3", "budget", "compile"), default="all",
                        help="the ZeRO-1/2 part, the stage-3 part, both (default), or the model no rank can hold "
                             "(budget: from a meta-device build, beside FSDP2's, and the JAX side), or compiled ZeRO3 "
                             "beside compiled FSDP2 (compile: a Llama, blocks compiled before wrapping); --device: ZeRO-1 "
                             "against torch's, ZeRO3 against FSDP2, or both")
    parser.add_argument("--worlds", type=str, default=None,
                        help="world sizes of the stage-3 part (default 2,3), of the budget part (default 2,3,4) or "
                             "of the compile part (default 2)")
    gpt.add_arguments(parser)
    args = parser.parse_args(argv)
    bench = gpt.config_from_args(parser, args)
    if bench is not None:
        if args.part == "budget":
            parser.error("--part budget: a CPU run of gloo ranks, not taken with --device")
        from hybrid.bench.gpt._torch import ZERO_PAIRS
        mlp_only = [f"--{name}" for name in ("widths", "worlds") if getattr(args, name) is not None]
        if mlp_only:
            parser.error(f"{', '.join(mlp_only)}: the MLP's, not taken with --device (--ranks sets the ranks)")
        return gpt.torch_main(parser, bench, "zero", ZERO_PAIRS[args.part])
    reps = args.reps or (3 if args.quick else 25)
    if args.part in ("all", "1-2"):
        _zero12(args, reps)
    if args.part in ("all", "3"):
        _stage3(args, reps)
    if args.part == "budget":
        _budget(args, reps)
    if args.part == "compile":
        _compiled(args, reps)
    return 0


def _run_worlds(worker, worlds: tuple[int, ...], models: dict, tag: str, *args) -> dict:
    """Spawn ``worker(rank, world, port, outdir, models, *args)`` in each world; returns
    ``{(model, world): [each rank's result]}``, read from the ``{tag}-world{world}-rank{r}.pt`` it saves."""
    outdir = tempfile.mkdtemp(prefix=f"hybrid_bench_{tag}_")
    results = {}
    for world in worlds:
        mp.spawn(worker, args=(world, free_port(), outdir, models, *args), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(outdir, f"{tag}-world{world}-rank{r}.pt")) for r in range(world)]
        results.update({(model, world): ranks for model in models})
    return results


def _compiled(args, reps: int) -> None:
    from hybrid.bench.zero import _zero3_compile as compiled

    worlds = tuple(int(w) for w in (args.worlds or "2").split(","))
    models = compiled.QUICK_MODELS if args.quick else compiled.MODELS
    results = _run_worlds(compiled.worker, worlds, models, "compile", reps, 2)
    print("\n# compiled ZeRO3 beside compiled FSDP2: Llama (hybrid.models), blocks compiled before wrapping "
          "(inductor), AdamW, gloo")
    for model in models:
        r = results[(model, worlds[0])][0][model]
        print(f"{model}: {r['params']} parameters (float32), batch {r['batch']} x {r['seq']} tokens")
    print(f"\nstep time, rank 0, medians of {reps} interleaved steps (forward + backward + step + zero_grad)")
    print(compiled.report(results))


def _stage3(args, reps: int) -> None:
    from hybrid.bench.zero import _zero3

    worlds = tuple(int(w) for w in (args.worlds or "2,3").split(","))
    models = _zero3.QUICK_MODELS if args.quick else _zero3.MODELS
    results = _run_worlds(_zero3.worker, worlds, models, "stage3", 32, reps, 3)
    print("\n# stage 3: ZeRO3 beside DDP, FSDP2 (fully_shard per layer), ZeRO-1 and ZeRO-2, Adam, batch 32, gloo")
    for model, widths in models.items():
        n = sum(a * b + b for a, b in zip(widths, widths[1:]))
        print(f"{model}: {len(widths) - 1} Linear layers, {n} parameters (float32)")
    print("\nmemory per rank, counted by the CPU allocator (the larger rank): held between steps, peak in a step")
    print(_zero3.memory_report(results))
    print(f"\nstep time, rank 0, medians of {reps} interleaved steps (forward + backward + step + zero_grad)")
    print(_zero3.step_report(results))


def _budget(args, reps: int) -> None:
    import json
    import shutil
    import subprocess
    import sys

    from hybrid.bench.zero import _zero3_budget as budget

    worlds = tuple(int(w) for w in (args.worlds or "2,3,4").split(","))
    model = budget.QUICK_MODEL if args.quick else budget.MODEL
    outdir = tempfile.mkdtemp(prefix="hybrid_bench_budget_")
    results, jax_rows = {}, {}
    for world in worlds:
        mp.spawn(budget.worker, args=(world, free_port(), outdir, model, 32, reps, 2), nprocs=world, join=True)
        results[world] = [torch.load(os.path.join(outdir, f"budget-world{world}-rank{r}.pt")) for r in range(world)]
        for flags in budget.JAX_LABELS:  # XLA:CPU's own, use_memory_first_xla_cpu's, and with the state in files
            out = os.path.join(outdir, f"jax-{world}-{flags.replace(' ', '-')}.json")
            subprocess.run([sys.executable, "-m", "hybrid.bench.zero._zero3_budget_jax", str(world), str(model["width"]),
                            str(model["depth"]), "32", out, *([] if flags == "default" else flags.split())], check=True)
            with open(out) as f:
                jax_rows.setdefault(world, {})[flags] = json.load(f)
        for name in budget.VARIANTS:  # the checkpoints its loads read: the model's state, every world size
            shutil.rmtree(os.path.join(outdir, f"ckpt-{world}-{name}"), ignore_errors=True)
    shutil.rmtree(outdir, ignore_errors=True)  # the ranks' results, read; the emptied offload directories
    print("\n# a model no rank can hold: built on the meta device, loaded, trained 3 steps under a per-rank budget "
          "(hybrid ZeRO3 and torch FSDP2, gloo; JAX stage 3 on host devices)")
    print(budget.report(results, model, jax_rows))
    print("\njax_zero3: bytes per device of its slices of the parameters and Adam's state, born sharded "
          "(init_shards), after 3 steps; '+ step temp': with what XLA's compiled step says it needs beside them. "
          "The build column of '+ step temp' adds the init's temporaries (the most its programs need per device: "
          "each device computes 1/N of the initialisers, then the rows move into the buckets' slices a bucket at a "
          "time). 'memory-first': the same program with hybrid.jax.use_memory_first_xla_cpu()'s XLA:CPU flags. "
          "jax_offloaded_zero3: hybrid.jax.OffloadedZero3 under those flags, Adam's state in files ('in files'), "
          "saved and loaded back before its steps (hybrid.checkpoint.jax.load into the optimizer: a slot at a time "
          "into the files, then the parameters into a template of shapes; '+ load' and numpy's 'read buffers' per "
          "device); it holds its parameter slices between steps, and its '+ step temp' is a bound on the step's "
          "needs beside them (the larger of the gradient program's temporaries and gradient slices, and the gradient "
          "slices with the largest bucket update's state in, outputs and temporaries, no aliasing counted), or the "
          "load's with its read buffers where that is larger. The JAX step times are "
          "from separate processes, one after the other (not interleaved: indicative only).")


def _zero12(args, reps: int) -> None:
    default = "256,384,192,256" if args.quick else "1536,2048,1024,1536,768"
    widths = tuple(int(w) for w in (args.widths or default).split(","))
    if len(widths) < 2 or min(widths) < 1:
        raise ValueError(f"--widths needs at least two positive widths, got {args.widths!r}")
    batch = 32
    outdir = tempfile.mkdtemp(prefix="hybrid_bench_zero_")
    mp.spawn(_worker, args=(WORLD_SIZE, free_port(), outdir, widths, batch, reps, 3), nprocs=WORLD_SIZE, join=True)
    results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]
    r0 = results[0]
    n = r0["numel"]
    print(f"MLP {'-'.join(map(str, widths))}: {n} parameters in {r0['num_tensors']} tensors (float32), "
          f"Adam, world size {WORLD_SIZE}, gloo; ZeRO-2 over {r0['zero2_buckets']} DDP buckets; auto caps, "
          f"tensors per bucket: {r0['auto_plans']}")

    print("\nmemory per rank (the larger of the ranks) / unsharded (ddp_adam)")
    ref_state = max(r["memory"]["ddp_adam"][0] for r in results)
    ref_grad = max(r["memory"]["ddp_adam"][1] for r in results)
    rows = []
    for name in VARIANTS:
        state = max(r["memory"][name][0] for r in results)
        grad = max(r["memory"][name][1] for r in results)
        buckets = r0["memory"][name][2]
        rows.append([name, human_bytes(state), f"{state / ref_state:.5f}", human_bytes(grad),
                     f"{grad / ref_grad:.5f}",
                     "none (no DDP)" if name == "hybrid_zero3" else human_bytes(buckets) if buckets is not None
                     else "n/a (C++)"])
    print(format_table(["variant", "opt state", "state/unsharded", "grads kept", "grads/unsharded",
                        "DDP buckets"], rows))
    greedy = r0["greedy_numel_per_rank"]
    print(f"target for the flat partition (ZeRO-2): <= {1 / WORLD_SIZE * 1.01:.4f}; "
          f"greedy partition (ZeRO-1) elements per rank {greedy}: "
          f"imbalance max/mean = {max(greedy) / (sum(greedy) / len(greedy)):.4f}")

    print(f"\nstep time, rank 0, medians of {reps} interleaved steps (forward + backward + step + zero_grad)")
    print(step_report(r0["times"]))


def step_report(times: dict) -> str:
    """Median step times, their ratio to ``ddp_adam``, and the ratio table against the reference."""
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [[name, round(med[name] * 1e3, 2), round(med[name] / med["ddp_adam"], 3)] for name in VARIANTS]
    ratios = [Ratio(name, REFERENCE, times[name], times[REFERENCE]) for name in VARIANTS if name != REFERENCE]
    ratios += [Ratio(name, default, times[name], times[default]) for name, default in AUTO.items()]
    same = Ratio(REFERENCE + "'", REFERENCE, times[REFERENCE + "'"], times[REFERENCE])
    return "\n".join([format_table(["variant", "ms", "/ ddp_adam (medians)"], rows), "",
                      ratio_table({"step": (ratios, same)})])
