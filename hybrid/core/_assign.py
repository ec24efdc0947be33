"""torch's ``compute_bucket_assignment_by_size``, reproduced exactly.

The greedy rule is simple: walk the tensors, accumulate them per (dtype, device) key, close a
bucket when its bytes reach the key's current size limit, then move that key to the next limit.
Two details make "exactly" harder than it looks, and both are reproduced here:

* tensors whose gradient is sparse get a bucket of their own (size limit 0);
* leftover buckets are emitted by iterating a C++ ``std::unordered_map`` keyed by
  (ScalarType, Device). When ``tensor_indices`` is given (bucket rebuilds) the result is not
  sorted afterwards, so that hash-map iteration order is observable. ``_LibstdcxxMapOrder``
  simulates libstdc++'s ``_Hashtable`` (prime rehash policy, insert-at-bucket-begin) over
  c10's hash of the key, which is what torch's Linux wheels run.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid.core._dtypes import torch_device_code, torch_scalar_type_code
from hybrid.core._spec import TensorSpec, check_specs

_MASK64 = (1 << 64) - 1
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_PRIMES = (17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109,
           113, 127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313,
           337, 359, 383, 409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031)


def _hash_combine(seed: int, value: int) -> int:
    # c10::hash_combine (boost's), on 64-bit size_t.
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK64)) & _MASK64


def _torch_bucket_key_hash(dtype: str, device: str) -> int:
    # c10::get_hash(type, device): tuple_hash combines the last element's hash as the seed.
    scalar_type = torch_scalar_type_code(dtype)
    device_type, index = torch_device_code(device)
    device_hash = ((device_type & 0xFF) << 16) | (index & 0xFF)  # std::hash<c10::Device>
    return _hash_combine(device_hash, scalar_type)


class _LibstdcxxMapOrder:
    """Iteration order of a libstdc++ unordered_map with unique keys under insertion."""

    def __init__(self):
        self._order: list = []  # the node list, begin first
        self._buckets = 1
        self._next_resize = 0
        self._hashes: dict = {}

    def _next_bucket_count(self, n: int) -> int:
        if n < len(_FAST_BUCKETS):
            self._next_resize = _FAST_BUCKETS[n]
            return _FAST_BUCKETS[n]
        for p in _PRIMES:
            if p >= n:
                self._next_resize = p
                return p
        raise AssertionError("more bucket keys than the simulated prime table covers")

    def _bucket(self, key) -> int:
        return self._hashes[key] % self._buckets

    def _insert_at_bucket_begin(self, order: list, key) -> None:
        b = self._bucket(key)
        for pos, other in enumerate(order):
            if self._bucket(other) == b:
                # Non-empty bucket: the node goes right before the bucket's first node.
                order.insert(pos, key)
                return
        order.insert(0, key)  # empty bucket: the node becomes the list's head

    def insert(self, key, hash_value: int) -> None:
        if key in self._hashes:
            return
        self._hashes[key] = hash_value
        count = len(self._order)
        if count + 1 > self._next_resize:
            min_buckets = max(count + 1, 0 if self._next_resize else 11)
            if min_buckets >= self._buckets:
                self._buckets = self._next_bucket_count(max(min_buckets + 1, self._buckets * 2))
                self._rehash()
            else:
                self._next_resize = self._buckets
        self._insert_at_bucket_begin(self._order, key)

    def _rehash(self) -> None:
        new: list = []
        for key in self._order:
            self._insert_at_bucket_begin(new, key)
        self._order = new

    def __iter__(self):
        return iter(self._order)


def compute_bucket_assignment_by_size(
    specs: Sequence[TensorSpec],
    size_limits: Sequence[int],
    tensor_indices: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Group tensors into buckets exactly as ``torch.distributed._compute_bucket_assignment_by_size``.

    Args:
      specs: the tensors, in the order torch would receive them.
      size_limits: byte limits; each (dtype, device) key uses them in turn and keeps the last.
      tensor_indices: the index to record for ``specs[i]``; given for bucket rebuilds, where
        ``specs`` is in gradient-ready order. Then buckets are not sorted.

    Returns:
      ``(bucket_indices, per_bucket_size_limits)``; sparse tensors have limit 0.

    >>> specs = [TensorSpec(f"p{i}", (256,), "float32") for i in range(4)]
    >>> compute_bucket_assignment_by_size(specs, [2048])
    ([[0, 1], [2, 3]], [2048, 2048])
    """
    specs = check_specs(specs)
    if not specs:
        raise ValueError("compute_bucket_assignment_by_size needs at least one tensor, got none")
    limits = [int(x) for x in size_limits]
    if not limits:
        raise ValueError("size_limits must hold at least one limit, got []")
    if any(x < 0 for x in limits):
        raise ValueError(f"size limits must be non-negative, got {limits}")
    if tensor_indices is not None and len(tensor_indices) == 0:
        tensor_indices = None
    if tensor_indices is not None:
        tensor_indices = [int(i) for i in tensor_indices]
        if len(tensor_indices) != len(specs):
            raise ValueError(f"tensor_indices has {len(tensor_indices)} entries for {len(specs)} tensors")

    result: list[tuple[list[int], int]] = []
    open_buckets: dict[tuple[str, str], tuple[list[int], int, int]] = {}  # indices, bytes, limit
    limit_position: dict[tuple[str, str], int] = {}
    map_order = _LibstdcxxMapOrder()
    for i, spec in enumerate(specs):
        index = i if tensor_indices is None else tensor_indices[i]
        if spec.sparse:
            result.append(([index], 0))
            continue
        key = (spec.dtype, spec.device)
        map_order.insert(key, _torch_bucket_key_hash(*key))
        indices, size, _ = open_buckets.get(key, ([], 0, 0))
        position = limit_position.setdefault(key, 0)
        indices.append(index)
        size += spec.nbytes
        limit = limits[position]
        if size >= limit:
            result.append((indices, limit))
            open_buckets[key] = ([], 0, 0)
            limit_position[key] = min(position + 1, len(limits) - 1)
        else:
            open_buckets[key] = (indices, size, limit)
    for key in map_order:
        indices, _, limit = open_buckets[key]
        if indices:
            result.append((indices, limit))
    if tensor_indices is None:
        result.sort(key=lambda bucket: min(bucket[0]))
    return [b for b, _ in result], [limit for _, limit in result]
