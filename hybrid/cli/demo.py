"""``python -m hybrid demo``: one model trained by both frontends, compared, and handed over.

1. torch: DDP + ZeRO on a spawned gloo world at torch's default bucket caps; it saves a sharded
   checkpoint midway;
2. JAX: ``hybrid.jax.zero`` over host devices, from the same initial weights and batches, its
   buckets planned from its own backward's gradient-ready order (through the model pair's
   declared mapping for the GPT): the plan torch's DDP rebuilds after its first iteration;
3. both plans (fingerprints, tensors per bucket), the losses side by side and their parity;
4. JAX resumes the torch checkpoint at another world size and continues the curve;
5. a PNG of the loss curves beside the parity (|torch - JAX| per step, log scale).

The model is hybrid.models' GPT pair by default (``--model mlp``: the small twin MLP).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path


from hybrid.cli._demo_options import DemoOptions
from hybrid.cli._host import ask_host_devices
from hybrid.models._config import GPTConfig

# The GPT of the demo: 2 blocks of width 128 over 512 tokens, 470,528 parameters in 28 tensors
# (1.8 MiB of float32 gradients: at torch's default caps a 1 MiB first bucket and a second one).
DEMO_GPT = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
SEQ_LEN = 32
# Per model: steps, learning rate and global batch (rows; split over 2 ranks and over 3 devices).
DEFAULTS = {"gpt": dict(steps=40, lr=3e-3, batch_size=12), "mlp": dict(steps=60, lr=3e-3, batch_size=48)}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="train one model with the torch and the JAX frontend, compare, hand over a checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                   help="gpt: hybrid.models' GPT pair, 470,528 parameters (default); mlp: the 1,732-parameter twin MLP")
    p.add_argument("--steps", type=_int_from(2), help="training steps (default 40 for gpt, 60 for mlp)")
    p.add_argument("--world-size", type=_int_from(1), default=2, help="torch ranks and JAX devices (default 2)")
    p.add_argument("--resume-world-size", type=_int_from(1),
                   help="JAX devices that resume the torch checkpoint (default world size + 1)")
    p.add_argument("--save-at", type=_int_from(1), help="step after which torch saves (default steps / 2)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=1,
                   help="ZeRO stage (default 1; 3: torch ZeRO3 and JAX zero(stage=3) over shard_params)")
    p.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    p.add_argument("--lr", type=_positive_float, help="learning rate (default 3e-3)")
    p.add_argument("--batch-size", type=_int_from(1),
                   help="global batch rows (gpt: sequences of 32 tokens), split evenly (default 12 for gpt, 48 for mlp)")
    p.add_argument("--out", help="folder for the checkpoint and the plot (default $XDG_CACHE_HOME/hybrid/demo/MODEL, "
                                 "~/.cache when unset)")
    p.add_argument("--seed", type=_int_from(0), default=0, help="seeds the initial weights and the data (default 0)")
    p.set_defaults(demo_parser=p)
    return p


def _int_from(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _check(args) -> None:
    """Fill the model's defaults and check what no single option can: a message and exit 2."""
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.resume_world_size is None:
        args.resume_world_size = args.world_size + 1
    error = args.demo_parser.error
    for name, value in (("--world-size", args.world_size), ("--resume-world-size", args.resume_world_size)):
        if args.batch_size % value:
            error(f"{name} {value} must divide --batch-size {args.batch_size} (each rank gets as many rows)")
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not args.save_at < args.steps:
        error(f"--save-at must be in 1..{args.steps - 1} (a step before --steps {args.steps}), got {args.save_at}")
    if args.out is None:
        args.out = str(default_out(args.model))


def default_out(model: str) -> Path:
    """``$XDG_CACHE_HOME/hybrid/demo/MODEL`` (``~/.cache`` when unset or relative, as XDG says):
    outside the user's clone, so running the demo there leaves ``git status`` clean."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"
    return base / "hybrid" / "demo" / model


LOCK_NAME = ".demo.lock"


def hold_output(out: Path):
    """An exclusive lock on the output folder for this run (an open file; the OS releases it when
    the process ends, however it ends): two demos at once would overwrite each other's checkpoint
    and plot. A second one is refused, naming the first and the way out (``--out``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock, as before
        return None
    f = open(out / LOCK_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that did not say which"
        f.close()
        raise RuntimeError(f"another python -m hybrid demo is writing to {out} ({holder}); wait for it to end, or "
                           f"give this one a folder of its own with --out DIR") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


class PlainProgress:
    """What a progress bar says, as whole lines for a log: about every tenth step and the last,
    with the loss and the seconds so far (tqdm's carriage-return frames would pile up in a file).
    The slice of tqdm's interface the demo uses: ``update``, ``set_postfix``, ``with``."""

    def __init__(self, desc: str, total: int, stream=None):
        self.desc, self.total, self.stream = desc, total, stream or sys.stderr
        self.done, self.postfix, self._every, self._t0 = 0, "", max(1, total // 10), time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())
        if self.done == self.total or self.done % self._every == 0:
            print(f"{self.desc}: step {self.done}/{self.total}, {self.postfix}, "
                  f"{time.perf_counter() - self._t0:.1f} s", file=self.stream, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bar(desc: str, total: int):
    """tqdm's bar on a terminal; plain lines where stderr is a file or a pipe (a log, CI)."""
    if not sys.stderr.isatty():
        return PlainProgress(desc, total)
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True)


def _progress(bar):
    def progress(step, loss):
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    return progress


def _run_torch(config, options: DemoOptions, params, checkpoint: Path):
    from hybrid.demo import launch_torch

    what = "ZeRO3" if options.stage == 3 else f"DDP + ZeRO-{options.stage}"
    with _bar(f"torch  {what}, {options.world_size} gloo ranks", config.num_steps) as bar:
        return launch_torch(config, world_size=options.world_size, params=params, progress=_progress(bar),
                            save_to=str(checkpoint), save_at=options.save_at)


def _run_jax(config, params, num_devices: int, desc: str, *, resume: Path | None = None, start: int = 0):
    from hybrid.demo import train_jax

    with _bar(desc, config.num_steps - start) as bar:
        return train_jax(config, num_devices=num_devices, params=params, progress=_progress(bar),
                         resume=None if resume is None else str(resume))


def run(args) -> int:
    """The command: its arguments checked and made plain (:class:`DemoOptions`), then :func:`run_demo`."""
    _check(args)
    return run_demo(DemoOptions(args.model, args.steps, args.world_size, args.resume_world_size, args.save_at,
                                args.stage, args.optimizer, args.lr, args.batch_size, args.seed, args.out))


def run_demo(options: DemoOptions) -> int:
    """The demo; returns the exit status (1 with a message on stderr when anything fails)."""
    t0 = time.perf_counter()
    ask_host_devices(max(options.world_size, options.resume_world_size), cpu=True)
    try:
        return _demo(options, t0)
    except Exception as e:  # noqa: BLE001 - the command's contract: a clear message, non-zero exit
        print(f"\nhybrid demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _demo(options: DemoOptions, t0: float) -> int:
    from hybrid.cli import _demo_report as report
    from hybrid.demo import TrainConfig, initial_params

    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    lock = hold_output(out)  # noqa: F841 - held until the process ends
    checkpoint = out / "checkpoint"
    config = TrainConfig(seed=options.seed, global_batch_size=options.batch_size, num_steps=options.steps,
                         optimizer=options.optimizer, lr=options.lr, stage=options.stage,
                         weight_decay=0.01 if options.optimizer == "adamw" else 0.0,
                         gpt=DEMO_GPT if options.model == "gpt" else None, seq_len=SEQ_LEN)
    params = initial_params(config)  # the GPT's: torch's init, which the JAX side gets through the mapping
    report.print_model(config, params, options)
    torch_run = _run_torch(config, options, params, checkpoint)
    jax_run = _run_jax(config, params, options.world_size,
                       f"jax    zero stage {options.stage}, {options.world_size} devices")
    resumed = _run_jax(config, params, options.resume_world_size,
                       f"jax    resume torch's step-{options.save_at} checkpoint on {options.resume_world_size} devices",
                       resume=checkpoint, start=options.save_at)
    print()
    same_plan = report.print_plans(torch_run, jax_run, options.world_size, options.stage)
    print()
    report.print_losses(torch_run, jax_run, resumed, options.save_at)
    print()
    agree = report.print_parity(config, torch_run, jax_run, resumed, options)
    print(f"Checkpoint (torch, {options.world_size} rank files + manifest.json): {checkpoint}")
    plot = out / "loss_curves.png"
    report.plot(plot, torch_run, jax_run, resumed, options)
    print(f"Plot of the loss curves and their parity: {plot}")
    print(f"Done in {time.perf_counter() - t0:.1f} s.")
    if not same_plan:
        print("hybrid demo failed: the two frameworks planned different buckets", file=sys.stderr)
    elif agree is not None:
        print(f"hybrid demo failed: {agree}", file=sys.stderr)
    return 0 if same_plan and agree is None else 1
