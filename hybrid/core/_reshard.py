"""Resharding: which elements of which source shard land where in a destination shard.

A sharded checkpoint stores every bucket of a :class:`FlatShardPlan` as ``world_size`` slices.
Loading it into another layout (another world size, other bucket caps, another member order, the
other framework's plan) is a list of contiguous copies per destination rank, computed here from
the two plans alone: tensors are matched by name, so the source and destination may bucket them
differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from hybrid.core._fingerprint import fingerprint_of
from hybrid.core._shard import FlatShardPlan


@dataclasses.dataclass(frozen=True, slots=True)
class ShardCopy:
    """``length`` elements from a source rank's slice of a bucket into a destination slice.

    Offsets are within the slices (``0 .. shard_sizes[bucket]``), not within the buckets.
    """

    src_rank: int
    src_bucket: int
    src_start: int
    dst_bucket: int
    dst_start: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReshardPlan:
    """Copies that build every destination rank's slices from the source ranks' slices.

    ``per_rank[r]`` lists rank ``r``'s copies sorted by destination; elements no copy covers are
    padding (zero). Build one with :func:`reshard`.
    """

    src: FlatShardPlan
    dst: FlatShardPlan
    per_rank: tuple[tuple[ShardCopy, ...], ...]

    def copies(self, rank: int) -> tuple[ShardCopy, ...]:
        return self.per_rank[rank]

    def sources(self, rank: int) -> tuple[int, ...]:
        """The source ranks (files) destination rank ``rank`` reads from."""
        return tuple(sorted({c.src_rank for c in self.per_rank[rank]}))

    def to_json(self) -> dict:
        return {"kind": "ReshardPlan", "src": self.src.to_json(), "dst": self.dst.to_json(),
                "per_rank": [[dataclasses.astuple(c) for c in r] for r in self.per_rank]}

    def fingerprint(self) -> str:
        return fingerprint_of(self.to_json())

    def gather(self, rank: int, read: Callable[[int, int, int, int], np.ndarray],
               dtypes: list[np.dtype] | None = None) -> list[np.ndarray]:
        """Rank ``rank``'s destination slices, one numpy array per destination bucket.

        ``read(src_rank, src_bucket, start, stop)`` returns those elements of that source slice
        (e.g. from a safetensors file). ``dtypes`` gives each destination bucket's numpy dtype;
        by default the plan's dtype names are used. Padding is zero.
        """
        sizes = self.dst.shard_sizes
        if dtypes is None:
            dtypes = [np.dtype(b.dtype) for b in self.dst.bucket_plan.buckets]
        out = [np.zeros(n, dtype=d) for n, d in zip(sizes, dtypes)]
        for c in self.per_rank[rank]:
            out[c.dst_bucket][c.dst_start:c.dst_start + c.length] = read(
                c.src_rank, c.src_bucket, c.src_start, c.src_start + c.length)
        return out


def _runs(shards: FlatShardPlan, bucket: int, offset: int, numel: int):
    """``(first element, rank, offset in that rank's slice, length)`` runs of one tensor."""
    size = shards.shard_sizes[bucket]
    k = 0
    while k < numel:
        pos = offset + k
        rank, start = divmod(pos, size)
        n = min(numel - k, size - start)
        yield k, rank, start, n
        k += n


def reshard(src: FlatShardPlan, dst: FlatShardPlan) -> ReshardPlan:
    """The copies that turn ``src``'s slices into ``dst``'s; tensors are matched by name.

    Both plans must hold the same tensors (names, shapes, dtypes); buckets, member order, caps,
    alignment and world size may all differ. Adjacent copies that are contiguous on both sides
    are merged, so an unchanged layout is one copy per slice.

    >>> from hybrid.core import TensorSpec, plan_buckets, shard_flat
    >>> plan = plan_buckets([TensorSpec("a", (4,), "float32"), TensorSpec("b", (2,), "float32")])
    >>> r = reshard(shard_flat(plan, 2), shard_flat(plan, 3))
    >>> [(c.src_rank, c.src_start, c.dst_start, c.length) for c in r.copies(1)]
    [(0, 2, 0, 1), (1, 0, 1, 1)]
    >>> r.sources(1)
    (0, 1)
    """
    src_specs, dst_specs = src.bucket_plan.specs, dst.bucket_plan.specs
    where = {s.name: i for i, s in enumerate(src_specs)}
    missing = [s.name for s in dst_specs if s.name not in where]
    extra = sorted(set(where) - {s.name for s in dst_specs})
    if missing or extra:
        raise ValueError(f"reshard: the plans hold different tensors; only in the destination: "
                         f"{missing}, only in the source: {extra}")
    per_rank: list[list[ShardCopy]] = [[] for _ in range(dst.world_size)]
    for d_index, d_spec in enumerate(dst_specs):
        s_index = where[d_spec.name]
        s_spec = src_specs[s_index]
        if (s_spec.shape, s_spec.dtype) != (d_spec.shape, d_spec.dtype):
            raise ValueError(f"reshard: tensor {d_spec.name!r} is {s_spec.dtype}{list(s_spec.shape)} in the "
                             f"source and {d_spec.dtype}{list(d_spec.shape)} in the destination")
        s_bucket, s_pos = src.bucket_plan.locate(s_index)
        d_bucket, d_pos = dst.bucket_plan.locate(d_index)
        s_offset = src.bucket_plan.buckets[s_bucket].offsets[s_pos]
        d_offset = dst.bucket_plan.buckets[d_bucket].offsets[d_pos]
        for k, d_rank, d_start, d_len in _runs(dst, d_bucket, d_offset, d_spec.numel):
            for j, s_rank, s_start, s_len in _runs(src, s_bucket, s_offset + k, d_len):
                per_rank[d_rank].append(ShardCopy(s_rank, s_bucket, s_start, d_bucket, d_start + j, s_len))
    return ReshardPlan(src, dst, tuple(tuple(_merge(sorted(r, key=lambda c: (c.dst_bucket, c.dst_start))))
                                       for r in per_rank))


def _merge(copies: list[ShardCopy]) -> list[ShardCopy]:
    out: list[ShardCopy] = []
    for c in copies:
        p = out[-1] if out else None
        if (p is not None and (p.src_rank, p.src_bucket, p.dst_bucket) == (c.src_rank, c.src_bucket, c.dst_bucket)
                and p.src_start + p.length == c.src_start and p.dst_start + p.length == c.dst_start):
            out[-1] = dataclasses.replace(p, length=p.length + c.length)
        else:
            out.append(c)
    return out
