"""What one run of a GPT training-step bench is (:class:`StepBench`), and its command-line options,
the same for ``bench ddp``, ``bench zero`` and ``bench jax``."""

from __future__ import annotations

import argparse
import dataclasses

from hybrid.models._config import CONFIG_NAMES, GPTConfig

DEVICES = ("cpu", "cuda")
# float32: no autocast (torch's default float32 matmuls); bf16: torch.autocast(bfloat16) around the
# forward and the loss, or on JAX the params cast to bfloat16 for the forward (master params,
# gradients and optimizer state stay float32 on both).
DTYPES = ("float32", "bf16")
LR = 1e-4  # AdamW's, on both frameworks: small enough that no variant diverges in a bench's steps


@dataclasses.dataclass(frozen=True, slots=True)
class StepBench:
    """One run of the GPT training-step bench: where, which model, what batch, how many steps.

    Args:
      device: ``"cuda"`` (NCCL ranks, one per GPU; JAX's GPU devices) or ``"cpu"`` (gloo ranks;
        JAX's host devices): the same code either way.
      model: a :meth:`hybrid.models.GPTConfig.named` name.
      ranks: torch processes (one per GPU on ``cuda``) or JAX devices in the mesh; ``None`` until
        the device is checked (every visible GPU; one torch rank / every JAX host device on ``cpu``).
      batch, seq: sequences per rank (per JAX device) and tokens per sequence.
      dtypes: of :data:`DTYPES`, each timed apart.
      reps, warmup: timed rounds, and untimed rounds before them.
      json: where to write the goal records for ``bench summary`` (``None``: nowhere).

    >>> StepBench("cuda").tokens_per_rank
    8192
    >>> StepBench("cuda", model="tiny")
    Traceback (most recent call last):
    ...
    ValueError: --seq 1024 is longer than tiny's block_size 128
    """

    device: str
    model: str = "gpt2-small"
    ranks: int | None = None
    batch: int = 8
    seq: int = 1024
    dtypes: tuple[str, ...] = DTYPES
    reps: int = 20
    warmup: int = 3
    json: str | None = None

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.model not in CONFIG_NAMES:
            raise ValueError(f"--model must be one of {', '.join(CONFIG_NAMES)}, got {self.model!r}")
        for name, least in (("ranks", 1), ("batch", 1), ("seq", 1), ("reps", 1), ("warmup", 0)):
            v = getattr(self, name)
            if not (v is None and name == "ranks") and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ValueError(f"--{name} must be an int >= {least}, got {v!r}")
        if not self.dtypes or len(set(self.dtypes)) != len(self.dtypes) or not set(self.dtypes) <= set(DTYPES):
            raise ValueError(f"--dtypes must be distinct names of {', '.join(DTYPES)}, got {','.join(self.dtypes)!r}")
        if self.seq > self.gpt.block_size:
            raise ValueError(f"--seq {self.seq} is longer than {self.model}'s block_size {self.gpt.block_size}")

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig.named(self.model)

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq


def add_arguments(parser: argparse.ArgumentParser, *, batch: bool = True) -> None:
    """The GPT bench's options (``--batch`` too unless the bench has its own)."""
    group = parser.add_argument_group(
        "GPT training steps on a device (with --device; without it, the gloo CPU bench above)")
    group.add_argument("--device", choices=DEVICES, default=None,
                       help="time GPT training steps here: cuda (NCCL, a rank per GPU) or cpu (gloo)")
    group.add_argument("--model", choices=CONFIG_NAMES, default=None, help="the GPT config (default gpt2-small)")
    if batch:
        group.add_argument("--batch", type=int, default=None, help="sequences per rank (default 8)")
    group.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024, at most block_size)")
    group.add_argument("--dtypes", default=None, help="comma-separated, of float32,bf16 (default both)")
    group.add_argument("--ranks", type=int, default=None,
                       help="ranks (JAX: devices); default every visible GPU on cuda, 1 torch rank / all host devices on cpu")
    group.add_argument("--json", default=None, metavar="FILE", help="write the goal records for `bench summary` here")


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> StepBench | None:
    """The :class:`StepBench` the options ask for, ``None`` without ``--device``; a usage error
    (exit 2) for a GPT option without ``--device`` or a bad value, naming it."""
    given = [f"--{name}" for name in ("model", "seq", "dtypes", "ranks", "json") if getattr(args, name) is not None]
    if args.device is None:
        if given:
            parser.error(f"{', '.join(given)} only with --device (cpu or cuda), for the GPT training-step bench")
        return None
    model = args.model or "gpt2-small"
    try:
        block = GPTConfig.named(model).block_size
        or_default = lambda given, default: default if given is None else given  # noqa: E731 (0 is an error, not the default)
        return StepBench(device=args.device, model=model, ranks=args.ranks, batch=or_default(args.batch, 8),
                         seq=or_default(args.seq, min(1024, block)),
                         dtypes=DTYPES if args.dtypes is None else tuple(args.dtypes.split(",")),
                         reps=or_default(args.reps, 5 if args.quick else 20), warmup=2 if args.quick else 3,
                         json=args.json)
    except ValueError as e:
        parser.error(str(e))
