"""BucketPlan: which tensor goes in which flat bucket, at which offset."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence

from hybrid.core._assign import compute_bucket_assignment_by_size
from hybrid.core._dtypes import itemsize
from hybrid.core._fingerprint import fingerprint_of
from hybrid.core._spec import TensorSpec, check_specs, specs_from_json

MiB = 1 << 20
DEFAULT_BUCKET_CAP_BYTES = 25 * MiB
DEFAULT_FIRST_BUCKET_CAP_BYTES = 1 * MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """One flat buffer: a single dtype and device, members laid out at element offsets.

    ``members[k]`` is an index into the plan's specs; its elements occupy
    ``[offsets[k], offsets[k] + numels[k])`` of the buffer. ``length`` is the buffer's length in
    elements, padding included. ``size_limit`` is the byte cap the bucket was built under
    (0 for a sparse tensor's own bucket). ``in_place``: a one-tensor bucket reduced where the
    gradient lies, with no flat buffer and no copy in or out (only :func:`hybrid.core.auto_plan`
    chooses it; its JSON carries the key only when set, so other plans' fingerprints are unchanged).
    """

    dtype: str
    device: str
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    length: int
    size_limit: int
    sparse: bool = False
    in_place: bool = False

    def __post_init__(self):
        if not (len(self.members) == len(self.offsets) == len(self.numels)) or not self.members:
            raise ValueError(f"bucket needs equal, non-empty members/offsets/numels, got {self!r}")
        end = 0
        for m, o, n in zip(self.members, self.offsets, self.numels):
            if o < end or n < 0:
                raise ValueError(f"bucket member {m} at offset {o} overlaps the previous member (ends at {end})")
            end = o + n
        if self.length < end:
            raise ValueError(f"bucket length {self.length} is shorter than its members' extent {end}")
        if self.in_place and (len(self.members) != 1 or self.sparse or self.length != self.numels[0]):
            raise ValueError(f"an in-place bucket holds one dense tensor, unpadded, got {self!r}")

    @property
    def nbytes(self) -> int:
        return self.length * itemsize(self.dtype)

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "device": self.device, "members": list(self.members),
             "offsets": list(self.offsets), "numels": list(self.numels), "length": self.length,
             "size_limit": self.size_limit, "sparse": self.sparse}
        if self.in_place:
            d["in_place"] = True
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Bucket":
        return cls(d["dtype"], d["device"], tuple(d["members"]), tuple(d["offsets"]),
                   tuple(d["numels"]), d["length"], d["size_limit"], d.get("sparse", False), d.get("in_place", False))


@dataclasses.dataclass(frozen=True, slots=True)
class BucketPlan:
    """Ordered buckets over a tuple of TensorSpecs; bucket 0 is reduced first.

    Build one with :func:`plan_buckets` or :func:`rebuild_plan`. Plans are hashable, compare by
    value, round-trip through JSON, and have a :meth:`fingerprint` that every process and framework
    computes identically, so ranks can check that they agree before they communicate.
    """

    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    size_limits: tuple[int, ...]
    alignment: int = 1
    _locations: dict = dataclasses.field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "_locations", {
            m: (b, k) for b, bucket in enumerate(self.buckets) for k, m in enumerate(bucket.members)})
        placed = sorted(m for b in self.buckets for m in b.members)
        if placed != list(range(len(self.specs))):
            raise ValueError(f"a bucket plan must place every one of {len(self.specs)} tensors exactly once")
        for b in self.buckets:
            for m, n in zip(b.members, b.numels):
                s = self.specs[m]
                if (s.dtype, s.device, s.numel) != (b.dtype, b.device, n):
                    raise ValueError(f"tensor {s.name!r} ({s.dtype}, {s.device}, {s.numel} elements) "
                                     f"does not fit its bucket ({b.dtype}, {b.device}, {n} elements)")

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def locate(self, tensor_index: int) -> tuple[int, int]:
        """``(bucket_index, position_in_bucket)`` of a tensor."""
        return self._locations[tensor_index]

    def bucket_indices(self) -> list[list[int]]:
        """Members of each bucket, in the form torch's reducer takes and reports."""
        return [list(b.members) for b in self.buckets]

    def to_json(self) -> dict:
        return {"kind": "BucketPlan", "specs": [s.to_json() for s in self.specs],
                "buckets": [b.to_json() for b in self.buckets],
                "size_limits": list(self.size_limits), "alignment": self.alignment}

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, d: dict | str) -> "BucketPlan":
        if isinstance(d, str):
            d = json.loads(d)
        if d.get("kind") != "BucketPlan":
            raise ValueError(f"not a BucketPlan JSON object (kind={d.get('kind')!r})")
        return cls(specs_from_json(d["specs"]), tuple(Bucket.from_json(b) for b in d["buckets"]),
                   tuple(d["size_limits"]), d.get("alignment", 1))

    def fingerprint(self) -> str:
        """Stable 16-hex-digit digest of the plan: same plan, same string, in any process.

        >>> plan = plan_buckets([TensorSpec("w", (4,), "float32")])
        >>> plan.fingerprint() == BucketPlan.from_json(plan.dumps()).fingerprint()
        True
        """
        return fingerprint_of(self.to_json())

    def tag(self) -> int:
        """The fingerprint's first 32 bits as a number: what ``hybrid.jax.ZeroState`` keeps as an
        array leaf, so that a checkpoint of its leaves alone still says which plan laid it out.

        >>> plan = plan_buckets([TensorSpec("w", (4,), "float32")])
        >>> plan.tag() == int(plan.fingerprint()[:8], 16) < 2 ** 32
        True
        """
        return int(self.fingerprint()[:8], 16)


def ddp_size_limits(*, bucket_cap_bytes: int | None = None, bucket_caps_bytes: Sequence[int] = (),
                    static_graph: bool = False, find_unused_parameters: bool = False
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Size limits torch's DDP uses: ``(initial, rebuild)``, as its ``_BucketCapacityConfig``.

    Without ``find_unused_parameters`` (or with ``static_graph``) DDP starts with one bucket per
    (dtype, device) and rebuilds real buckets from the gradient-ready order after iteration one.
    ``bucket_cap_bytes=None`` means torch's defaults (1 MiB first bucket, then 25 MiB).

    >>> ddp_size_limits(find_unused_parameters=True)
    ((1048576, 26214400), (1048576, 26214400))
    >>> ddp_size_limits(bucket_cap_bytes=16)[1]  # torch's [16, 16]: one limit, spelled once
    (16,)
    """
    caps = tuple(int(c) for c in bucket_caps_bytes)
    if any(c < 0 for c in caps) or (bucket_cap_bytes is not None and bucket_cap_bytes < 0):
        raise ValueError(f"bucket caps must be non-negative, got {bucket_cap_bytes!r} / {caps!r}")
    if caps:
        return caps, caps
    cap = DEFAULT_BUCKET_CAP_BYTES if bucket_cap_bytes is None else int(bucket_cap_bytes)
    first = DEFAULT_FIRST_BUCKET_CAP_BYTES if bucket_cap_bytes is None else cap
    rebuild = (first, cap) if first < cap else (cap,)
    if static_graph or not find_unused_parameters:
        # Equal caps are spelled once, as plan_buckets spells them: the assignment is the same
        # and so must be the plan's fingerprint (hybrid.jax plans with (cap,)).
        return (sys.maxsize,), rebuild
    return rebuild, rebuild


def _layout(specs: tuple[TensorSpec, ...], members: Sequence[int], size_limit: int, alignment: int) -> Bucket:
    offsets, numels, end = [], [], 0
    for m in members:
        end = -(-end // alignment) * alignment
        offsets.append(end)
        numels.append(specs[m].numel)
        end += specs[m].numel
    first = specs[members[0]]
    return Bucket(first.dtype, first.device, tuple(members), tuple(offsets), tuple(numels),
                  -(-end // alignment) * alignment, size_limit, first.sparse)


def _check_limits(bucket_cap_bytes: int, first_bucket_cap_bytes: int) -> tuple[int, ...]:
    for name, value in (("bucket_cap_bytes", bucket_cap_bytes), ("first_bucket_cap_bytes", first_bucket_cap_bytes)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return (first_bucket_cap_bytes, bucket_cap_bytes) if first_bucket_cap_bytes < bucket_cap_bytes else (bucket_cap_bytes,)


def _check_alignment(alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive number of elements, got {alignment!r}")


def plan_buckets(specs: Sequence[TensorSpec], *, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES,
                 size_limits: Sequence[int] | None = None, alignment: int = 1) -> BucketPlan:
    """The buckets torch's DDP builds for parameters registered in ``specs`` order.

    Tensors are assigned in registration order (the first bucket capped at
    ``first_bucket_cap_bytes``, the rest at ``bucket_cap_bytes``), then the bucket list is reversed:
    gradients arrive roughly in reverse registration order, so bucket 0 is the one ready first.

    Args:
      specs: parameters in registration order (``module.parameters()`` order).
      bucket_cap_bytes / first_bucket_cap_bytes: byte caps; a tensor larger than a cap sits alone.
        A ``first_bucket_cap_bytes`` at or above ``bucket_cap_bytes`` is ignored (every bucket
        gets ``bucket_cap_bytes``), as in torch's DDP; ``plan.size_limits`` holds the caps used.
      size_limits: explicit limit list instead of the two caps (see :func:`ddp_size_limits`).
      alignment: pad every member offset (and the bucket length) to this many elements.

    >>> specs = [TensorSpec(f"p{i}", (256,), "float32") for i in range(4)]
    >>> plan_buckets(specs, bucket_cap_bytes=2048, first_bucket_cap_bytes=1024).bucket_indices()
    [[3], [1, 2], [0]]
    >>> plan_buckets(specs, bucket_cap_bytes=2048, first_bucket_cap_bytes=4096).size_limits
    (2048,)
    """
    specs = check_specs(specs)
    _check_alignment(alignment)
    limits = _check_limits(bucket_cap_bytes, first_bucket_cap_bytes) if size_limits is None else tuple(size_limits)
    indices, per_bucket = compute_bucket_assignment_by_size(specs, limits)
    buckets = tuple(_layout(specs, m, lim, alignment) for m, lim in zip(reversed(indices), reversed(per_bucket)))
    return BucketPlan(specs, buckets, tuple(limits), alignment)


def rebuild_plan(plan: BucketPlan, ready_order: Sequence[int], *,
                 size_limits: Sequence[int] | None = None) -> BucketPlan:
    """Buckets from an observed gradient-ready order, as DDP's ``rebuild_buckets`` does.

    Args:
      plan: the current plan (its specs and alignment are kept).
      ready_order: tensor indices in the order their gradients became ready. Tensors missing
        from it (unused in the observed iteration) are appended in reverse index order.
      size_limits: limits for the rebuild; by default torch's (first cap, cap) pair.

    >>> specs = [TensorSpec(f"p{i}", (256,), "float32") for i in range(3)]
    >>> plan = plan_buckets(specs, size_limits=[1 << 40])
    >>> rebuild_plan(plan, [0, 2, 1], size_limits=[2048]).bucket_indices()
    [[0, 2], [1]]
    """
    n = len(plan.specs)
    order = [int(i) for i in ready_order]
    if len(set(order)) != len(order) or any(not 0 <= i < n for i in order):
        raise ValueError(f"ready_order must hold distinct tensor indices in [0, {n}), got {order}")
    seen = set(order)
    order += [i for i in reversed(range(n)) if i not in seen]
    if size_limits is None:
        size_limits = _check_limits(DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES)
    indices, per_bucket = compute_bucket_assignment_by_size([plan.specs[i] for i in order], size_limits, order)
    buckets = tuple(_layout(plan.specs, m, lim, plan.alignment) for m, lim in zip(indices, per_bucket))
    return BucketPlan(plan.specs, buckets, tuple(size_limits), plan.alignment)
