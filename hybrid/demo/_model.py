"""The demo's runs, numpy half: configuration, initial parameters, data and the rows of each rank.

Two model pairs train here, both from ``hybrid.models``. The twin MLP: one MLP written for each
framework (``hybrid.models.TorchMLP``, ``hybrid.models.mlp_logits``), both starting from the
arrays ``hybrid.models.init_params`` returns and reading the batches :func:`global_batch` makes. The GPT
(``TrainConfig(gpt=...)``): ``hybrid.models``' torch and flax halves, crossed by their declared
mapping, on a synthetic token stream (``_tokens.py``). Either way the two frameworks start from
the same weights and read the same batches (:func:`initial_params`, :func:`batch`), so they
differ only in how each computes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hybrid.core import BucketPlan
from hybrid.models._config import GPTConfig
from hybrid.models._mlp import init_params

_CENTER_SCALE = 0.35


@dataclasses.dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training run, identical for both frontends.

    Args:
      sizes: layer widths, input first, number of classes last.
      seed: seeds the initial parameters and the data.
      global_batch_size: rows per step over all ranks; split evenly, rank ``r`` gets rows
        ``[r * B / W, (r + 1) * B / W)``.
      num_steps: optimizer steps.
      optimizer: ``"adam"`` or ``"adamw"`` (torch.optim / optax of that name).
      lr, weight_decay, betas, eps: the optimizer's hyper-parameters (``weight_decay`` for adamw).
      stage: ZeRO stage, 1 (torch ``ZeroRedundancyOptimizer``), 2 (torch ``ZeRO2``) or 3 (torch
        ``ZeRO3`` + ``ZeRO3Optimizer``; JAX ``zero(..., stage=3)`` over ``shard_params``).
      clip_norm: clip the reduced gradients to this global norm (``None``: no clipping).
      bucket_cap_bytes: ``None`` for torch's default caps (a 1 MiB first bucket, then 25 MiB), or
        DDP's ``bucket_cap_mb`` in bytes, which torch then takes as the first bucket's cap too; the
        same on both sides (the JAX side plans from its backward's gradient-ready order, so its
        buckets are those torch's DDP rebuilds after its first iteration).
      gpt: train ``hybrid.models``' GPT pair of this config instead of the MLP (``sizes`` is
        then unused); a row of the batch is ``seq_len`` tokens of a synthetic stream.
      seq_len: tokens per row for the GPT (at most its ``block_size``).

    >>> TrainConfig(stage=4)
    Traceback (most recent call last):
    ...
    ValueError: stage must be 1, 2 or 3, got 4
    """

    sizes: tuple[int, ...] = (16, 32, 32, 4)
    seed: int = 0
    global_batch_size: int = 32
    num_steps: int = 50
    optimizer: str = "adam"
    lr: float = 1e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    stage: int = 1
    clip_norm: float | None = None
    bucket_cap_bytes: int | None = None
    gpt: GPTConfig | None = None
    seq_len: int = 32

    def __post_init__(self):
        if len(self.sizes) < 2 or any(int(s) < 1 for s in self.sizes):
            raise ValueError(f"sizes must be at least two positive widths, got {self.sizes!r}")
        if self.optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be 'adam' or 'adamw', got {self.optimizer!r}")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        if self.weight_decay and self.optimizer == "adam":
            raise ValueError(f"weight_decay={self.weight_decay!r} needs optimizer='adamw' (Adam's L2 "
                             f"penalty and optax.adam's lack of one differ)")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {self.clip_norm!r}")
        if self.global_batch_size < 1 or self.num_steps < 0 or (self.bucket_cap_bytes or 0) < 0:
            raise ValueError(f"global_batch_size={self.global_batch_size!r}, num_steps={self.num_steps!r} "
                             f"and bucket_cap_bytes={self.bucket_cap_bytes!r} must be non-negative "
                             f"(the batch positive)")
        if self.gpt is not None and not 1 <= self.seq_len <= self.gpt.block_size:
            raise ValueError(f"seq_len must be in 1..block_size={self.gpt.block_size}, got {self.seq_len!r}")

    def to_json(self) -> dict:
        """The config as JSON-able values (recorded in a checkpoint's manifest)."""
        def plain(v):
            return list(v) if isinstance(v, tuple) else dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def model(self) -> str:
        """``"gpt"`` or ``"mlp"``."""
        return "mlp" if self.gpt is None else "gpt"


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run returns: ``losses[i]`` is step ``start_step + i``'s global loss (the mean over
    ranks of each rank's mean cross-entropy, before that step's update), ``params`` the final
    parameters by name in registration order, ``plan_fingerprint`` the fingerprint of the bucket
    plan the frontend reduced with (for torch the plan DDP rebuilt after the first iteration),
    ``seconds`` the training loop's wall time, ``plan`` that bucket plan itself."""

    losses: np.ndarray
    params: dict[str, np.ndarray]
    plan_fingerprint: str
    seconds: float
    start_step: int = 0
    plan: BucketPlan | None = None


def global_batch(seed: int, step: int, sizes, global_batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s batch: ``(x float32 (B, sizes[0]), y int64 (B,))``, Gaussian blobs, one per
    class, deterministic in ``(seed, step)`` so any step (a resumed run's too) is reproducible.

    >>> x, y = global_batch(0, 5, (3, 4, 2), 6)
    >>> x.shape, x.dtype, y.tolist() == global_batch(0, 5, (3, 4, 2), 6)[1].tolist()
    ((6, 3), dtype('float32'), True)
    """
    num_in, num_classes = sizes[0], sizes[-1]
    # Blobs that overlap (centers ~2 noise deviations apart in 16 dimensions): the loss keeps
    # falling for a few hundred steps instead of reaching ~0, where its float32 rounding dominates.
    centers = np.random.default_rng([seed, 1]).normal(scale=_CENTER_SCALE, size=(num_classes, num_in))
    rng = np.random.default_rng([seed, 2, step])
    y = rng.integers(0, num_classes, size=global_batch_size)
    x = centers[y] + rng.normal(size=(global_batch_size, num_in))
    return x.astype(np.float32), y.astype(np.int64)


def initial_params(config: TrainConfig) -> dict[str, np.ndarray]:
    """The weights both frameworks start from, numpy by torch's names in registration order: the
    MLP's :func:`init_params`, or the GPT's as torch initialises it (``_tokens.gpt_init``).

    >>> list(initial_params(TrainConfig(sizes=(3, 2))))
    ['layers.0.weight', 'layers.0.bias']
    """
    if config.gpt is None:
        return init_params(config.seed, config.sizes)
    from hybrid.demo._tokens import gpt_init
    return gpt_init(config.seed, config.gpt)


def batch(config: TrainConfig, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch ``(inputs, targets)`` of the config's model: the MLP's
    :func:`global_batch`, or the GPT's rows of tokens and their next tokens (``_tokens.token_batch``).

    >>> x, y = batch(TrainConfig(gpt=GPTConfig(vocab_size=16, block_size=8), seq_len=5, global_batch_size=3), 0)
    >>> x.shape, y.shape, bool((x[:, 1:] == y[:, :-1]).all())
    ((3, 5), (3, 5), True)
    """
    if config.gpt is None:
        return global_batch(config.seed, step, config.sizes, config.global_batch_size)
    from hybrid.demo._tokens import token_batch
    return token_batch(config.seed, step, config.gpt.vocab_size, config.global_batch_size, config.seq_len)


def rank_rows(arrays, rank: int, world_size: int):
    """Rank ``rank``'s rows of each array: ``[r * B / W, (r + 1) * B / W)``, as ``P("dp")`` splits.

    >>> rank_rows((np.arange(6),), 1, 2)[0].tolist()
    [3, 4, 5]
    """
    n = len(arrays[0])
    if n % world_size:
        raise ValueError(f"a global batch of {n} rows does not split evenly over {world_size} ranks")
    k = n // world_size
    return tuple(a[rank * k:(rank + 1) * k] for a in arrays)
