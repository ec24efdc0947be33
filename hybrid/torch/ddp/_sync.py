"""What hybrid's DDP agrees on across ranks: :class:`RankAgreement`, the process group as one DDP
sees it (group, size, this rank, the device its collectives run on) and every collective by which
the ranks agree: the model and its layout settings at construction, rank 0's gradient-ready order
and the rebuilt plan's fingerprint, tensors broadcast from one rank, and Join's flags.

Every method is a collective: all ranks of the group call it in the same order. It holds no
per-iteration state; the DDP and its reducer call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybrid.core import BucketPlan
from hybrid.torch._collectives import naming

_MB = 1024 * 1024
BROADCAST_BUCKET_BYTES = 250 * _MB  # torch DDP's broadcast_bucket_size


def is_default_group(group) -> bool:
    """Whether ``group`` is the default process group (False once there is none)."""
    try:
        return group is dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):  # no default group any more
        return False


class RankAgreement:
    """The ranks of ``group`` agreeing, for one DDP whose collectives run on ``device``.

    Attributes: ``group``, ``device``, ``world`` (the group's size), ``rank`` (this process's
    rank in it). Not pickled with the DDP: a copy makes its own against the default group.
    """

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def verify_same_model(self, names: Sequence[str], params: Sequence[torch.Tensor], settings: dict) -> None:
        """Every rank has the same parameter shapes and dtypes, and the same layout ``settings``
        (torch's _verify_param_shape_across_processes, plus hybrid's settings check)."""
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)]
        if self.world == 1:
            return
        everyone = [None] * self.world
        with naming("DistributedDataParallel(): the all-gather of every rank's parameter shapes"):
            dist.all_gather_object(everyone, (mine, settings), group=self.group)
        (ref, ref_settings) = everyone[0]
        for r, (theirs, their_settings) in enumerate(everyone):
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
            for key, value in their_settings.items():
                if value != ref_settings[key]:
                    unit = " (MB)" if key.startswith("bucket_cap") else ""
                    raise ValueError(
                        f"DistributedDataParallel: ranks disagree on {key}{unit}: rank 0 has "
                        f"{ref_settings[key]!r}, rank {r} has {value!r}; the bucket layout depends on it, "
                        "so pass the same value on every rank.")

    def rank0_order(self, ready_order: Sequence[int]) -> list[int]:
        """Rank 0's gradient-ready order, which every rank rebuilds its buckets from."""
        order = torch.tensor(list(ready_order), dtype=torch.int64)
        if self.world > 1:
            n = torch.tensor([order.numel()], dtype=torch.int64)
            with naming("DistributedDataParallel: the broadcast of rank 0's gradient-ready order"):
                dist.broadcast(n, 0, group=self.group)
                if order.numel() != n.item():
                    order = torch.zeros(int(n.item()), dtype=torch.int64)
                dist.broadcast(order, 0, group=self.group)
        return order.tolist()

    def check_same_plan(self, plan: BucketPlan, settings: dict) -> None:
        """Every rank rebuilt the same plan (fingerprints compared); a clear error naming the
        layout ``settings`` of this rank where they differ."""
        if self.world == 1:
            return
        fp = torch.tensor([int(plan.fingerprint(), 16) >> 1], dtype=torch.int64)
        fps = [torch.zeros_like(fp) for _ in range(self.world)]
        with naming("DistributedDataParallel: the all-gather of the rebuilt plans' fingerprints"):
            dist.all_gather(fps, fp, group=self.group)
        if len({int(f) for f in fps}) != 1:
            raise RuntimeError(
                f"ranks disagree on the rebuilt bucket plan (fingerprints by rank: {[int(f) for f in fps]}); "
                f"this rank has {settings}: pass the same bucket_cap_mb, bucket_cap_mb_list, "
                "find_unused_parameters and static_graph on every rank")

    def broadcast(self, tensors: list[torch.Tensor], src: int, what: str) -> None:
        """``tensors`` from rank ``src`` to every rank, in place, coalesced (torch's
        ``_broadcast_coalesced`` with DDP's 250 MB buckets); ``what`` names it in errors."""
        with naming(what):
            dist._broadcast_coalesced(self.group, tensors, BROADCAST_BUCKET_BYTES, src)

    def find_common_rank(self, rank_cond: bool) -> int:
        """The highest rank for which ``rank_cond`` holds (-1 if none): under Join, the rank
        whose buffers and model the others take."""
        rank = torch.tensor([self.rank if rank_cond else -1], device=self.device)
        with naming("DistributedDataParallel forward (Join): the all-reduce that picks the rank broadcasting buffers"):
            dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.group)
        return int(rank.item())

    def backward_sync_flag(self, requires_sync: bool, *, joined: bool) -> bool | None:
        """Inside a Join context every rank takes part in this all-reduce, so joined ranks learn
        whether the ranks still stepping will run a synchronized backward (torch's protocol):
        a joined rank gets the answer, a stepping rank (whose flag is ``requires_sync``) None."""
        flag = torch.ones(1, device=self.device) if (not joined and requires_sync) \
            else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.group, async_op=True)
        if joined:
            with naming("DistributedDataParallel (Join): the all-reduce of the backward-sync flag"):
                work.wait()
            return flag.item() != 0
        return None
