"""Run by ``test_zero3_habits`` as torchrun runs it, ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: rank 0 in
a collective of its own (``dist.barrier()``) while the others run a ZeRO3 forward. hybrid cannot
tag a collective it does not issue; torch's own check can, and hybrid names what it says. Every
rank writes ``{"outcome", "seconds"}`` to ``DIR/mixed-R.json`` (``DIR``: the first argument)."""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from hybrid.torch import ZeRO3


def main() -> None:
    # A long timeout: without torch's check, the ranks would wait all of it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    model = ZeRO3(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)))
    start = time.perf_counter()
    try:
        if rank == 0:
            dist.barrier()  # say, after saving something on rank 0 only
        else:
            model(torch.ones(2, 8))
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    with open(os.path.join(sys.argv[1], f"mixed-{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.perf_counter() - start}, f)
    os._exit(0)  # the group is unusable after a mismatch: do not wait in its teardown


if __name__ == "__main__":
    main()
