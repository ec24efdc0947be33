"""What both example scripts share: the command line of a run and how rank 0 reports it."""

import argparse

import numpy as np

from hybrid.demo import TrainConfig


def parse(description: str, extra=None) -> tuple[TrainConfig, argparse.Namespace]:
    """The TrainConfig the command line asks for, and the parsed arguments (``extra`` adds some)."""
    p = argparse.ArgumentParser(description=description)
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.num_steps)
    p.add_argument("--stage", type=int, choices=(1, 2), default=d.stage, help="ZeRO stage")
    p.add_argument("--optimizer", choices=("adam", "adamw"), default=d.optimizer)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="adamw only")
    p.add_argument("--clip-norm", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=d.global_batch_size, help="global, over all ranks")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", help="write the losses and final parameters here (.npz), from rank 0")
    if extra is not None:
        extra(p)
    a = p.parse_args()
    config = TrainConfig(num_steps=a.steps, stage=a.stage, optimizer=a.optimizer, lr=a.lr,
                         weight_decay=a.weight_decay, clip_norm=a.clip_norm, global_batch_size=a.batch_size,
                         seed=a.seed)
    return config, a


def print_step(step: int, loss: float) -> None:
    print(f"step {step} loss {loss:.6f}", flush=True)


def report(result, args, world_size: int) -> None:
    """Rank 0's summary line, and the .npz for ``--out``."""
    print(f"done: {len(result.losses)} steps on {world_size} ranks in {result.seconds:.2f} s, loss "
          f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}, bucket plan {result.plan_fingerprint}", flush=True)
    if args.out:
        np.savez(args.out, losses=result.losses, **{f"param/{k}": v for k, v in result.params.items()})
