"""ZeRO-3's parameters: each rank keeps only its flat slice of every bucket; a bucket is gathered
into one full flat buffer while its parameters are used, and freed after.

The layout is :func:`hybrid.core.shard_flat` over the bucket plan, the layout of ZeRO2's gradient
slices and of checkpoint files. Every parameter's ``.data`` is a view into its bucket's full
buffer, set once. Freeing a bucket resizes that buffer's storage to zero bytes and gathering
resizes it back, so the views, and the tensors autograd saved of them in the forward, stay valid
across a free and a gather (torch's FSDP frees its unsharded parameters the same way). These
*working* parameters are what the module computes with while it runs (``_schedule`` swaps
them in); the user's parameter objects stand for the sharded state (``_shards``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.core import FlatShardPlan
from hybrid.torch._collectives import all_gather_into, wait_all

FREE, GATHERING, READY = "free", "gathering", "ready"


class WorkingSet:
    """Bytes of full buckets alive now (parameters gathered, gradients being reduced) and the
    most alive at once since :meth:`reset_peak`: what ZeRO-3 holds beyond its slices."""

    def __init__(self):
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live


def _wait_and_release(works: list) -> None:
    """Wait for a gather's ``(what, work)`` pairs; free the send buffers it made (a cast copy of
    the slice) now, rather than whenever the backend's thread lets go of the work."""
    wait_all([w for w in works if isinstance(w, tuple)])
    for t in works:
        if isinstance(t, torch.Tensor):
            t.untyped_storage().resize_(0)


def _unmade_view(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A working parameter before its bucket's buffer is made: one zero, expanded to the
    parameter's shape (no memory of the parameter's size). Its shape, which a graph
    ``torch.compile`` captured checks, is right from the start; once made, the views keep their
    shapes and strides across every free and gather (only the buffer's storage is resized, as
    FSDP2 resizes its unsharded parameters' storage), so the captured graphs stay valid."""
    return like.new_zeros(()).expand(shape)


class ParamBuckets:
    """This rank's parameter slices, and the full buckets gathered from them on demand.

    Args:
      params: the parameters to shard, indexed as the plan's specs; their values are read once
        (rank 0's), unless ``slices`` are given.
      shards: the flat shard plan (one equal slice per rank of every padded bucket).
      rank, group: this rank and the process group the buckets are sharded over.
      compute_dtype: the dtype of the gathered buckets (mixed precision's ``param_dtype``), or
        None for the parameters' own.
      flat_collectives: gather with ``all_gather`` (True) or with one broadcast per rank, which is
        faster on gloo (see ZeRO2).
      working: counts the gathered buckets' bytes.
      slices: this rank's slices, made already (a meta module's, initialised unit by unit).
      device: where the buckets live (default: the parameters' device).
    """

    def __init__(self, params: list[torch.Tensor], shards: FlatShardPlan, rank: int, *, group,
                 compute_dtype: torch.dtype | None, flat_collectives: bool, working: WorkingSet,
                 slices: list[torch.Tensor] | None = None, device: torch.device | None = None):
        self.shards, self.rank, self.group = shards, rank, group
        self.world_size = shards.world_size
        self.flat_collectives = flat_collectives
        self.slices: list[torch.Tensor] = []
        self.full: list[torch.Tensor] = []
        self._unmade: list[bool] = []  # no buffer of the bucket's size yet: made at the next gather
        # The parameters the module computes with: views into the full buffers, one per spec.
        self.work: list[torch.nn.Parameter] = [None] * len(params)
        self.state: list[str] = []
        self._works: dict[int, list] = {}
        self.working = working
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for b, bucket in enumerate(shards.bucket_plan.buckets):
            first = params[bucket.members[0]]
            where = first.device if device is None else device
            if slices is not None:
                self.slices.append(slices[b])
            else:
                # DDP's start: every rank takes rank 0's values. One full bucket at a time.
                flat = torch.zeros(shards.padded_length(b), dtype=first.dtype, device=where)
                for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels):
                    flat[o:o + n].copy_(params[m].detach().reshape(-1))
                if self.world_size > 1:
                    dist.broadcast(flat, src=src, group=group)
                start, stop = shards.shard_range(b, rank)
                self.slices.append(flat[start:stop].clone())
                flat.untyped_storage().resize_(0)  # now, not when the backend drops the broadcast
            full = torch.empty(0, dtype=compute_dtype or first.dtype, device=where)
            for m in bucket.members:
                # a view of the buffer, once made; till then a stand-in of its shape (see _new_buffer)
                self.work[m] = torch.nn.Parameter(_unmade_view(full, shards.bucket_plan.specs[m].shape))
            self.full.append(full)
            self._unmade.append(True)
            self.state.append(FREE)

    def _new_buffer(self, b: int) -> None:
        """Bucket ``b`` gets a new full buffer at its next gather; the old one stays with whoever
        still holds a view of it. Till then its working parameters hold no memory of their own,
        but keep their shapes."""
        old = self.full[b]
        empty = torch.empty(0, dtype=old.dtype, device=old.device)
        with torch.no_grad():
            for m in self.shards.bucket_plan.buckets[b].members:
                self.work[m].data = _unmade_view(empty, self.shards.bucket_plan.specs[m].shape)
        self.full[b] = empty
        self._unmade[b] = True

    def _allocate(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s full buffer with memory: its storage resized back, or, the first time (and
        after :meth:`_new_buffer`), a new buffer with the working parameters made views into it.
        Made here and not earlier: an empty buffer cannot take views of the bucket's size."""
        if not self._unmade[b]:
            self.full[b].untyped_storage().resize_(self._nbytes(b))
            return self.full[b]
        plan = self.shards.bucket_plan
        old = self.full[b]
        full = torch.empty(self.shards.padded_length(b), dtype=old.dtype, device=old.device)
        with torch.no_grad():
            for m, o, n in zip(plan.buckets[b].members, plan.buckets[b].offsets, plan.buckets[b].numels):
                # Set through .data: the view gets a version counter of its own, so writing
                # the buffer (a gather) does not look like an in-place change to autograd.
                self.work[m].data = full[o:o + n].view(plan.specs[m].shape)
        self.full[b], self._unmade[b] = full, False
        return full

    @property
    def num_buckets(self) -> int:
        return len(self.full)

    def _nbytes(self, b: int) -> int:
        return self.shards.padded_length(b) * self.full[b].element_size()

    def gather(self, b: int, phase: str) -> None:
        """Start gathering bucket ``b`` (no-op unless it is free); :meth:`wait` before use."""
        if self.state[b] != FREE:
            return
        full = self._allocate(b)
        self.working.add(self._nbytes(b))
        self.state[b] = GATHERING
        self._works[b] = self._issue(full, b, phase)

    def _issue(self, full: torch.Tensor, b: int, phase: str) -> list:
        """Start the collectives that fill ``full`` with every rank's slice of bucket ``b``;
        returns what :meth:`wait` waits for (and the tensors that must live until then)."""
        start, stop = self.shards.shard_range(b, self.rank)
        mine = self.slices[b]
        if self.world_size == 1:
            full.copy_(mine)
            return []
        if self.flat_collectives:
            copy = mine.dtype != full.dtype
            send = mine.to(full.dtype) if copy else mine
            what = f"ZeRO3 {phase}: the all-gather of bucket {b}'s parameters"
            return [(what, all_gather_into(full, send, group=self.group, async_op=True)), *([send] if copy else [])]
        full[start:stop].copy_(mine)
        size, works = stop - start, []
        for r in range(self.world_size):
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            works.append((f"ZeRO3 {phase}: the broadcast of rank {r}'s slice of bucket {b}",
                          dist.broadcast(full[r * size:(r + 1) * size], src=src, group=self.group, async_op=True)))
        return works

    def exact(self, b: int, phase: str) -> torch.Tensor:
        """Bucket ``b`` whole in the slices' own dtype (float32 under mixed precision), in a new
        tensor: what a state dict holds. A collective."""
        full = torch.empty(self.shards.padded_length(b), dtype=self.slices[b].dtype, device=self.slices[b].device)
        _wait_and_release(self._issue(full, b, phase))
        return full

    def wait(self, b: int) -> None:
        """Block until bucket ``b`` (being gathered, or gathered) holds every rank's slice."""
        if self.state[b] == GATHERING:
            try:
                _wait_and_release(self._works.pop(b))
            except BaseException:
                self.state[b] = READY
                self.free(b)  # what arrived is incomplete: nothing may compute with it
                raise
            self.state[b] = READY
        assert self.state[b] == READY, f"bucket {b} is {self.state[b]}, not gathered"

    def free(self, b: int, *, quiet: bool = False, renew: bool = False) -> None:
        """Release bucket ``b``'s full buffer (after its gather, if one is in flight: the backend
        must not write into freed memory). ``quiet``: on an error path, a failed gather is not
        raised again (the error being handled is the one to report). ``renew``: leave the buffer
        to whoever still references it (it is freed when they let go) and gather into a new one
        from now on, rather than freeing the memory under them."""
        if self.state[b] == FREE:
            return
        if self.state[b] == GATHERING:
            try:
                self.wait(b)
            except RuntimeError:
                if not quiet:
                    raise
                return  # wait() freed it
        storage = self.full[b].untyped_storage()
        if storage.resizable() and not renew:
            storage.resize_(0)
        else:
            # Someone may share the gathered memory (renew: the end of gathered(); torch makes a
            # storage non-resizable once numpy views it). It stays theirs; the bucket gathers into
            # a new buffer from now on.
            self._new_buffer(b)
        self.working.sub(self._nbytes(b))
        self.state[b] = FREE

    def free_all(self, *, quiet: bool = False, renew: bool = False) -> None:
        for b in range(self.num_buckets):
            self.free(b, quiet=quiet, renew=renew)

    @torch.no_grad()
    def write_back(self, b: int) -> None:
        """Copy this rank's part of gathered bucket ``b`` into its slice (after the user wrote it)."""
        start, stop = self.shards.shard_range(b, self.rank)
        self.slices[b].copy_(self.full[b][start:stop])

    @torch.no_grad()
    def load(self, values: dict[int, torch.Tensor]) -> None:
        """Set this rank's slices from whole values (``{spec index: tensor}``; others unchanged)."""
        for b in range(self.num_buckets):
            for s in self.shards.member_slices(b, self.rank):
                if s.tensor in values:
                    piece = values[s.tensor].detach().reshape(-1)[s.start:s.stop]
                    self.slices[b][s.shard_offset:s.shard_offset + s.stop - s.start].copy_(piece)
