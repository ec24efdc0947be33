"""ZeRO-3's gradients: each bucket reduced as soon as its last gradient is accumulated, this rank
keeping only its float32 slice of the average.

A post-accumulate-grad hook per parameter counts a bucket's gradients. Buckets are reduced in plan
order (bucket 0 first, as DDP does: the plan's order is the order the backward makes them ready),
so every rank issues the same collectives in the same order; a bucket ready early waits for those
before it. The reduction of bucket ``b`` runs while the backward computes the next one; it is
waited for when the next one is launched, before that one's buffer is made, so one full gradient
bucket lives at a time (besides the gradients autograd is accumulating for the next).
When the backward ends (a callback queued on autograd's engine) the buckets still waiting are
reduced (a parameter that got no gradient this time counts as zero), every reduction is waited
for, and each user parameter's ``.grad`` becomes a :class:`GradientInShards` stand-in.

``on_slice_reduced`` (set by ``ZeRO3Optimizer(step_in_backward=True)``) is called with ``b`` the
moment bucket ``b``'s slice is complete, still inside the backward: the optimizer steps that
bucket and drops its gradient slice, so no rank ever holds its whole share of the gradient.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybrid.core import FlatShardPlan
from hybrid.torch._call_guard import CallGuard
from hybrid.torch._collectives import reduce_scatter_into, wait_all
from hybrid.torch.zero._parts import cleared_slices
from hybrid.torch.zero._zero2_grads import GradientInShards
from hybrid.torch.zero.zero3._params import WorkingSet


class GradReducer:
    """Per-bucket gradient reduction into this rank's slices (``slices[b]``, float32, or None).

    Args:
      params, names: the working parameters (autograd accumulates into their ``.grad``) and the
        names, indexed as the plan's specs.
      shards: the user's parameters (they get the :class:`GradientInShards` stand-ins).
      shards, rank, group: the layout and the process group.
      reduce_dtype: the dtype the gradients are reduced in (None: the gradients' own).
      flat_collectives: ``reduce_scatter`` (True) or an all-reduce of which this rank keeps its
        slice, which is faster on gloo (see ZeRO2).
      on_bucket_done: called with ``b`` once bucket ``b``'s parameters have all their gradients
        (the backward no longer needs them: ZeRO3 frees the gathered bucket).
      working: counts the full gradient buckets' bytes.
      guard: checks, as a backward begins, that every rank is in the same call.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], user_params: list[torch.Tensor],
                 shards: FlatShardPlan, rank: int, *, group, reduce_dtype: torch.dtype | None,
                 flat_collectives: bool, on_bucket_done: Callable[[int], None], working: WorkingSet,
                 guard: CallGuard):
        self.params, self.names, self.shards, self.rank, self.group = params, names, shards, rank, group
        self.user_params = user_params
        # One stand-in per parameter, made once (they are immutable), set without going through
        # the sharded parameters' __torch_function__ (a per-parameter cost every step otherwise).
        self._stand_ins = [GradientInShards.of(p, n) for p, n in zip(user_params, names)]
        self._stand_ins_set = False
        self.world_size = shards.world_size
        self.reduce_dtype = reduce_dtype
        self.flat_collectives = flat_collectives
        self.on_bucket_done = on_bucket_done
        plan = shards.bucket_plan
        self._bucket_of = [plan.locate(i)[0] for i in range(len(params))]
        self._sizes = [len(b.members) for b in plan.buckets]
        self.slices: list[torch.Tensor | None] = [None] * plan.num_buckets
        self.sync = True  # False under ZeRO3.no_sync(): gradients stay local, in .grad
        self.working, self.guard = working, guard
        self.on_slice_reduced: Callable[[int], None] | None = None
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(params)]

    def _reset(self) -> None:
        n = len(self._sizes)
        self._got = [False] * len(self.params)
        self._ready = [0] * n
        self.complete = [False] * n
        self._next = 0  # the next bucket to launch
        self._inflight: collections.deque = collections.deque()
        self._queued = False
        self._syncing = self.sync

    @property
    def steps_in_backward(self) -> bool:
        """Whether an optimizer steps each bucket as its slice is reduced (and is still alive)."""
        return self.on_slice_reduced is not None and getattr(self.on_slice_reduced, "alive", True)

    @property
    def in_backward(self) -> bool:
        return self._queued

    def begin_backward(self) -> None:
        """Check that every rank is in a backward, and queue the end-of-backward callback, once
        per backward (from any hook of it, before its first collective)."""
        if not self._queued:
            self._queued = True
            self._syncing = self.sync
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.guard.enter("backward")

    def _grad_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            del param
            self.begin_backward()
            if self._got[i]:
                return  # a second accumulation in one backward (reentrant checkpointing): counted once
            self._got[i] = True
            b = self._bucket_of[i]
            self._ready[b] += 1
            if self._ready[b] == self._sizes[b]:
                self._bucket_complete(b)
                self._launch_ready()
        return hook

    def _bucket_complete(self, b: int) -> None:
        self.complete[b] = True
        self.on_bucket_done(b)

    def _launch_ready(self) -> None:
        if not self._syncing:
            return
        while self._next < len(self._sizes) and self.complete[self._next]:
            self._launch(self._next)
            self._next += 1

    @torch.no_grad()
    def finish_reductions(self) -> None:
        """Wait for the reductions in flight and take their slices (and, stepping in the backward,
        step their buckets), freeing their full gradient buckets."""
        while self._inflight:
            self._finish(*self._inflight.popleft())

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        # The previous bucket's reduction ran during this bucket's backward: take its slice
        # before this bucket's buffer exists, so that one full gradient bucket is alive at a time.
        self.finish_reductions()
        bucket = self.shards.bucket_plan.buckets[b]
        first = self.params[bucket.members[0]]
        dtype = self.reduce_dtype or first.dtype
        flat = torch.empty(self.shards.padded_length(b), dtype=dtype, device=first.device)
        end = 0
        for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels):
            if o > end:
                flat[end:o].zero_()
            p = self.params[m]
            if p.grad is None:  # no gradient in any backward since zero_grad: a zero one
                flat[o:o + n].zero_()
            else:
                flat[o:o + n].copy_(p.grad.reshape(-1))
                p.grad = None  # the full gradient need not live on: the bucket holds it
            end = o + n
        flat[end:].zero_()
        flat.div_(self.world_size)  # DDP's mean: divide, then sum
        self.working.add(flat.numel() * flat.element_size())
        start, stop = self.shards.shard_range(b, self.rank)
        if self.world_size == 1:
            work, out, what = None, flat[start:stop], ""
        elif self.flat_collectives:
            out = torch.empty(stop - start, dtype=dtype, device=flat.device)
            what = f"ZeRO3 backward: the reduce-scatter of gradient bucket {b}"
            work = reduce_scatter_into(out, flat, group=self.group, async_op=True)
        else:
            out = flat[start:stop]
            what = f"ZeRO3 backward: the all-reduce of gradient bucket {b}"
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._inflight.append((b, what, work, flat, out))

    def _finish(self, b: int, what: str, work, flat: torch.Tensor, out: torch.Tensor) -> None:
        if work is not None:
            wait_all([(what, work)])
        g = out.to(torch.float32, copy=True)
        if self.slices[b] is None:
            self.slices[b] = g
        else:
            self.slices[b].add_(g)  # accumulation across backward passes, as .grad does
        # Freed here and now: the work still references the buffer, and would otherwise free it
        # whenever the backend's thread lets go of the work.
        for t in (flat, out):
            t.untyped_storage().resize_(0)
        self.working.sub(flat.numel() * flat.element_size())
        if self.on_slice_reduced is not None:
            self.on_slice_reduced(b)

    def _end_backward(self) -> None:
        try:
            for b in range(len(self._sizes)):
                if not self.complete[b]:
                    self._bucket_complete(b)  # parameters without a gradient this time
            self._launch_ready()
            self.finish_reductions()
            if self._syncing:
                self._set_user_grads(self._stand_ins)
        finally:
            self._reset()

    def abandon_unfinished(self) -> None:
        """Before a forward: forget a backward that raised before its end (autograd then skips
        the queued callback); its reductions are dropped, its gradients are lost."""
        if self._queued:
            for _, _, _, flat, out in self._inflight:
                self.working.sub(flat.untyped_storage().nbytes())
                flat.untyped_storage().resize_(0)
                out.untyped_storage().resize_(0)
            for b in range(len(self._sizes)):
                self.on_bucket_done(b)
            self._reset()

    def drop_stand_ins(self) -> None:
        """Before a forward: ``.grad`` back to None where it holds a stand-in (autograd must not
        accumulate into one)."""
        if self._stand_ins_set:
            self._set_user_grads(None)

    def _set_user_grads(self, grads) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            for i, p in enumerate(self.user_params):
                p.grad = None if grads is None else grads[i]
        self._stand_ins_set = grads is not None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.slices = cleared_slices(self.slices, set_to_none)
        for p in self.params:
            p.grad = None
        self._set_user_grads(None)

