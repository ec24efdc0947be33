"""What hybrid's DDP agrees on across ranks: the model and its layout settings at construction,
the rebuilt bucket plan, parameters and buffers broadcast from one rank, and Join's flags.

Every method here is a collective: all ranks of ``self.process_group`` call it in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.core import rebuild_plan
from hybrid.torch._collectives import naming
from hybrid.torch.ddp._auto import plan_auto

_MB = 1024 * 1024
_BROADCAST_BUCKET_BYTES = 250 * _MB  # torch DDP's broadcast_bucket_size


class RankAgreement:
    """Mixed into :class:`hybrid.torch.DistributedDataParallel`, which owns the attributes used."""

    def _verify_same_model(self) -> None:
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]
        if self._world == 1:
            return
        everyone = [None] * self._world
        with naming("DistributedDataParallel(): the all-gather of every rank's parameter shapes"):
            dist.all_gather_object(everyone, (mine, self._layout_settings), group=self.process_group)
        (ref, ref_settings) = everyone[0]
        for r, (theirs, settings) in enumerate(everyone):
            if len(theirs) != len(ref):
                raise RuntimeError(
                    f"DDP expects same model across all ranks, but rank 0 has {len(ref)} params, "
                    f"while rank {r} has inconsistent {len(theirs)} params.")
            for i, (a, b) in enumerate(zip(ref, theirs)):
                if a[1:] != b[1:]:
                    raise RuntimeError(
                        f"DDP expects same model across all ranks, but rank {r}'s params[{i}] ({b[0]!r}) "
                        f"has sizes {list(b[1])} and dtype {b[2]}, while rank 0's ({a[0]!r}) has "
                        f"sizes {list(a[1])} and dtype {a[2]}.")
            for key, value in settings.items():
                if value != ref_settings[key]:
                    unit = " (MB)" if key.startswith("bucket_cap") else ""
                    raise ValueError(
                        f"DistributedDataParallel: ranks disagree on {key}{unit}: rank 0 has "
                        f"{ref_settings[key]!r}, rank {r} has {value!r}; the bucket layout depends on it, "
                        "so pass the same value on every rank.")

    def _rebuild(self, ready_order) -> None:
        """Rebuild the plan once from the first iteration's ready order; rank 0's order wins.
        With ``bucket_cap_mb="auto"`` the plan is :func:`hybrid.torch.ddp._auto.plan_auto`'s."""
        order = torch.tensor(list(ready_order), dtype=torch.int64)
        if self._world > 1:
            n = torch.tensor([order.numel()], dtype=torch.int64)
            with naming("DistributedDataParallel: the broadcast of rank 0's gradient-ready order"):
                dist.broadcast(n, 0, group=self.process_group)
                if order.numel() != n.item():
                    order = torch.zeros(int(n.item()), dtype=torch.int64)
                dist.broadcast(order, 0, group=self.process_group)
        if self._auto_caps:
            plan = plan_auto(self, order.tolist())
            self._ready_clock = None  # the times are in; the hooks stop reading the clock
        else:
            plan = rebuild_plan(self.bucket_plan, order.tolist(), size_limits=self._rebuild_limits)
        if self._world > 1:
            fp = torch.tensor([int(plan.fingerprint(), 16) >> 1], dtype=torch.int64)
            fps = [torch.zeros_like(fp) for _ in range(self._world)]
            with naming("DistributedDataParallel: the all-gather of the rebuilt plans' fingerprints"):
                dist.all_gather(fps, fp, group=self.process_group)
            if len({int(f) for f in fps}) != 1:
                raise RuntimeError(
                    f"ranks disagree on the rebuilt bucket plan (fingerprints by rank: {[int(f) for f in fps]}); "
                    f"this rank has {self._layout_settings}: pass the same bucket_cap_mb, bucket_cap_mb_list, "
                    "find_unused_parameters and static_graph on every rank")
        self._set_plan(plan)
        self._has_rebuilt = True

    def _restore_rebuilt_plan(self, plan) -> None:
        """Take ``plan``, a rebuilt plan a checkpoint recorded, as this DDP's rebuilt plan: no
        rebuild follows, so the first step reduces in the saving run's buckets
        (``hybrid.checkpoint.torch.load(..., restore_buckets=True)``; every rank reads the same
        manifest, so the ranks agree without a collective)."""
        self._set_plan(plan)
        self._has_rebuilt = True

    def _sync_module_states(self, src: int) -> None:
        """torch's _sync_module_states: parameters (and buffers) from ``src`` to every rank."""
        if self._world == 1:
            return
        tensors = [p.detach() for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        if self._init_sync_buffers:
            tensors += [b.detach() for b in self._buffers_to_sync]
        if tensors:
            with naming(f"DistributedDataParallel: the broadcast of rank {src}'s parameters and buffers"):
                dist._broadcast_coalesced(self.process_group, tensors, _BROADCAST_BUCKET_BYTES, src)

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        rank = torch.tensor([input_rank if rank_cond else -1], device=self.device)
        with naming("DistributedDataParallel forward (Join): the all-reduce that picks the rank broadcasting buffers"):
            dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        # Inside a Join context every rank takes part in this all-reduce, so joined ranks learn
        # whether the ranks still stepping will run a synchronized backward (torch's protocol).
        flag = torch.ones(1, device=self.device) if (not is_joined_rank and self.require_backward_grad_sync) \
            else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if is_joined_rank:
            with naming("DistributedDataParallel (Join): the all-reduce of the backward-sync flag"):
                work.wait()
            return flag.item() != 0
        return None

    def _sync_buffers(self, rank_cond: bool = True):
        # Under Join, rank 0 may have joined with stale buffers: the highest active rank broadcasts.
        src = self._find_common_rank(self._rank, rank_cond) if self._join_config.enable else 0
        if self._world > 1:
            with torch.no_grad(), naming(f"DistributedDataParallel forward: the broadcast of rank {src}'s buffers"):
                dist._broadcast_coalesced(self.process_group, [b.detach() for b in self._buffers_to_sync],
                                          _BROADCAST_BUCKET_BYTES, src)
