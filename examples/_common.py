"""What both example scripts share: the command line of a run and how rank 0 reports it."""

import argparse
import os

import numpy as np

from hybrid.demo import TrainConfig


def parse(description: str, extra=None) -> tuple[TrainConfig, argparse.Namespace]:
    """The TrainConfig the command line asks for, and the parsed arguments (``extra`` adds some)."""
    p = argparse.ArgumentParser(description=description)
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.num_steps)
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=d.stage,
                   help="ZeRO stage (3: torch ZeRO3 + ZeRO3Optimizer, JAX zero(stage=3) over shard_params)")
    p.add_argument("--optimizer", choices=("adam", "adamw"), default=d.optimizer)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="adamw only")
    p.add_argument("--clip-norm", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=d.global_batch_size, help="global, over all ranks")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", help="write the losses and final parameters here (.npz), from rank 0")
    p.add_argument("--save", metavar="PATH", help="save a checkpoint here (every rank writes its file)")
    p.add_argument("--save-at", type=int, metavar="STEP", help="with --save: after this many steps (default: at the "
                   "end); training goes on")
    p.add_argument("--resume", metavar="PATH", help="resume from this checkpoint (saved by either example, at any "
                   "number of ranks) at its step")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save into DIR/step-NNNNNN every --save-every steps, and "
                   "resume from the newest checkpoint there: launched again after a crash, the run goes on")
    p.add_argument("--save-every", type=int, metavar="N", help="with --checkpoint-dir: steps between saves")
    p.add_argument("--fail-at", type=int, metavar="STEP", help="crash (exit 3, no cleanup) once STEP steps are done, "
                   "as a killed job would: to try the recovery")
    if extra is not None:
        extra(p)
    a = p.parse_args()
    if a.save_at is not None and (a.save is None or not 0 <= a.save_at <= a.steps):
        p.error(f"--save-at {a.save_at} needs --save PATH and a step in [0, --steps {a.steps}]")
    if (a.save_every is None) != (a.checkpoint_dir is None) or (a.save_every is not None and a.save_every < 1):
        p.error("--checkpoint-dir and --save-every go together (a positive number of steps)")
    config = TrainConfig(num_steps=a.steps, stage=a.stage, optimizer=a.optimizer, lr=a.lr,
                         weight_decay=a.weight_decay, clip_norm=a.clip_norm, global_batch_size=a.batch_size,
                         seed=a.seed)
    return config, a


def checkpoint_args(args: argparse.Namespace, *, say: bool) -> dict:
    """``--save``, ``--save-at``, ``--resume``, ``--checkpoint-dir`` and ``--save-every`` as the keyword
    arguments of train_torch / train_jax; the checkpoint a relaunch resumes from is said (``say``)."""
    from hybrid.checkpoint import Checkpoint
    from hybrid.demo._checkpointing import Checkpointing

    resume = Checkpointing(args.resume, checkpoint_dir=args.checkpoint_dir).resume_path()
    if say and resume is not None:
        print(f"resuming from {resume} (step {Checkpoint(resume).manifest.step})", flush=True)
    return dict(save_to=args.save, save_at=args.save_at, resume=resume, checkpoint_dir=args.checkpoint_dir,
                save_every=args.save_every)


def progress_of(args: argparse.Namespace):
    """Each step's global loss, printed; at ``--fail-at`` the process dies as a killed one does."""
    def progress(step: int, loss: float) -> None:
        print(f"step {step} loss {loss:.6f}", flush=True)
        if args.fail_at is not None and step + 1 == args.fail_at:
            print(f"crashing after step {step} (--fail-at {args.fail_at})", flush=True)
            os._exit(3)
    return progress


def report(result, args, world_size: int) -> None:
    """Rank 0's summary line, and the .npz for ``--out``."""
    print(f"done: {len(result.losses)} steps on {world_size} ranks in {result.seconds:.2f} s, loss "
          f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}, bucket plan {result.plan_fingerprint}", flush=True)
    if args.out:
        np.savez(args.out, losses=result.losses, start_step=result.start_step,
                 **{f"param/{k}": v for k, v in result.params.items()})
