"""The ZeRO optimizer step overlapped with DDP's backward: torch's ``ddp_zero_hook``, on gloo too.

``hook_with_zero_step`` and ``hook_with_zero_step_interleaved`` wrap a DDP comm hook (e.g.
``allreduce_hook``) so that each rank updates the parameters of the buckets
:func:`hybrid.core.assign_buckets` gives it, right after their reduction, and sends them to the
other ranks. Differences from torch:

* skipped iterations as torch's, by default: the first two backward passes (three with
  ``static_graph``) update nothing, so scripts that feed dummy batches there (torch's docs say
  to) end with the same parameters. ``update_from_first_iteration=True`` updates from the first
  backward on: the assignment is then computed from the DDP's current bucket plan, and when DDP
  rebuilds its buckets the optimizer state moves to the new owners once;
* a local step that raises (on any or every rank) still lets every broadcast go out, with the
  parameters of that rank unchanged, and reaches the caller from ``backward()``; the next
  iteration works;
* gloo works: the interleaved variant runs its steps on one helper thread, bucket by bucket in
  order, and broadcasts on a process group of its own, so every rank issues the same collectives
  in the same order (torch refuses gloo because its callbacks may not);
* the local optimizer is the ``torch.optim`` class the ZeroRedundancyOptimizer was built with,
  one instance per owned bucket slice (torch uses the functional optimizers).
"""

from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybrid.core import BucketAssignment, BucketPlan, assign_buckets
from hybrid.torch.ddp._ddp import DistributedDataParallel, GradBucket
from hybrid.torch._flat import params_into_flat
from hybrid.torch.zero._zero1 import ZeroRedundancyOptimizer
from hybrid.torch._collectives import wait_all
from hybrid.torch._teardown import collect_cycles_at_exit
from hybrid.torch.zero._parts import _refuse_sparse

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, GradBucket], torch.futures.Future]


class _Overlap:
    """Per-(DDP, ZeRO) runtime: the assignment for the current plan, local optimizers, broadcasts."""

    def __init__(self, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool,
                 *, own_group: bool, update_from_first_iteration: bool):
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"ddp must be a hybrid.torch.DistributedDataParallel, got {type(ddp).__name__}")
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"zero must be a hybrid.torch.ZeroRedundancyOptimizer, got {type(zero).__name__}")
        if not zero._overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer must be constructed with "
                             "`overlap_with_ddp=True` to use this hook properly")
        if len(zero.param_groups) != 1:
            raise ValueError("Overlapping DDP with ZeRO only supports a single parameter group, got "
                             f"{len(zero.param_groups)}")
        self.ddp, self.zero, self.shard_buckets = ddp, zero, bool(shard_buckets)
        collect_cycles_at_exit()  # the DDP holds the hook, the hook this: a cycle, as in torch's
        self.name = "hook_with_zero_step_interleaved" if own_group else "hook_with_zero_step"  # in errors
        _refuse_sparse(ddp, self.name)
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # The interleaved steps broadcast from a helper thread while the autograd thread issues
        # DDP's reductions: separate process groups keep each stream in one order on all ranks.
        self.bcast_group = self.group
        if own_group:
            ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
            self.bcast_group = dist.new_group(ranks=ranks, backend=dist.get_backend(self.group))
        self.optimizer_class = type(zero.optim)
        self.plan: BucketPlan | None = None
        self.assignment: BucketAssignment | None = None
        self.optims: dict[int, torch.optim.Optimizer] = {}  # bucket -> optimizer over my slice
        self.flats: list[torch.Tensor] = []  # per bucket: the parameters' storage (params are views)
        self.pending: list = []  # the broadcasts of this iteration
        # torch's hooks wait for DDP's bucket rebuild and one more iteration to collect bucket
        # information: iterations 1 and 2 (3 with static_graph) only reduce.
        self.skip = 0 if update_from_first_iteration else (3 if ddp.static_graph else 2)
        self.iterations = 0  # backward passes the hook has finished
        self.failure: BaseException | None = None  # a local step of this iteration raised
        zero._overlap_runtime = self  # where the optimizer state lives now (inspection, benchmarks)

    # -- assignment -----------------------------------------------------------------------------

    def ensure_plan(self) -> None:
        """Assign the DDP's current buckets; on a rebuild, hand each parameter's state over."""
        plan = self.ddp.bucket_plan
        if plan is self.plan:
            return
        if self.plan is not None:
            old = self._state_per_param()
        else:  # state loaded into the ZeroRedundancyOptimizer before the first backward
            zero_params = self.zero._params
            old = {self.ddp._index_of[id(zero_params[i])]: s for i, s in self.zero._overlap_pending_state.items()}
            self.zero._overlap_pending_state = {}
        # One rank owns everything anyway; the core's shard_buckets rule would cut a bucket into
        # two runs for a single rank (torch then overwrites the first run's assignment).
        shard = self.shard_buckets and self.world_size > 1
        try:
            assignment = assign_buckets(plan, self.world_size, shard_buckets=shard)
        except ValueError as e:
            # torch's rule cuts some buckets (often DDP's first, single-bucket plan) into more
            # runs than ranks; torch then silently drops a run's updates. Whole buckets instead.
            warnings.warn(f"{e}; this bucket plan is assigned with shard_buckets=False", stacklevel=2)
            assignment = assign_buckets(plan, self.world_size, shard_buckets=False)
        self.plan, self.assignment = plan, assignment
        params = self.ddp._params
        self._params_into_flats(plan)
        self.optims = {}
        for sub in self.assignment.per_rank[self.rank]:
            owned = [params[m] for m in plan.buckets[sub.bucket].members[sub.start:sub.stop]]
            opt = self.optimizer_class([{"params": owned}], **self.zero.defaults)
            for p in owned:
                i = self.ddp._index_of[id(p)]
                if i in old:
                    opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in old[i].items()}
            self.optims[sub.bucket] = opt

    def _state_per_param(self) -> dict[int, dict]:
        """Every parameter's optimizer state, from whichever rank held it (one-off, on rebuilds)."""
        mine = {self.ddp._index_of[id(p)]: dict(s) for opt in self.optims.values() for p, s in opt.state.items()}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return {i: s for theirs in everyone for i, s in theirs.items()}

    def _params_into_flats(self, plan: BucketPlan) -> None:
        """Make every parameter a view into one flat tensor per bucket, laid out as the plan says.

        An owner's run of a bucket is then one contiguous range that is broadcast in place: no
        gather into a send buffer, no copy out on the receivers (as torch's overlap builds its
        ``_bucket_assignments_per_rank`` tensors). This may run inside the backward pass (the
        first bucket's hook): the values are copied unchanged, so autograd's saved parameters
        still read the same numbers.
        """
        self.flats = [params_into_flat(self.ddp._params, bucket) for bucket in plan.buckets]

    # -- one bucket -----------------------------------------------------------------------------

    def skipping(self, bucket: GradBucket) -> bool:
        """Whether this iteration only reduces (torch's first iterations); counts iterations."""
        if self.iterations >= self.skip:
            return False
        if bucket.is_last():
            self.iterations += 1
        return True

    def step_and_broadcast(self, bucket: GradBucket, value: Any) -> None:
        """My slice's update, then every owner's broadcast of ``bucket``. After a local step of
        this iteration raised, no more updates, but every broadcast still goes out (the other
        ranks post them): the collectives stay paired and the next iteration works."""
        if self.failure is None:
            try:
                self.local_step(bucket, value)
            except BaseException as e:  # noqa: BLE001 - re-raised once the broadcasts are out
                self.failure = e
        self.broadcast(bucket)
        if bucket.is_last():
            self.iterations += 1
            self.finish()

    def take_failure(self) -> BaseException | None:
        failure, self.failure = self.failure, None
        return failure

    def local_step(self, bucket: GradBucket, value: Any) -> None:
        """Update my slice of ``bucket`` from its reduced gradients (the hook's result ``value``)."""
        sub = self.assignment.subset(self.rank, bucket.index())
        if sub is None:
            return
        if isinstance(value, (list, tuple)):
            value = value[0]
        buf = bucket.buffer()
        if isinstance(value, torch.Tensor) and value.data_ptr() != buf.data_ptr():
            buf.copy_(value.view(-1)[: buf.numel()])  # what DDP would do with the result later
        params = bucket.parameters()[sub.start:sub.stop]
        grads = bucket.gradients()[sub.start:sub.stop]
        opt = self.optims[bucket.index()]
        group = opt.param_groups[0]
        for k, v in self.zero.param_groups[0].items():  # schedulers edit the ZeRO's group
            if k != "params":
                group[k] = v
        saved = [p.grad for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            opt.step()
        for p, g in zip(params, saved):
            p.grad = g

    def broadcast(self, bucket: GradBucket) -> None:
        """Every owner of a run of ``bucket`` sends its updated parameters (async, in place)."""
        b = bucket.index()
        spec = self.plan.buckets[b]
        for r in self.assignment.ranks_of_bucket(b):
            sub = self.assignment.subset(r, b)
            lo, hi = spec.offsets[sub.start], spec.offsets[sub.stop - 1] + spec.numels[sub.stop - 1]
            src = dist.get_global_rank(self.bcast_group, r)
            self.pending.append((f"{self.name}: the broadcast of rank {r}'s run of bucket {b}",
                                 dist.broadcast(self.flats[b][lo:hi], src=src, group=self.bcast_group,
                                                async_op=True)))

    def finish(self) -> None:
        """Wait for this iteration's broadcasts (they wrote the parameters in place)."""
        pending, self.pending = self.pending, []
        wait_all(pending)


def hook_with_zero_step(hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False, *, update_from_first_iteration: bool = False) -> Hook:
    """``hook``, plus the ZeRO step of every bucket once the last bucket has been reduced.

    torch's ``hook_with_zero_step``: backward computation runs uninterrupted; when DDP launches
    the last bucket, each rank waits for the reductions of its buckets, steps its share and
    broadcasts it. ``zero`` is a :class:`hybrid.torch.ZeroRedundancyOptimizer` built with
    ``overlap_with_ddp=True`` (its ``step()`` then does nothing). As torch's, the first two
    backward passes (three with ``static_graph``) update nothing.

    Args:
      hook: the comm hook doing the reduction, e.g. torch's ``allreduce_hook``.
      ddp: the :class:`hybrid.torch.DistributedDataParallel` the hook is registered on.
      zero: the optimizer.
      shard_buckets: split buckets over ranks (``assign_buckets(..., shard_buckets=True)``)
        instead of giving each bucket whole to one rank.
      update_from_first_iteration: update from the first backward on (no skipped iterations;
        not torch's behaviour).

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    >>> from hybrid.torch import DistributedDataParallel, ZeroRedundancyOptimizer
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.5)
    >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    >>> before = ddp.module.bias.detach().clone()
    >>> for _ in range(2):                              # torch's two skipped iterations
    ...     ddp(torch.ones(3, 4)).sum().backward()
    ...     zero.zero_grad()
    >>> torch.equal(before, ddp.module.bias)
    True
    >>> ddp(torch.ones(3, 4)).sum().backward()         # the step happens inside backward
    >>> (before - ddp.module.bias).tolist()             # lr * gradient (3 rows of ones)
    [1.5, 1.5]
    >>> dist.destroy_process_group()
    """
    overlap = _Overlap(ddp, zero, shard_buckets, own_group=False,
                       update_from_first_iteration=update_from_first_iteration)
    futures: dict[int, tuple[torch.futures.Future, GradBucket]] = {}

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> torch.futures.Future:
        fut = hook(state, bucket)
        if overlap.skipping(bucket):
            return fut
        if bucket.index() == 0:
            overlap.ensure_plan()
            futures.clear()
        futures[bucket.index()] = (fut, bucket)
        if not bucket.is_last():
            return fut
        for b in range(len(futures)):
            f, bkt = futures[b]
            overlap.step_and_broadcast(bkt, f.wait())
        futures.clear()
        failure = overlap.take_failure()
        if failure is not None:
            # Raised from backward() by DDP's finalizer, once every bucket has been launched.
            failed = torch.futures.Future()
            failed.set_exception(failure)
            return failed
        return fut
    return hook_with_zero_fn


def hook_with_zero_step_interleaved(hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False, *,
                                    update_from_first_iteration: bool = False) -> Hook:
    """``hook``, plus each bucket's ZeRO step as soon as that bucket is reduced.

    torch's ``hook_with_zero_step_interleaved``: steps and broadcasts interleave with the rest of
    the backward pass. Arguments as :func:`hook_with_zero_step`. Must be created on every rank
    of the DDP's process group (it creates a process group for its broadcasts).

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    >>> from hybrid.torch import DistributedDataParallel, ZeroRedundancyOptimizer
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.5)
    >>> hook = hook_with_zero_step_interleaved(allreduce_hook, ddp, zero, update_from_first_iteration=True)
    >>> ddp.register_comm_hook(None, hook)
    >>> before = ddp.module.bias.detach().clone()
    >>> ddp(torch.ones(3, 4)).sum().backward()          # no skipped iterations: opted in
    >>> (before - ddp.module.bias).tolist()
    [1.5, 1.5]
    >>> dist.destroy_process_group()
    """
    overlap = _Overlap(ddp, zero, shard_buckets, own_group=True,
                       update_from_first_iteration=update_from_first_iteration)
    # One worker: buckets are stepped and broadcast strictly in bucket order on every rank.
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybrid-zero-step")
    last: list = [None]  # the previous bucket's task

    def hook_with_zero_interleaved_fn(state: Any, bucket: GradBucket) -> torch.futures.Future:
        fut = hook(state, bucket)
        if overlap.skipping(bucket):
            return fut
        if bucket.index() == 0:
            if last[0] is not None:
                # A failed iteration's backward returned at its first failed bucket; its later
                # buckets' broadcasts finish before this iteration's plan is looked at.
                last[0].result()
            overlap.ensure_plan()
        out = torch.futures.Future()

        def zero_step():
            try:
                value = fut.wait()
                overlap.step_and_broadcast(bucket, value)
                failure = overlap.failure
                if bucket.is_last():
                    overlap.take_failure()
            except BaseException as e:  # noqa: BLE001 - handed to DDP, which waits on the Future
                out.set_exception(e)
            else:
                if failure is not None:
                    out.set_exception(failure)
                else:
                    out.set_result(value)
        last[0] = worker.submit(zero_step)
        return out
    return hook_with_zero_interleaved_fn
