"""What the parity tests need from the torch frontend, run on every rank of one spawned gloo world.

``torch_side`` trains every configuration, then records, for arrays the JAX side can be fed
exactly, what the torch frontend packs into its buckets and what each ZeRO2 rank keeps, and which
parameters torch's own DistributedDataParallel holds in each bucket after its rebuild (the oracle
of the plan). Rank 0 returns everything (other ranks' records are gathered to it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from hybrid.demo import (TrainConfig, build_torch, global_batch, init_params, rank_rows, torch_model,
                         train_torch_runs)
from hybrid.demo._torch_run import torch_ddp
from hybrid.parity._run_torch import torch_ddp_buckets as rebuilt_buckets


def _rows(config: TrainConfig, step: int):
    x, y = rank_rows(global_batch(config.seed, step, config.sizes, config.global_batch_size),
                     dist.get_rank(), dist.get_world_size())
    return torch.from_numpy(x), torch.from_numpy(y)


def _local_grads(params: dict[str, np.ndarray], x, y) -> dict[str, np.ndarray]:
    """This rank's own gradient (before any reduction): the module DDP wraps, run alone. The same
    ops in the same order as under DDP, one thread: the same bits as the gradients DDP packs."""
    model = torch_model(params)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _params(module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def _gathered(record: dict) -> list[dict]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    return everyone


def packed_buckets(config: TrainConfig) -> list[list[dict]]:
    """Per iteration (0: DDP's initial one-bucket plan, 1: the plan rebuilt from the ready order),
    per rank: the plan, each bucket's buffer as DDP filled it, and the local gradients it held.

    A comm hook sees the buffer DDP packed; with a hook registered DDP leaves the scaling to the
    hook, so the buffer holds the local gradients exactly (torch's allreduce_hook then divides).
    """
    params = init_params(config.seed, config.sizes)
    ddp = torch_ddp(config, params)
    captured = {}

    def hook(state, bucket):
        captured[bucket.index()] = bucket.buffer().numpy().copy()
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    out = []
    for step in range(2):
        captured.clear()
        x, y = _rows(config, step)
        F.cross_entropy(ddp(x), y).backward()
        ddp.module.zero_grad(set_to_none=True)  # no optimizer: params stay those of `params`
        record = dict(plan=ddp.bucket_plan.dumps(), buffers=[captured[b] for b in range(len(captured))],
                      grads=_local_grads(params, x, y))
        out.append(_gathered(record))
    return out


def zero2_shards(config: TrainConfig) -> list[dict]:
    """Per rank, after a first step (so DDP has rebuilt its buckets): the gradient slices ZeRO2
    keeps after the second backward, the parameter slices it owns after the second step, and
    the arrays that produced them (the local gradients, the full parameters after the step)."""
    ddp, opt = build_torch(config)
    x, y = _rows(config, 0)
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()
    before = _params(ddp.module)
    x, y = _rows(config, 1)
    F.cross_entropy(ddp(x), y).backward()
    # ZeRO2's slices are private; reading them is the point of this test.
    grad_slices = [g.numpy().copy() for g in opt._grads]
    opt.step()
    param_slices = [opt._my_slice(b).detach().numpy().copy() for b in range(ddp.bucket_plan.num_buckets)]
    record = dict(plan=ddp.bucket_plan.dumps(), grad_slices=grad_slices, param_slices=param_slices,
                  grads=_local_grads(before, x, y), params_after=_params(ddp.module))
    return _gathered(record)


def torch_ddp_buckets(config: TrainConfig) -> list[list[str]]:
    """The parameter names of each bucket of torch's own DistributedDataParallel after its
    rebuild, in bucket order (as a comm hook sees them in the second iteration)."""
    cap_mb = None if config.bucket_cap_bytes is None else config.bucket_cap_bytes / (1 << 20)

    def backward(ddp, step):
        x, y = _rows(config, step)
        F.cross_entropy(ddp(x), y).backward()
    return rebuilt_buckets(torch_model(init_params(config.seed, config.sizes)), backward, bucket_cap_mb=cap_mb)


def torch_side(configs, pack_configs, shard_config, *, progress=None) -> dict:
    del progress
    return dict(results=train_torch_runs(configs),
                packed=[packed_buckets(c) for c in pack_configs],
                torch_ddp=[torch_ddp_buckets(c) for c in pack_configs],
                shards=zero2_shards(shard_config))
