"""ZeRO ownership: which rank keeps optimizer state (and gradients) for what.

Three plans, each a frozen value with JSON and a fingerprint:

* :class:`ParamPartition` - whole tensors per rank, sorted-greedy as torch's
  ``ZeroRedundancyOptimizer._partition_parameters``;
* :class:`FlatShardPlan` - every bucket cut into ``world_size`` equal contiguous slices
  (padded), the layout ``reduce_scatter`` and ``all_gather`` need (ZeRO-2);
* :class:`BucketAssignment` - whole buckets (or runs of a bucket's members) per rank, as
  ``ddp_zero_hook`` assigns them to overlap the optimizer step with backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybrid.core._buckets import BucketPlan
from hybrid.core._fingerprint import fingerprint_of
from hybrid.core._spec import TensorSpec, check_specs, specs_from_json


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _min_index(values: Sequence[int], disallowed: set[int] = frozenset()) -> int:
    # torch's _get_min_index: first minimum, skipping disallowed ranks.
    best, best_value = -1, float("inf")
    for i, v in enumerate(values):
        if i not in disallowed and v < best_value:
            best, best_value = i, v
    return best


@dataclasses.dataclass(frozen=True, slots=True)
class ParamPartition:
    """Whole-tensor ZeRO ownership.

    ``groups[g]`` holds the spec indices of parameter group ``g``; ``per_rank[r][g]`` the indices
    rank ``r`` owns in group ``g``, in the order torch appends them (largest first).
    """

    specs: tuple[TensorSpec, ...]
    world_size: int
    groups: tuple[tuple[int, ...], ...]
    per_rank: tuple[tuple[tuple[int, ...], ...], ...]

    def owner(self, tensor_index: int) -> int:
        for rank, groups in enumerate(self.per_rank):
            if any(tensor_index in g for g in groups):
                return rank
        raise ValueError(f"tensor index {tensor_index} is in no parameter group")

    def owned(self, rank: int) -> tuple[int, ...]:
        """All spec indices rank ``rank`` owns, group by group."""
        return tuple(i for g in self.per_rank[rank] for i in g)

    def numel_per_rank(self) -> list[int]:
        return [sum(self.specs[i].numel for i in self.owned(r)) for r in range(self.world_size)]

    def bytes_per_rank(self) -> list[int]:
        return [sum(self.specs[i].nbytes for i in self.owned(r)) for r in range(self.world_size)]

    def broadcast_order(self) -> tuple[int, ...]:
        """The order in which the ranks' shares are broadcast after a step: lightest share first
        (fewest elements, then lowest rank).

        Every rank issues the broadcasts in this one order. A rank can post its receives for the
        shares ahead of its own before stepping, so the lighter ranks, which finish their step
        first, send while the heavier ones are still stepping.

        >>> from hybrid.core import TensorSpec, partition_params
        >>> specs = [TensorSpec(name, (n,), "float32") for name, n in [("a", 10), ("b", 3), ("c", 2)]]
        >>> part = partition_params(specs, 2)
        >>> part.numel_per_rank(), part.broadcast_order()  # rank 1 steps 5 elements, rank 0 10
        ([10, 5], (1, 0))
        """
        loads = self.numel_per_rank()
        return tuple(sorted(range(self.world_size), key=lambda r: (loads[r], r)))

    def to_json(self) -> dict:
        return {"kind": "ParamPartition", "specs": [s.to_json() for s in self.specs],
                "world_size": self.world_size, "groups": [list(g) for g in self.groups],
                "per_rank": [[list(g) for g in r] for r in self.per_rank]}

    @classmethod
    def from_json(cls, d: dict) -> "ParamPartition":
        return cls(specs_from_json(d["specs"]), d["world_size"], tuple(tuple(g) for g in d["groups"]),
                   tuple(tuple(tuple(g) for g in r) for r in d["per_rank"]))

    def fingerprint(self) -> str:
        return fingerprint_of(self.to_json())


def partition_params(specs: Sequence[TensorSpec], world_size: int, *,
                     groups: Sequence[Sequence[int]] | None = None) -> ParamPartition:
    """ZeroRedundancyOptimizer's partition: per group, largest tensor first to the least-loaded rank.

    Loads (in elements) carry over from one parameter group to the next, as in torch.

    Args:
      specs: all parameters.
      world_size: number of ranks.
      groups: spec indices per parameter group, in group order; default one group of all.

    >>> specs = [TensorSpec(f"p{i}", (n,), "float32") for i, n in enumerate([9, 7, 5, 3] * 2)]
    >>> partition_params(specs, 2).numel_per_rank()
    [24, 24]
    """
    specs = check_specs(specs)
    _check_world_size(world_size)
    groups = (tuple(range(len(specs))),) if groups is None else tuple(tuple(int(i) for i in g) for g in groups)
    flat = [i for g in groups for i in g]
    if sorted(flat) != list(range(len(specs))):
        raise ValueError(f"groups must hold every spec index exactly once, got {[list(g) for g in groups]}")
    sizes = [0] * world_size
    per_rank: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
    for group in groups:
        group_per_rank: list[list[int]] = [[] for _ in range(world_size)]
        for i in sorted(group, key=lambda i: specs[i].numel, reverse=True):
            rank = _min_index(sizes)
            group_per_rank[rank].append(i)
            sizes[rank] += specs[i].numel
        for rank in range(world_size):
            per_rank[rank].append(tuple(group_per_rank[rank]))
    return ParamPartition(specs, world_size, groups, tuple(tuple(r) for r in per_rank))


@dataclasses.dataclass(frozen=True, slots=True)
class MemberSlice:
    """Part of one tensor inside one rank's flat shard.

    Elements ``[start, stop)`` of tensor ``tensor`` (flattened) sit at ``shard_offset`` of the shard.
    """

    tensor: int
    start: int
    stop: int
    shard_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class GroupRun:
    """Elements ``[lo, hi)`` of a rank's slice of bucket ``bucket``, all of parameter group ``group``."""

    bucket: int
    lo: int
    hi: int
    group: int


@dataclasses.dataclass(frozen=True, slots=True)
class FlatShardPlan:
    """Each bucket of ``bucket_plan`` cut into ``world_size`` equal contiguous slices.

    Bucket ``b`` is padded to ``padded_length(b) = shard_size[b] * world_size`` elements; rank ``r``
    owns ``[r * shard_size[b], (r + 1) * shard_size[b])``.
    """

    bucket_plan: BucketPlan
    world_size: int
    shard_sizes: tuple[int, ...]

    def padded_length(self, bucket: int) -> int:
        return self.shard_sizes[bucket] * self.world_size

    def shard_range(self, bucket: int, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        size = self.shard_sizes[bucket]
        return rank * size, (rank + 1) * size

    def rank_shards(self, rank: int) -> list[tuple[int, int, int]]:
        """``(bucket, start, stop)`` for every bucket: the slices rank ``rank`` owns."""
        return [(b, *self.shard_range(b, rank)) for b in range(len(self.shard_sizes))]

    def member_slices(self, bucket: int, rank: int) -> list[MemberSlice]:
        """Each member's overlap with rank ``rank``'s slice of bucket ``bucket``, in bucket order."""
        start, stop = self.shard_range(bucket, rank)
        b = self.bucket_plan.buckets[bucket]
        out = []
        for m, o, n in zip(b.members, b.offsets, b.numels):
            lo, hi = max(o, start), min(o + n, stop)
            if lo < hi:
                out.append(MemberSlice(m, lo - o, hi - o, lo - start))
        return out

    def group_runs(self, rank: int, group_of: Sequence[int]) -> list[GroupRun]:
        """Cut rank ``rank``'s slice of every bucket into maximal runs of one parameter group.

        ``group_of[i]`` is tensor ``i``'s group. A member owns the elements from its offset up to
        the next member's (alignment gaps included) and the last member the bucket's padding, so
        the runs of a bucket tile the slice exactly: what a sharded optimizer with several
        parameter groups steps, one flat tensor per run.

        >>> from hybrid.core import plan_buckets
        >>> plan = plan_buckets([TensorSpec(n, (3,), "float32") for n in "abc"])
        >>> [(r.bucket, r.lo, r.hi, r.group) for r in shard_flat(plan, 2).group_runs(0, [0, 1, 0])]
        [(0, 0, 3, 0), (0, 3, 5, 1)]
        """
        if len(group_of) != len(self.bucket_plan.specs):
            raise ValueError(f"group_of needs one group per spec ({len(self.bucket_plan.specs)}), "
                             f"got {len(group_of)}")
        out: list[GroupRun] = []
        for b, bucket in enumerate(self.bucket_plan.buckets):
            start, stop = self.shard_range(b, rank)
            ends = list(bucket.offsets[1:]) + [self.padded_length(b)]
            first = len(out)
            for i, (m, end) in enumerate(zip(bucket.members, ends)):
                lo, hi = max(0 if i == 0 else bucket.offsets[i], start) - start, min(end, stop) - start
                if hi <= lo:
                    continue
                if len(out) > first and out[-1].group == group_of[m] and out[-1].hi == lo:
                    out[-1] = GroupRun(b, out[-1].lo, hi, group_of[m])
                else:
                    out.append(GroupRun(b, lo, hi, group_of[m]))
        return out

    def shard_numel(self, rank: int) -> int:
        """Elements (padding included) of all of rank ``rank``'s slices."""
        del rank  # every rank's slices are the same size
        return sum(self.shard_sizes)

    def to_json(self) -> dict:
        return {"kind": "FlatShardPlan", "bucket_plan": self.bucket_plan.to_json(),
                "world_size": self.world_size, "shard_sizes": list(self.shard_sizes)}

    @classmethod
    def from_json(cls, d: dict) -> "FlatShardPlan":
        return cls(BucketPlan.from_json(d["bucket_plan"]), d["world_size"], tuple(d["shard_sizes"]))

    def fingerprint(self) -> str:
        return fingerprint_of(self.to_json())


def shard_flat(plan: BucketPlan, world_size: int) -> FlatShardPlan:
    """Cut every bucket in ``world_size`` equal slices, padding its end.

    >>> from hybrid.core import plan_buckets
    >>> plan = plan_buckets([TensorSpec("w", (10,), "float32")])
    >>> shard_flat(plan, 4).rank_shards(3)
    [(0, 9, 12)]
    """
    _check_world_size(world_size)
    sizes = tuple(-(-b.length // world_size) for b in plan.buckets)
    return FlatShardPlan(plan, world_size, sizes)


@dataclasses.dataclass(frozen=True, slots=True)
class BucketSubset:
    """Members ``[start, stop)`` (positions within the bucket) of bucket ``bucket``."""

    bucket: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class BucketAssignment:
    """Which rank updates which bucket (or run of a bucket's members) right after it is reduced.

    ``per_rank[r]`` lists rank ``r``'s subsets in the order torch assigns them; each bucket's
    subsets partition its members.
    """

    bucket_plan: BucketPlan
    world_size: int
    shard_buckets: bool
    per_rank: tuple[tuple[BucketSubset, ...], ...]

    def ranks_of_bucket(self, bucket: int) -> list[int]:
        return [r for r, subs in enumerate(self.per_rank) if any(s.bucket == bucket for s in subs)]

    def subset(self, rank: int, bucket: int) -> BucketSubset | None:
        return next((s for s in self.per_rank[rank] if s.bucket == bucket), None)

    def params_per_rank(self, rank: int) -> list[int]:
        """Spec indices rank ``rank`` updates, in torch's ``params_per_rank`` order."""
        members = [b.members for b in self.bucket_plan.buckets]
        return [m for s in self.per_rank[rank] for m in members[s.bucket][s.start:s.stop]]

    def to_json(self) -> dict:
        return {"kind": "BucketAssignment", "bucket_plan": self.bucket_plan.to_json(),
                "world_size": self.world_size, "shard_buckets": self.shard_buckets,
                "per_rank": [[[s.bucket, s.start, s.stop] for s in r] for r in self.per_rank]}

    @classmethod
    def from_json(cls, d: dict) -> "BucketAssignment":
        return cls(BucketPlan.from_json(d["bucket_plan"]), d["world_size"], d["shard_buckets"],
                   tuple(tuple(BucketSubset(*s) for s in r) for r in d["per_rank"]))

    def fingerprint(self) -> str:
        return fingerprint_of(self.to_json())


def assign_buckets(plan: BucketPlan, world_size: int, *, shard_buckets: bool = False) -> BucketAssignment:
    """Bucket-to-rank assignment of ``ddp_zero_hook``.

    Without ``shard_buckets`` bucket ``b`` goes whole to rank ``b % world_size``. With it, buckets
    are visited smallest first and cut into runs of members below ``total / world_size`` elements,
    each run to the least-loaded rank that holds no other run of the same bucket.

    >>> from hybrid.core import plan_buckets
    >>> specs = [TensorSpec(f"p{i}", (8,), "float32") for i in range(4)]
    >>> a = assign_buckets(plan_buckets(specs, size_limits=[64]), 2)
    >>> a.params_per_rank(0), a.params_per_rank(1)
    ([2, 3], [0, 1])
    """
    _check_world_size(world_size)
    per_rank: list[list[BucketSubset]] = [[] for _ in range(world_size)]
    buckets = plan.buckets
    if not shard_buckets:
        for b, bucket in enumerate(buckets):
            per_rank[b % world_size].append(BucketSubset(b, 0, len(bucket.members)))
        return BucketAssignment(plan, world_size, False, tuple(tuple(r) for r in per_rank))

    threshold = sum(sum(b.numels) for b in buckets) / world_size
    load = [0] * world_size
    for b in sorted(range(len(buckets)), key=lambda b: sum(buckets[b].numels)):
        taken: set[int] = set()
        numels = buckets[b].numels
        start, size = 0, 0

        def give(stop: int, size: int) -> None:
            rank = _min_index(load, taken)
            if rank < 0:
                raise ValueError(f"bucket {b} splits into more than world_size={world_size} runs under "
                                 f"shard_buckets; use larger buckets or shard_buckets=False")
            per_rank[rank].append(BucketSubset(b, start, stop))
            taken.add(rank)
            load[rank] += size

        for k, n in enumerate(numels):
            if size + n >= threshold and k > start:
                give(k, size)
                start, size = k, 0
            size += n
        give(len(numels), size)
    return BucketAssignment(plan, world_size, True, tuple(tuple(r) for r in per_rank))
