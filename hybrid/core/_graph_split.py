"""GraphSplitPlan: where a compiled graph is cut so its pieces line up with DDP's buckets.

A compiled model's backward runs as one fused function, so every gradient is ready at once. Cutting
the captured forward graph into pieces, each compiled on its own, gives the backward one function
per piece: the gradients of the last piece are ready (and their buckets reduced) while the earlier
pieces' backward still runs. This is dynamo's ``DDPOptimizer``; the cut points are decided here.

The frontend walks its graph in reverse (the order gradients become ready) and hands over the
parameters in that order, grouped by the graph node that first uses them (a node is atomic: a
linear's weight and bias cannot be separated). The rule is torch's bucket rule on that order: a
piece closes once its bytes reach its limit (the first limit for piece 0, then the next ones, the
last one repeating), with the boundary snapped to the end of the node that crossed it. On
one-parameter nodes this is exactly ``rebuild_plan``'s bucket assignment over the same order,
whatever the dtypes: the pieces equal the reducer's rebuilt buckets when the caps are equal.
Unlike DDP's buckets, pieces are not split by dtype or device (a graph is one sequence).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from hybrid.core._buckets import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES
from hybrid.core._fingerprint import fingerprint_of
from hybrid.core._spec import TensorSpec, check_specs, specs_from_json


@dataclasses.dataclass(frozen=True, slots=True)
class GraphSplitPlan:
    """Pieces of a graph in gradient-ready order; piece 0 is the graph's *last* part.

    ``groups[g]`` holds the spec indices first used by the ``g``-th parameter-using node met when
    walking the graph from its output back to its inputs. Piece ``k`` covers the groups
    ``starts[k]`` up to ``starts[k + 1]`` (exclusive). ``size_limits`` are the byte caps it was
    planned under; ``merged`` lists the group indices where a piece used to start before
    :func:`merge_piece` joined it to its neighbour (reported by the frontend).
    """

    specs: tuple[TensorSpec, ...]
    groups: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    size_limits: tuple[int, ...]
    merged: tuple[int, ...] = ()

    def __post_init__(self):
        seen = sorted(i for g in self.groups for i in g)
        if seen != list(range(len(self.specs))):
            raise ValueError(f"every spec must be in exactly one group: groups {self.groups!r} "
                             f"over {len(self.specs)} specs")
        if any(not g for g in self.groups):
            raise ValueError(f"groups must be non-empty, got {self.groups!r}")
        if self.groups and (not self.starts or self.starts[0] != 0):
            raise ValueError(f"the first piece starts at group 0, got starts {self.starts!r}")
        if not self.groups and self.starts:
            raise ValueError(f"a plan without parameters has no pieces, got starts {self.starts!r}")
        if any(b <= a for a, b in zip(self.starts, self.starts[1:])) or (
                self.starts and self.starts[-1] >= len(self.groups)):
            raise ValueError(f"piece starts must increase strictly within {len(self.groups)} groups, "
                             f"got {self.starts!r}")
        if not self.size_limits or any(c < 0 for c in self.size_limits):
            raise ValueError(f"size limits must be non-negative and non-empty, got {self.size_limits!r}")

    @property
    def num_pieces(self) -> int:
        return len(self.starts)

    def piece_groups(self, k: int) -> range:
        """Group indices of piece ``k``."""
        end = self.starts[k + 1] if k + 1 < len(self.starts) else len(self.groups)
        return range(self.starts[k], end)

    def members(self, k: int) -> tuple[int, ...]:
        """Spec indices of piece ``k``, in ready order."""
        return tuple(i for g in self.piece_groups(k) for i in self.groups[g])

    def nbytes(self, k: int) -> int:
        return sum(self.specs[i].nbytes for i in self.members(k))

    def limit(self, k: int) -> int:
        return self.size_limits[min(k, len(self.size_limits) - 1)]

    def piece_of_group(self) -> tuple[int, ...]:
        """For every group, the piece it belongs to (monotone, non-decreasing)."""
        return tuple(k for k in range(self.num_pieces) for _ in self.piece_groups(k))

    def to_json(self) -> dict:
        return {"specs": [s.to_json() for s in self.specs], "groups": [list(g) for g in self.groups],
                "starts": list(self.starts), "size_limits": list(self.size_limits),
                "merged": list(self.merged)}

    @classmethod
    def from_json(cls, d: dict | str) -> "GraphSplitPlan":
        d = json.loads(d) if isinstance(d, str) else d
        return cls(specs_from_json(d["specs"]), tuple(tuple(g) for g in d["groups"]),
                   tuple(d["starts"]), tuple(d["size_limits"]), tuple(d.get("merged", ())))

    def fingerprint(self) -> str:
        return fingerprint_of(self.to_json())


def split_size_limits(cap_bytes: int | None = None, first_cap_bytes: int | None = None) -> tuple[int, ...]:
    """The limits of a graph split: torch's DDP defaults (1 MiB, then 25 MiB) unless given.

    A cap below the default first cap lowers the first cap with it (torch's ``DDPOptimizer``
    asserts instead); an explicit first cap above the cap is refused.

    >>> split_size_limits()
    (1048576, 26214400)
    >>> split_size_limits(4096)
    (4096,)
    """
    cap = DEFAULT_BUCKET_CAP_BYTES if cap_bytes is None else int(cap_bytes)
    if cap < 0:
        raise ValueError(f"split cap must be non-negative, got {cap_bytes!r}")
    if first_cap_bytes is None:
        first = min(DEFAULT_FIRST_BUCKET_CAP_BYTES, cap) if cap_bytes is None else cap
    else:
        first = int(first_cap_bytes)
        if not 0 <= first <= cap:
            raise ValueError(f"first split cap must be between 0 and the cap ({cap}), got {first_cap_bytes!r}")
    return (first, cap) if first != cap else (cap,)


def plan_graph_split(specs: Sequence[TensorSpec], groups: Sequence[Sequence[int]] | None = None, *,
                     size_limits: Sequence[int] | None = None) -> GraphSplitPlan:
    """Cut a graph into pieces of about ``size_limits`` bytes of parameters, in ready order.

    Args:
      specs: the parameters the reducer reduces (DDP-ignored parameters and buffers left out:
        they do not count toward a piece's size).
      groups: spec indices per parameter-using node, in reverse graph order (default: one node
        per spec, in ``specs`` order).
      size_limits: byte limit of piece 0, 1, ...; the last repeats (default
        :func:`split_size_limits`: 1 MiB, then 25 MiB).

    >>> specs = [TensorSpec(f"p{i}", (256,), "float32") for i in range(5)]  # 1 KiB each
    >>> plan = plan_graph_split(specs, [(4,), (3, 2), (1,), (0,)], size_limits=(1024, 2048))
    >>> [plan.members(k) for k in range(plan.num_pieces)]
    [(4,), (3, 2), (1, 0)]
    """
    specs = check_specs(specs)
    groups = tuple((i,) for i in range(len(specs))) if groups is None else tuple(tuple(g) for g in groups)
    limits = split_size_limits() if size_limits is None else tuple(int(c) for c in size_limits)
    starts, size = [], 0
    for g, members in enumerate(groups):
        if not starts:
            starts.append(g)
        elif size >= limits[min(len(starts) - 1, len(limits) - 1)]:
            starts.append(g)
            size = 0
        size += sum(specs[i].nbytes for i in members if 0 <= i < len(specs))
    return GraphSplitPlan(specs, groups, tuple(starts), limits)


def merge_piece(plan: GraphSplitPlan, k: int) -> GraphSplitPlan:
    """``plan`` with piece ``k`` joined to the next piece (the previous one for the last piece).

    The frontend merges a piece that would be left without outputs (for instance one that only
    mutates its inputs in place): a graph cannot be cut there.

    >>> specs = [TensorSpec(f"p{i}", (256,), "float32") for i in range(3)]
    >>> plan = merge_piece(plan_graph_split(specs, size_limits=(1,)), 0)
    >>> [plan.members(k) for k in range(plan.num_pieces)], plan.merged
    ([(0, 1), (2,)], (1,))
    """
    if not 0 <= k < plan.num_pieces:
        raise ValueError(f"piece {k} does not exist in a plan of {plan.num_pieces} pieces")
    if plan.num_pieces == 1:
        return plan
    drop = k + 1 if k + 1 < plan.num_pieces else k  # the start that disappears
    starts = plan.starts[:drop] + plan.starts[drop + 1:]
    return dataclasses.replace(plan, starts=starts, merged=tuple(sorted(plan.merged + (plan.starts[drop],))))
