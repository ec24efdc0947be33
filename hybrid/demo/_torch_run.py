"""The twin models trained with hybrid's torch frontend: DDP + ZeroRedundancyOptimizer or ZeRO2, or ZeRO3.

A run is: build the module and optimizer from numpy arrays (:func:`build_torch`) -> [load state]
-> :func:`train_torch_steps` -> [save state] -> :class:`~hybrid.demo.TrainResult`.
:func:`train_torch` does that in the current process group (one call per rank, as under
``torchrun``); :func:`launch_torch` spawns a gloo world on 127.0.0.1 and returns rank 0's result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybrid.demo._checkpointing import Checkpointing
from hybrid.demo._model import TrainConfig, TrainResult, batch, initial_params, rank_rows
from hybrid.demo._world import COLLECTIVE_TIMEOUT_S, free_port, spawn_world  # noqa: F401 - re-exported
from hybrid.models._mlp_torch import hold_params, torch_model
from hybrid.torch import DistributedDataParallel, ZeRO2, ZeRO3, ZeRO3Optimizer, ZeroRedundancyOptimizer

Progress = Callable[[int, float], None]  # (step, global loss), called on rank 0 after each step


def torch_module(config: TrainConfig, params: dict[str, np.ndarray]) -> nn.Module:
    """The config's torch model holding copies of ``params``: :func:`torch_model` for the MLP,
    ``hybrid.models.TorchGPT`` (its head tied to the token embedding) for the GPT.

    >>> from hybrid.demo import initial_params
    >>> from hybrid.models import GPTConfig
    >>> config = TrainConfig(gpt=GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8), seq_len=8)
    >>> model = torch_module(config, initial_params(config))
    >>> model.lm_head.weight is model.wte.weight
    True
    """
    if config.gpt is None:
        return torch_model(params)
    from hybrid.models import TorchGPT
    return hold_params(TorchGPT(config.gpt), params)


def _loss(config: TrainConfig, ddp, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    """The mean cross-entropy of this rank's rows (for the GPT, of every token of them)."""
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    return F.cross_entropy(ddp(x), y) if config.gpt is None else ddp(x, y)[1]


def pin_torch_numerics() -> None:
    """No TF32 anywhere, one intra-op thread (2-core machines; also a fixed reduction order)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)


def build_torch(config: TrainConfig, params: dict[str, np.ndarray] | None = None):
    """``(ddp, optimizer)`` for ``config`` in the current process group, from ``params`` (default
    :func:`initial_params` of the config). Stage 1 is DDP + ``ZeroRedundancyOptimizer``, stage 2
    ``ZeRO2`` on the DDP, stage 3 ``ZeRO3`` (in place of the DDP) + ``ZeRO3Optimizer``; all wrap
    ``torch.optim.Adam`` / ``AdamW``. A checkpoint's optimizer state goes in between this and
    :func:`train_torch_steps`."""
    params = initial_params(config) if params is None else params
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    kwargs = dict(lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
    if config.stage == 3:
        model = ZeRO3(torch_module(config, params), bucket_cap_mb=_cap_mb(config))
        return model, ZeRO3Optimizer(model, cls, **kwargs)
    ddp = torch_ddp(config, params)
    if config.stage == 1:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), cls, **kwargs)
    else:
        opt = ZeRO2(ddp, cls, **kwargs)
    return ddp, opt


def torch_ddp(config: TrainConfig, params: dict[str, np.ndarray]) -> DistributedDataParallel:
    """hybrid's DDP of the config's model holding ``params``, at the config's bucket caps (torch's
    defaults for ``bucket_cap_bytes=None``), in the current process group."""
    return DistributedDataParallel(torch_module(config, params), bucket_cap_mb=_cap_mb(config))


def _cap_mb(config: TrainConfig) -> float | None:
    """The config's cap as torch's ``bucket_cap_mb`` (``None``: the wrapper's default)."""
    return None if config.bucket_cap_bytes is None else config.bucket_cap_bytes / (1 << 20)


def train_torch_steps(ddp, opt, config: TrainConfig, start_step: int, stop_step: int, *,
                      progress: Progress | None = None) -> np.ndarray:
    """Steps ``[start_step, stop_step)``; returns their global losses (float64 of float32 values)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start_step, stop_step):
        x, y = rank_rows(batch(config, step), rank, world)
        opt.zero_grad()
        loss = _loss(config, ddp, x, y)
        loss.backward()
        if config.clip_norm is not None and config.stage >= 2:
            opt.clip_grad_norm_(config.clip_norm)  # ZeRO2/3 hold gradient slices: one all-reduce of norms
        elif config.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.clip_norm)
        opt.step()
        # The global loss is the mean of the per-rank means, what DDP's averaged gradient descends.
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if progress is not None and rank == 0:
            progress(step, losses[-1])
    return np.asarray(losses)


def train_torch(config: TrainConfig, *, params: dict[str, np.ndarray] | None = None, start_step: int = 0,
                progress: Progress | None = None, resume: str | None = None, save_to: str | None = None,
                save_at: int | None = None, checkpoint_dir: str | None = None,
                save_every: int | None = None) -> TrainResult:
    """Train ``config`` from ``start_step`` to ``config.num_steps`` in the current process group
    (``torch.distributed`` initialised, one call per rank); every rank returns the same result.

    ``resume`` loads a checkpoint (:mod:`hybrid.checkpoint.torch`, saved by either frontend at
    any world size) and starts from its step; ``save_to`` saves one after step ``save_at``
    (default the last) and training goes on. ``save_every`` saves every that many steps into
    ``checkpoint_dir/step-NNNNNN``; given a ``checkpoint_dir`` and no ``resume``, the run resumes
    from the newest checkpoint there, so a relaunched job continues where it crashed
    (:class:`~hybrid.demo._checkpointing.Checkpointing`).

    >>> import torch.distributed as dist
    >>> from hybrid.demo import TrainConfig
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> r = train_torch(TrainConfig(num_steps=20))
    >>> len(r.losses), bool(r.losses[-1] < r.losses[0])
    (20, True)
    >>> dist.destroy_process_group()
    """
    from hybrid.checkpoint import torch as checkpoint

    saves = Checkpointing(resume, save_to, save_at, checkpoint_dir, save_every)
    ddp, opt = build_torch(config, params)
    resume = saves.resume_path()
    if resume is not None:
        start_step = checkpoint.load(resume, ddp, opt)
    t0 = time.perf_counter()
    losses = []
    for lo, hi, where in saves.segments(start_step, config.num_steps):
        losses.append(train_torch_steps(ddp, opt, config, lo, hi, progress=progress))
        if where is not None:
            checkpoint.save(where, ddp, opt, step=hi, metadata={"config": config.to_json()})
    seconds = time.perf_counter() - t0
    # ZeRO3's parameters are whole only inside gathered(); cloned, as a numpy view of them would
    # keep the whole gathered bucket alive after the block.
    with ddp.gathered() if config.stage == 3 else contextlib.nullcontext():
        final = {n: p.detach().clone().numpy() for n, p in ddp.module.named_parameters()}
    return TrainResult(np.concatenate(losses), final, ddp.bucket_plan.fingerprint(), seconds, start_step,
                       ddp.bucket_plan)


# ---- runs in a gloo world on this machine (the world itself: hybrid.demo._world) -------------------


def train_torch_runs(configs, *, progress=None) -> list[TrainResult]:
    """:func:`train_torch` of each config in turn, in the current process group (one world for
    several runs: starting processes and importing torch costs more than a small run).
    ``progress(run_index, step, loss)`` as each step ends on rank 0."""
    out = []
    for i, config in enumerate(configs):
        cb = None if progress is None else (lambda step, loss, i=i: progress(i, step, loss))
        out.append(train_torch(config, progress=cb))
    return out


def launch_torch(config: TrainConfig, *, world_size: int = 2, params: dict[str, np.ndarray] | None = None,
                 start_step: int = 0, progress: Progress | None = None, timeout_s: float = 600,
                 resume: str | None = None, save_to: str | None = None, save_at: int | None = None) -> TrainResult:
    """:func:`train_torch` on a spawned gloo world of ``world_size`` ranks (:func:`spawn_world`);
    rank 0's result. ``progress(step, loss)`` runs here as rank 0 reports each step.

    >>> from hybrid.demo import TrainConfig
    >>> launch_torch(TrainConfig(num_steps=3, stage=2), world_size=1).losses.shape
    (3,)
    """
    return spawn_world(train_torch, config, world_size=world_size, progress=progress, timeout_s=timeout_s,
                       params=params, start_step=start_step, resume=resume, save_to=save_to, save_at=save_at)
