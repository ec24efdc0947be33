"""``python -m hybrid bench zero --part compile``: a compiled ZeRO3 step beside a compiled FSDP2 step.

The model is :class:`hybrid.models.Llama`, the torchtitan-style decoder, trained with AdamW on
next-token cross-entropy. Every variant starts from one build and compiles as torchtitan does:
each block compiled before wrapping (``block.compile()``, inductor), then sharded per block.

- ``fsdp2_compiled`` (the reference, timed twice per round for the A/A row ``fsdp2_compiled'``):
  compiled blocks, ``fully_shard`` on each block and on the root, ``torch.optim.AdamW``;
- ``hybrid_zero3_compiled``: compiled blocks, ``hybrid.torch.ZeRO3`` (default plan) +
  ``ZeRO3Optimizer(AdamW)``;
- ``hybrid_zero3_compiled_whole``: ``torch.compile(ZeRO3(model))`` (each block a unit, a graph);
- ``hybrid_zero3``: eager ZeRO3, the step the compiled one should beat;
- ``fsdp2``: eager FSDP2 per block, for scale.

Each rank builds every variant, warms it up (the compiles run there, not in the timed steps),
then times them interleaved, the round rotated every repetition (``hybrid.bench._stats``).
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid.bench._stats import Ratio, ratio_table, rotated
from hybrid.cli._table import format_table

VARIANTS = ("fsdp2_compiled", "hybrid_zero3_compiled", "hybrid_zero3_compiled_whole", "hybrid_zero3", "fsdp2")
REFERENCE = "fsdp2_compiled"
ROUND = (*VARIANTS, REFERENCE + "'")
# (vocab, dim, layers, heads, hidden, sequence length, batch). On a CPU the wide model's step is
# its matmuls, which compiling leaves as they are; the narrow one with long sequences spends more
# of it in the elementwise work (norms, rotary, SwiGLU's gate, attention's) that inductor fuses.
MODELS = {"llama_4.5M": (2048, 256, 4, 4, 768, 128, 4), "llama_0.25M_seq256": (256, 64, 4, 4, 192, 256, 8)}
QUICK_MODELS = {"llama_0.14M": (256, 64, 2, 4, 192, 32, 4)}


def build(name: str, base):
    """``(callable model, optimizer)`` for one variant, from a copy of ``base``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybrid.torch import ZeRO3, ZeRO3Optimizer

    model = copy.deepcopy(base)
    if name.endswith("_compiled"):
        for block in model.layers.values():
            block.compile()
    if name.startswith("fsdp2"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # named: see hybrid.bench.zero._zero3
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero3 = ZeRO3(model)
    call = torch.compile(zero3) if name == "hybrid_zero3_compiled_whole" else zero3
    return call, ZeRO3Optimizer(zero3, torch.optim.AdamW, lr=1e-3)


def train_step(model, opt, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def worker(rank: int, world: int, port: int, outdir: str, models: dict, reps: int, warmup: int) -> None:
    from torch._dynamo.utils import counters

    from hybrid.models import Llama, LlamaConfig

    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    result = {}
    for model_name, (vocab, dim, layers, heads, hidden, seq, batch) in models.items():
        config = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, hidden_dim=hidden,
                             max_seq_len=seq)
        torch.manual_seed(0)
        base = Llama(config)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(rank))
        runs, losses, compiles = {}, {}, {}
        for name in VARIANTS:
            before = counters["stats"]["unique_graphs"]
            runs[name] = build(name, base)
            losses[name] = [train_step(*runs[name], tokens).item() for _ in range(2)]  # compiles here
            compiles[name] = counters["stats"]["unique_graphs"] - before
        frames = counters["frames"]["total"]
        times = {name: [] for name in ROUND}
        for it in range(warmup + reps):
            for name in rotated(list(ROUND), it):
                dist.barrier()
                t0 = time.perf_counter()
                train_step(*runs[name.rstrip("'")], tokens)
                if it >= warmup:
                    times[name].append(time.perf_counter() - t0)
        result[model_name] = {"times": times, "losses": losses, "graphs": compiles,
                              "recompiles": counters["frames"]["total"] - frames,
                              "params": sum(p.numel() for p in base.parameters()), "batch": batch, "seq": seq}
        del runs
    torch.save(result, os.path.join(outdir, f"compile-world{world}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def report(results: dict) -> str:
    """Medians (rank 0) per model and world, the unique graphs each variant compiled, the frames
    compiled during the timed steps (0: no recompile), the first two losses, and the ratio table."""
    rows, groups = [], {}
    for (model, world), ranks in results.items():
        r = ranks[0][model]
        times = r["times"]
        med = {name: statistics.median(t) for name, t in times.items()}
        group = f"{model}, {world} ranks"
        rows += [[group, name, round(med[name] * 1e3, 2), round(med[name] / med[REFERENCE], 3), r["graphs"][name],
                  " ".join(f"{v:.6f}" for v in r["losses"][name])] for name in VARIANTS]
        ratios = [Ratio(name, REFERENCE, times[name], times[REFERENCE]) for name in VARIANTS if name != REFERENCE]
        ratios += [Ratio(name, "hybrid_zero3", times[name], times["hybrid_zero3"])
                   for name in ("hybrid_zero3_compiled", "hybrid_zero3_compiled_whole")]
        groups[group] = (ratios, Ratio(REFERENCE + "'", REFERENCE, times[REFERENCE + "'"], times[REFERENCE]))
        rows.append([group, f"(frames compiled in the timed steps: {r['recompiles']})", "", "", "", ""])
    head = ["group", "variant", "ms", f"/ {REFERENCE} (medians)", "graphs compiled", "losses of the first 2 steps"]
    return "\n".join([format_table(head, rows), "", ratio_table(groups, group="group")])
