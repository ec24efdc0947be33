"""The torch side of a parity run: hybrid's DistributedDataParallel (+ ZeRO), or ZeRO3, on spawned gloo ranks.

Every rank builds the user's module and loss from the factory, takes the run's initial weights,
wraps it in :class:`hybrid.torch.DistributedDataParallel` at torch's default bucket caps and
steps the optimizer (stage 0: the plain ``torch.optim`` class; 1: ``ZeroRedundancyOptimizer``;
2: ``ZeRO2``) on its rows of each global batch; stage 3 wraps it in :class:`hybrid.torch.ZeRO3`
(its default plan) with ``ZeRO3Optimizer``. Checkpoints go through :mod:`hybrid.checkpoint.torch`.
This module imports no JAX.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from hybrid.parity._report import SideRun
from hybrid.parity._spec import OptimizerSpec, check_torch_loss, pair_of, rank_rows, tree_map
from hybrid.torch import DistributedDataParallel, ZeRO2, ZeRO3, ZeRO3Optimizer, ZeroRedundancyOptimizer


def _wrapped(module: torch.nn.Module, stage: int):
    """The module as the stage trains it: ZeRO3 (its own plan) at stage 3, else DDP at torch's
    default caps (25 MiB, the first bucket 1 MiB)."""
    return ZeRO3(module) if stage == 3 else DistributedDataParallel(module)


def _optimizer(ddp, spec: OptimizerSpec, stage: int):
    cls, kwargs = spec.torch_class(), spec.torch_group()
    if stage == 3:
        return ZeRO3Optimizer(ddp, cls, **kwargs)
    if stage == 0:
        return cls(ddp.parameters(), **kwargs)
    if stage == 1:
        return ZeroRedundancyOptimizer(ddp.parameters(), cls, **kwargs)
    return ZeRO2(ddp, cls, **kwargs)


def _module(factory, init: dict[str, np.ndarray]):
    module, loss_fn = pair_of(factory, "torch")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"the torch factory must return (torch.nn.Module, loss_fn), got {type(module).__name__}")
    own = dict(module.named_parameters())
    if list(own) != list(init):
        raise ValueError(f"the torch factory built a module with other parameters on this rank: {list(own)[:6]}... "
                         f"instead of {list(init)[:6]}...")
    with torch.no_grad():
        for name, value in init.items():
            own[name].copy_(torch.from_numpy(np.array(value)))
    return module, loss_fn


def train_rank(job: dict, progress=None) -> SideRun:
    """One rank of the torch side (run by ``spawn_world`` in every process of the gloo world);
    every rank returns the same :class:`SideRun`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module, loss_fn = _module(job["factory"], job["init"])
    ddp = _wrapped(module, job["stage"])
    opt = _optimizer(ddp, job["optimizer"], job["stage"])
    start = 0
    if job["resume"] is not None:
        from hybrid.checkpoint import torch as checkpoint
        # the run's own hyperparameters: a JAX save records its optax settings only loosely
        start = checkpoint.load(job["resume"], ddp, opt, hyperparameters="optimizer")
    batches, losses = job["batches"], []
    t0 = time.perf_counter()
    for step in range(start, len(batches)):
        batch = tree_map(torch.from_numpy, rank_rows(batches[step], rank, world))
        opt.zero_grad(set_to_none=True)
        loss = check_torch_loss(loss_fn(ddp, batch))
        loss.backward()
        opt.step()
        # The global loss: the mean of the ranks' means, the loss whose gradient DDP's average is.
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if progress is not None:
            progress(step, losses[-1])
        if job["save_to"] is not None and step + 1 == job["save_at"]:
            from hybrid.checkpoint import torch as checkpoint
            checkpoint.save(job["save_to"], ddp, opt, step=step + 1)
    seconds = time.perf_counter() - t0
    if isinstance(ddp, ZeRO3):
        with ddp.gathered():  # the whole parameters, from every rank's slices
            # cloned before .numpy(): a numpy view pins the gathered bucket, which ZeRO3 frees after
            params = {n: p.detach().clone().numpy() for n, p in ddp.module.named_parameters()}
    else:
        # DDP rebuilds its buckets from the ready order at its second forward; a run of one step
        # reports the plan it would have rebuilt, the plan every later step runs.
        ddp._maybe_rebuild()
        params = {n: p.detach().numpy().copy() for n, p in ddp.module.named_parameters()}
    return SideRun(f"torch, {world} rank{'s' * (world > 1)}", start, tuple(losses), params,
                   ddp.bucket_plan.fingerprint(), seconds)


def train_torch_world(job: dict, *, world_size: int, timeout_s: float, progress=None, cancel=None) -> SideRun:
    """:func:`train_rank` on a spawned gloo world of ``world_size`` ranks; rank 0's result."""
    from hybrid.demo import spawn_world
    return spawn_world(train_rank, job, world_size=world_size, timeout_s=timeout_s, progress=progress, cancel=cancel)


def torch_ddp_buckets(module: torch.nn.Module, backward, *, bucket_cap_mb: float | None = None) -> list[list[str]]:
    """The parameter names of each bucket of torch's own ``DistributedDataParallel`` over ``module``
    after its rebuild, in bucket order, as a comm hook sees them in the second iteration (the
    first observes the gradient-ready order). ``backward(ddp, step)`` runs one step's forward and
    backward; the process group must be initialised. The oracle of the plans hybrid builds.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    caps = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = torch.nn.parallel.DistributedDataParallel(module, **caps)
    seen: dict[int, list[str]] = {}

    def record(state, bucket):
        seen[bucket.index()] = [names[id(p)] for p in bucket.parameters()]
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, record)
    for step in range(2):
        seen.clear()
        module.zero_grad(set_to_none=True)
        backward(ddp, step)
    return [seen[b] for b in sorted(seen)]
