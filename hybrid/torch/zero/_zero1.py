"""ZeroRedundancyOptimizer: a drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``.

A thin shell. Who owns which parameter is decided once by :func:`hybrid.core.partition_params`
(torch's sorted-greedy partition), and the flat broadcast buckets of
``parameters_as_bucket_view=True`` are laid out by :func:`hybrid.core.plan_buckets`; this module
only executes those plans with ``torch.distributed`` and keeps torch's optimizer protocol
(``step``, ``zero_grad``, ``state_dict``, schedulers, ``Join``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim.utils import functional_optim_map
from torch.optim import Optimizer

from hybrid.core import ParamPartition, partition_params, plan_buckets
from hybrid.torch._flat import params_into_flat
from hybrid.torch.zero._zero1_state import ConsolidatedState
from hybrid.torch._collectives import collective_failed, peer_gone, wait_all
from hybrid.torch.zero._parts import _check_params, _check_same_dense_type, _spec, _sync_param_groups

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

# One flat bucket per (dtype, device) per rank: the per-rank broadcast is one message per bucket.
_ONE_BUCKET_PER_KEY = (sys.maxsize,)

# Who runs the cross-rank check (ZeroRedundancyOptimizer._check_ranks_agree).
_INIT, _ADD, _STEP = 0, 1, 2
_PHASE_NAMES = ("__init__", "add_param_group", "step")


class _ZeroJoinHook(JoinHook):
    """Shadows a joined rank's ``step()``: it still updates and broadcasts its own shard."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        super().__init__()
        self.zero = zero

    def main_hook(self) -> None:
        if self.zero._overlap_with_ddp:
            # The step runs in the DDP comm hook, which DDP's join hook already ran on zero
            # buckets: this rank has stepped and sent its share.
            return
        self.zero.step()


class ZeroRedundancyOptimizer(ConsolidatedState, Optimizer, Joinable):
    """Shard any ``torch.optim`` optimizer's state over the ranks of a process group (ZeRO-1).

    Same constructor, methods and state-dict format as
    ``torch.distributed.optim.ZeroRedundancyOptimizer``: each rank's local optimizer holds state
    only for the parameters :func:`hybrid.core.partition_params` gives it; after the local step
    every rank broadcasts its updated parameters (one flat bucket per rank and (dtype, device)
    when ``parameters_as_bucket_view=True``). Beyond torch, the shares are broadcast lightest
    first (``partition.broadcast_order()``) and a rank posts its receives for the shares ahead of
    its own before stepping, so those broadcasts overlap its optimizer step (not when ``step`` is
    given a closure; the local optimizer's ``step`` must not itself use the process group).

    Args:
      params: tensors or parameter-group dicts, all of one dense type.
      optimizer_class: a ``torch.optim.Optimizer`` subclass, built on this rank's share.
      process_group: the group to shard over (default: the world).
      parameters_as_bucket_view: make ``param.data`` views into flat per-rank buckets, so that
        each rank's share is broadcast in one message.
      overlap_with_ddp: the step runs inside DDP's backward through
        :func:`hybrid.torch.hook_with_zero_step` (or ``_interleaved``); ``step()`` does nothing.
      check_ranks_each_step: (keyword) run the cross-rank check of the parameter groups (one tiny
        all-reduce, read on the host) in every ``step()`` too, not only in the constructor and
        ``add_param_group`` (torch's class checks nowhere). Default ``None``: where the
        parameters live on the CPU, where it costs no device sync. On a GPU, reading the result
        waits for the backward's last all-reduce and exposes the host's launches that follow
        (GPT-2 small on an H200: 3% of the float32 step, 16% of the bf16 one), so it is off
        there unless asked for; without it, ``add_param_group`` called on some ranks only
        hangs the others' next broadcast until the group's timeout, as torch's class does.
      **defaults: forwarded to ``optimizer_class``.

    >>> import torch, torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    >>> model(torch.ones(1, 4)).sum().backward()
    >>> opt.step()
    >>> opt.consolidate_state_dict(to=0)
    >>> sorted(opt.state_dict())
    ['param_groups', 'state']
    >>> dist.destroy_process_group()
    """

    def __init__(self, params: Iterable, optimizer_class: type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any):
        # Ours alone, so read from **defaults: the signature stays torch's, argument for argument.
        check_ranks_each_step = defaults.pop("check_ranks_each_step", None)
        params, all_params = _check_params(params)
        _check_same_dense_type(all_params)
        # overlap_with_ddp: the step runs inside DDP's backward (hybrid.torch.hook_with_zero_step).
        self._overlap_with_ddp = bool(overlap_with_ddp)
        if optimizer_class in functional_optim_map.values():
            raise ValueError(f"Passing in a functional optimizer {optimizer_class} "
                             "when `overlap_with_ddp=False`")

        # Optimizer.__init__ calls our add_param_group; until we are built it must only append.
        self._initialized = False
        self._partition_cache: ParamPartition | None = None
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)

        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        self.global_rank: int = dist.get_global_rank(self.process_group, self.rank)
        self._default_device = all_params[0].device
        self._check_each_step = (self._default_device.type == "cpu" if check_ranks_each_step is None
                                 else bool(check_ranks_each_step))
        self._check_ranks_agree()
        # Passing groups (not a flat list) lets a rank own nothing without tripping torch's
        # empty-parameter-list check, exactly as torch's ZeroRedundancyOptimizer does.
        self.optim: Optimizer = optimizer_class(self._rank_param_groups(self.rank), **defaults)
        _sync_param_groups(self.optim.param_groups, self.param_groups)

        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._buckets: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        self._is_trainable_mask = self._trainable_mask()
        self._build_param_buckets()
        self._all_state_dicts: list[dict[str, Any]] = []
        self._initialized = True

    # -- ownership (decided by the core, never here) -------------------------------------------

    @property
    def _params(self) -> list[torch.Tensor]:
        """Every parameter in global state-dict order (group by group)."""
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def partition(self) -> ParamPartition:
        """The core's ownership plan over the current parameter groups (indices are global)."""
        if self._partition_cache is None:
            params = self._params
            groups, start = [], 0
            for g in self.param_groups:
                groups.append(range(start, start + len(g["params"])))
                start += len(g["params"])
            # Ownership does not depend on devices; leaving them out keeps the fingerprint equal
            # on ranks whose parameters sit on their own GPU ("cuda:0", "cuda:1", ...).
            specs = [_spec(i, p, with_device=False) for i, p in enumerate(params)]
            self._partition_cache = partition_params(specs, dist.get_world_size(self.process_group),
                                                     groups=groups)
        return self._partition_cache

    # torch's attributes, with torch's meaning (its tests and Join hooks reach for them).
    @property
    def _all_params(self) -> list[torch.Tensor]:
        return self._params

    def _partition_parameters(self, params_per_rank: Any = None) -> list[list[dict[str, Any]]]:
        """Every rank's parameter groups, each with only that rank's parameters (torch's order)."""
        if params_per_rank is not None:
            raise NotImplementedError("hybrid's ZeroRedundancyOptimizer plans its partition in "
                                      "hybrid.core; a manual params_per_rank is not supported")
        return [self._rank_param_groups(r) for r in range(self.world_size)]

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        params = self._params
        return {params[i]: r for r in range(self.world_size) for i in self.partition.owned(r)}

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(self._params)}

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        return self._params

    _fingerprint_cache: tuple = (None, 0)

    def _check_ranks_agree(self, phase: int = 0) -> None:
        """Raise on every rank unless all ranks are in the same call and planned the same partition.

        Ranks with different parameters would otherwise pair mismatched broadcasts: a hang or
        silently corrupted parameters (``ValueError``). One all-reduce (a sum) of a table with
        one row per rank, ``(partition fingerprint, number of groups, phase)``, tells every rank
        all rows at once. ``phase`` says who asks (constructor, ``add_param_group``, ``step``):
        ``step`` runs the same check, so a rank whose ``add_param_group`` was called alone meets
        the others' step here, and both raise ``RuntimeError`` naming the ranks that disagree.
        """
        if self._fingerprint_cache[0] is not self.partition:
            # 63 bits: a sum of one value and zeros stays inside an int64
            self._fingerprint_cache = (self.partition, int(self.partition.fingerprint(), 16) >> 1)
        mine = self._fingerprint_cache[1]
        table = torch.zeros(self.world_size, 3, dtype=torch.int64, device=self._default_device)
        table[self.rank] = torch.tensor([mine, len(self.param_groups), phase], dtype=torch.int64)
        try:
            dist.all_reduce(table, group=self.process_group)
        except RuntimeError as e:
            # What happened comes first: a peer that went away is named as such. Only a wait that
            # ran out can be add_param_group called on one rank (the others never join its check;
            # called in step instead, the two checks pair and the phases below tell).
            if phase == _ADD and not peer_gone(e):
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer.add_param_group: the other ranks did not join its "
                    f"cross-rank check within the process group's timeout (called on rank {self.rank} "
                    f"only? it must be called on every rank, in the same order); the group was not "
                    f"added: {e}") from e
            what = {_ADD: "ZeroRedundancyOptimizer.add_param_group (the group was not added): its cross-rank check",
                    _STEP: "ZeroRedundancyOptimizer.step: the cross-rank check of the parameter groups"}.get(
                phase, "ZeroRedundancyOptimizer: the cross-rank check of the partition")
            failed = collective_failed(what, e)
            if phase == _STEP:  # a peer that left on an error of its own: that error says which
                failed = RuntimeError(f"{failed}. Nothing was stepped. If that peer raised rather than crashed, "
                                      f"its error names the cause (add_param_group called on it alone fails there)")
            raise failed from e
        rows = table.tolist()
        if len({row[2] for row in rows}) > 1:
            calls = {}
            for r, (_, num_groups, p) in enumerate(rows):
                calls.setdefault((p, num_groups), []).append(r)
            seen = "; ".join(f"ranks {ranks} in {_PHASE_NAMES[p]} with {n} parameter group(s)"
                             for (p, n), ranks in sorted(calls.items()))
            adders = [r for r, row in enumerate(rows) if row[2] == _ADD]
            undone = " (the group was not added)" if phase == _ADD else " (nothing was stepped)" if phase == _STEP else ""
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.{_PHASE_NAMES[phase]}: the ranks are out of step: {seen}. "
                f"add_param_group must be called on every rank, in the same order (called on "
                f"ranks {adders} only?){undone}")
        if len({row[0] for row in rows}) > 1:
            differ = [r for r, row in enumerate(rows) if row[0] != mine]
            raise ValueError(
                f"ZeroRedundancyOptimizer: rank {self.rank} planned partition "
                f"{self.partition.fingerprint()} over {len(self._params)} parameters, but ranks "
                f"{differ} of the process group planned a different one; pass the same parameters "
                "(shapes, dtypes, groups, order) on every rank")

    def _rank_param_groups(self, rank: int) -> list[dict[str, Any]]:
        """Rank ``rank``'s share as parameter groups: every group, each with only owned params."""
        params = self._params
        return [dict(group, params=[params[i] for i in owned])
                for group, owned in zip(self.param_groups, self.partition.per_rank[rank])]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group on every rank (call it on all ranks, in the same order)."""
        super().add_param_group(param_group)
        if not self._initialized:
            return
        before = self._partition_cache
        self._partition_cache = None
        try:
            after = self.partition
            self._check_ranks_agree(_ADD)
        except BaseException:
            # Nothing half-added: the group leaves this optimizer as it came.
            self.param_groups.pop()
            self._partition_cache = before
            raise
        # Loads carry over group to group, so earlier groups keep their owners and the local
        # optimizer's existing state stays valid.
        assert before is None or after.per_rank[self.rank][:-1] == before.per_rank[self.rank]
        self.optim.add_param_group(self._rank_param_groups(self.rank)[-1])
        self._is_trainable_mask = self._trainable_mask()
        self._build_param_buckets()

    # -- step -----------------------------------------------------------------------------------

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._params]

    _broadcast_order: tuple = (None, ())
    # overlap_with_ddp: state loaded before the hook assigned its buckets, {global index: state}
    _overlap_pending_state: dict = {}

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step the local optimizer on this rank's share, then broadcast every rank's share.

        Extra keyword arguments go to the local optimizer's ``step``.
        """
        if self._overlap_with_ddp:
            logger.warning("`step()` should not be included in the training loop when `overlap_with_ddp=True`")
            return None
        Join.notify_join_context(self)
        # One small all-reduce: a rank whose add_param_group was called alone, or that is out of
        # step otherwise, makes every rank raise here instead of pairing mismatched broadcasts.
        if self._check_each_step:
            self._check_ranks_agree(_STEP)
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            logger.warning("ZeroRedundancyOptimizer detected that the trainable parameters "
                           "changed; rebuilding the parameter buckets if enabled")
            self._is_trainable_mask = mask
            self._build_param_buckets()
        # Schedulers and users edit self.param_groups; the local optimizer must see it.
        _sync_param_groups(self.param_groups, self.optim.param_groups)
        if self._broadcast_order[0] is not self.partition:  # recomputed when add_param_group repartitions
            self._broadcast_order = (self.partition, self.partition.broadcast_order())
        order = self._broadcast_order[1]
        # Receives for the shares ahead of ours go out before our step, so the lighter ranks'
        # broadcasts overlap our optimizer work. Not with a closure: it may run DDP's backward,
        # whose all-reduces must not queue behind a broadcast that its sender issues after them.
        ahead = order[:order.index(self.rank)] if closure is None else ()
        handles = self._broadcast_shares(ahead)
        try:
            loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        except BaseException:
            # The receives for the shares ahead are posted on this rank: every rank still issues
            # every broadcast, so the next collective pairs up (else the next step deadlocks).
            # Owners whose step failed before updating send their parameters unchanged.
            self._finish_broadcasts(handles, order[len(ahead):])
            raise
        _sync_param_groups(self.optim.param_groups, self.param_groups)
        self._finish_broadcasts(handles, order[len(ahead):])
        return loss

    def _finish_broadcasts(self, handles: list, ranks) -> None:
        handles += self._broadcast_shares(ranks)
        wait_all(handles)

    def _broadcast_shares(self, ranks) -> list:
        """Start the broadcasts of these ranks' shares (each from its owner): one per bucket with
        bucket views, else one per parameter. Every rank starts them in the same order.
        Returns ``(what, work)`` pairs for ``wait_all``."""
        params = self._params
        handles = []
        for rank in ranks:
            src = dist.get_global_rank(self.process_group, rank)
            if self.parameters_as_bucket_view:
                tensors = self._buckets[rank]
            else:
                tensors = [params[i].data for i in self.partition.owned(rank)]
            what = f"ZeroRedundancyOptimizer.step: the broadcast of rank {rank}'s parameters"
            handles.extend((what, dist.broadcast(t, src=src, group=self.process_group, async_op=True))
                           for t in tensors)
        return handles

    def _build_param_buckets(self) -> None:
        """Point every trainable parameter's ``.data`` into its owner's flat bucket.

        The layout is a core BucketPlan over the owner's trainable parameters (in ownership
        order), one bucket per (dtype, device). Frozen parameters get their own storage back and
        are not broadcast, as in torch.
        """
        if not self.parameters_as_bucket_view:
            return
        params = self._params
        for rank in range(self.world_size):
            owned = self.partition.owned(rank)
            for i in owned:
                if not params[i].requires_grad:
                    # Detach from an old bucket so that rebuilding cannot overwrite it.
                    params[i].data = params[i].data.detach().clone()
            trainable = [i for i in owned if params[i].requires_grad]
            self._buckets[rank] = []
            if not trainable:
                continue  # every rank knows this share is empty, so nobody broadcasts it
            plan = plan_buckets([_spec(i, params[i]) for i in trainable], size_limits=_ONE_BUCKET_PER_KEY)
            share = [params[i] for i in trainable]
            self._buckets[rank] = [params_into_flat(share, bucket) for bucket in plan.buckets]

    # -- Join -----------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets a rank that ran out of inputs keep stepping with the others."""
        del kwargs  # no options
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group
