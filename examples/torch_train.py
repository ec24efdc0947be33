"""Train the twin MLP with hybrid's torch frontend (DDP + ZeRO) on every process torchrun starts.

    torchrun --nproc_per_node=2 examples/torch_train.py --steps 20

torchrun starts the processes and passes RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
environment (``env://`` rendezvous); on several machines run it on each with ``--nnodes``,
``--node_rank`` and ``--master_addr`` of the first. Rank r trains on rows [r*B/W, (r+1)*B/W) of
every global batch; rank 0 prints each step's global loss. ``--save PATH --save-at K`` saves a
checkpoint after step K (every rank writes its file), ``--resume PATH`` continues from one (saved
by either script, at any number of ranks).

Recovering from a crash: ``--checkpoint-dir DIR --save-every N`` saves every N steps and, when the
same command is launched again, resumes from the newest checkpoint in DIR. Relaunch the whole
torchrun command (a scheduler's retry, or ``until torchrun ...; do sleep 5; done``): torchrun's own
``--max-restarts`` restarts the workers into a gloo rendezvous they cannot connect (torch 2.13,
``Gloo connectFullMesh failed``). ``--fail-at K`` crashes rank 0 after step K, to try it.
"""

import torch.distributed as dist

from _common import checkpoint_args, parse, progress_of, report
from hybrid.demo import pin_torch_numerics, train_torch


def main() -> None:
    config, args = parse(__doc__.splitlines()[0])
    pin_torch_numerics()
    dist.init_process_group("gloo")  # env:// from torchrun; the twin model lives on the CPU
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = train_torch(config, progress=progress_of(args), **checkpoint_args(args, say=rank == 0))  # progress: rank 0
    if rank == 0:
        report(result, args, world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
