"""Run by ``test_zero3_habits`` as torchrun runs it (2 and 4 processes): what a torch user scaling a DDP
script out to ZeRO3 does by habit. Every rank writes one JSON line per check to
``DIR/rank-R.jsonl`` (``DIR``: the first argument).

0. After a step, the inner module called for evaluation: ``with torch.no_grad(): model.module(x)``
   on a model whose root owns a parameter (every rank died of SIGSEGV before), and ``with
   model.gathered(): model.module(x)`` on a GPT with a root-owned position table (a "setStorage"
   error before): both give torch DDP's outputs.
1. ``if rank == 0: torch.save(model.state_dict(), f)``, the others going on to the next forward:
   every rank raises within seconds, naming both calls and the fix (before: rank 0 blocked for the
   process group's timeout with 7 buckets; with 1 bucket its gathers paired with the others'
   forward and returned right values by luck). Both bucket counts.
2. The documented ways that work: ``full_state_dict()`` on every rank (rank 0 gets DDP's
   ``state_dict()``, bit for bit; the others an empty dict), and a per-rank checkpoint.
"""

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from hybrid.checkpoint import torch as checkpoint
from hybrid.torch import ZeRO3, ZeRO3Optimizer
from hybrid.torch._call_guard import CallMismatch
from tests.torch_zero3._models import RootScale, TinyGPT, tokens


def report(check: str, **fields) -> None:
    with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.jsonl"), "a") as f:
        f.write(json.dumps({"rank": dist.get_rank(), "check": check, **fields}) + "\n")


def model_in(num_buckets: int) -> ZeRO3:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(7)])
    cap = 16 * 17 * 4 / 2**20 if num_buckets == 7 else None  # a layer a bucket, or the default (one)
    model = ZeRO3(net, bucket_cap_mb=cap)
    assert model.bucket_plan.num_buckets == num_buckets, model.bucket_plan.num_buckets
    return model


def rank0_only_save(num_buckets: int) -> None:
    model = model_in(num_buckets)
    opt = ZeRO3Optimizer(model, torch.optim.Adam, lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    t0 = time.monotonic()
    try:
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), os.devnull)  # the DDP habit
        model(x).sum().backward()  # every rank goes on training
        outcome = "returned"
    except CallMismatch as e:
        outcome = str(e)
    report(f"rank0_only_save[{num_buckets}]", outcome=outcome, seconds=time.monotonic() - t0)
    # Every rank left the failed check at once: the group is in step again, and the documented way works.
    full = model.full_state_dict()
    everyone = model.state_dict()
    same = dist.get_rank() != 0 or (list(full) == list(everyone)
                                    and all(torch.equal(full[k], v) for k, v in everyone.items()))
    report(f"full_state_dict[{num_buckets}]", keys=len(full), same=same)
    path = os.path.join(sys.argv[1], f"per-rank-{num_buckets}")
    checkpoint.save(path, model, opt, step=1)  # or each rank writes its own slices
    report(f"per_rank_save[{num_buckets}]", files=sorted(os.listdir(path)) if dist.get_rank() == 0 else None)


def inner_module(name: str, make, data) -> None:
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = make()
    model, ref = ZeRO3(copy.deepcopy(base)), copy.deepcopy(base)
    ddp = DDP(ref)
    opts = ZeRO3Optimizer(model, torch.optim.Adam, lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for net, opt in ((model, opts[0]), (ddp, opts[1])):
        net(data(0)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    x = data(1)
    with torch.no_grad():
        want = ref(x)
        no_grad = (model.module(x) - want).abs().max().item()
    with model.gathered():
        gathered = (model.module(x).detach() - want).abs().max().item()
    report(f"inner_module[{name}]", no_grad=no_grad, gathered=gathered)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    inner_module("root_scale", RootScale, lambda s: torch.randn(4, 5, generator=torch.Generator().manual_seed(rank + s)))
    inner_module("tiny_gpt", TinyGPT, lambda s: tokens(rank, s))
    for num_buckets in (7, 1):
        rank0_only_save(num_buckets)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.argv.append(tempfile.mkdtemp())
    main()
