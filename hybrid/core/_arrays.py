"""pack / unpack / shard slicing, written once for numpy, torch and jax.numpy arrays.

The core never imports torch or jax: an input's framework is recognised by its type's module, and
that framework is already imported if the caller holds such an array.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybrid.core._buckets import BucketPlan
from hybrid.core._dtypes import canonical_dtype
from hybrid.core._shard import FlatShardPlan


class _Numpy:
    def __init__(self, np):
        self.np = np

    def flat(self, a):
        return self.np.reshape(a, (-1,))

    def concat(self, parts, like):
        return self.np.concatenate(parts) if parts else self.np.zeros((0,), dtype=like.dtype)

    def zeros(self, n, like):
        return self.np.zeros((n,), dtype=like.dtype)

    def reshape(self, a, shape):
        return self.np.reshape(a, shape)

    def write(self, buffer, offset, flat):
        buffer[offset:offset + flat.shape[0]] = flat
        return buffer


class _Jax(_Numpy):
    def write(self, buffer, offset, flat):
        # Functional: a dynamic_update_slice, which XLA performs in place on a donated buffer.
        return buffer.at[offset:offset + flat.shape[0]].set(flat)


class _Torch:
    def __init__(self, torch):
        self.torch = torch

    def flat(self, a):
        return a.reshape(-1)

    def concat(self, parts, like):
        return self.torch.cat(parts) if parts else like.new_zeros((0,))

    def zeros(self, n, like):
        return like.new_zeros((n,))

    def reshape(self, a, shape):
        return a.view(shape)

    def write(self, buffer, offset, flat):
        buffer[offset:offset + flat.shape[0]].copy_(flat)
        return buffer


def _namespace(array):
    module = type(array).__module__.split(".")[0]
    if module == "torch":
        return _Torch(sys.modules["torch"])
    if module in ("jax", "jaxlib"):
        return _Jax(sys.modules["jax.numpy"])
    if module == "numpy":
        return _Numpy(sys.modules["numpy"])
    raise TypeError(f"pack/unpack take numpy, torch or jax arrays, got {type(array).__name__}")


def _dtype_name(array) -> str:
    return canonical_dtype(array.dtype)


def pack(plan: BucketPlan, bucket_index: int, arrays: Sequence, *, length: int | None = None, out=None):
    """Concatenate a bucket's members into one flat array laid out as the plan says.

    Args:
      plan: the bucket plan.
      bucket_index: which bucket.
      arrays: one array per spec of the plan (all of them, indexed like ``plan.specs``); only the
        bucket's members are read. numpy, torch and jax arrays all work, and the result is of
        the same kind.
      length: pad the result with zeros to this many elements (e.g. a FlatShardPlan's
        ``padded_length``); default the bucket's own length.
      out: write the members into this 1-D buffer of ``length`` elements and the bucket's dtype
        instead of allocating one, and return it: numpy and torch in place, jax as the updated
        array (``out.at[...].set``: XLA updates a donated buffer in place). Elements outside the
        members (padding) keep ``out``'s values, so a buffer made by ``zeros`` stays ``pack``'s.

    >>> import numpy as np
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> pack(plan, 0, [np.ones(2, np.float32), np.zeros((1, 2), np.float32)]).tolist()
    [1.0, 1.0, 0.0, 0.0]
    >>> pack(plan, 0, [np.ones(2, np.float32), np.full((1, 2), 2, np.float32)], out=np.zeros(4, np.float32)).tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    bucket = plan.buckets[bucket_index]
    if len(arrays) != len(plan.specs):
        raise ValueError(f"pack needs one array per spec ({len(plan.specs)}), got {len(arrays)}")
    length = bucket.length if length is None else length
    if length < bucket.length:
        raise ValueError(f"length {length} is shorter than bucket {bucket_index}'s {bucket.length} elements")
    like = arrays[bucket.members[0]]
    xp = _namespace(like)
    if out is not None and (tuple(out.shape) != (length,) or _dtype_name(out) != bucket.dtype):
        raise ValueError(f"bucket {bucket_index} packs into a {bucket.dtype}[{length}] buffer, "
                         f"got out={_dtype_name(out)}{list(out.shape)}")
    parts, end = [], 0
    for m, offset in zip(bucket.members, bucket.offsets):
        spec, a = plan.specs[m], arrays[m]
        if tuple(a.shape) != spec.shape or _dtype_name(a) != spec.dtype:
            raise ValueError(f"tensor {spec.name!r}: expected {spec.dtype}{list(spec.shape)}, "
                             f"got {_dtype_name(a)}{list(a.shape)}")
        if out is not None:
            out = xp.write(out, offset, xp.flat(a))
            continue
        if offset > end:
            parts.append(xp.zeros(offset - end, like))
        parts.append(xp.flat(a))
        end = offset + spec.numel
    if out is not None:
        return out
    if length > end:
        parts.append(xp.zeros(length - end, like))
    return xp.concat(parts, like)


def unpack(plan: BucketPlan, bucket_index: int, flat) -> dict[int, object]:
    """Split a flat bucket back into its members: ``{spec_index: array}``.

    numpy and torch results are views of ``flat``; jax results are slices.

    >>> import numpy as np
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> {k: v.shape for k, v in unpack(plan, 0, np.arange(4, dtype=np.float32)).items()}
    {0: (2,), 1: (1, 2)}
    """
    bucket = plan.buckets[bucket_index]
    if flat.shape[0] < bucket.length or len(flat.shape) != 1:
        raise ValueError(f"bucket {bucket_index} needs a 1-D array of at least {bucket.length} elements, "
                         f"got shape {tuple(flat.shape)}")
    xp = _namespace(flat)
    return {m: xp.reshape(flat[o:o + n], plan.specs[m].shape)
            for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels)}


def bucket_pieces(plan: BucketPlan, bucket_index: int, length: int | None = None) -> tuple[tuple[int | None, int], ...]:
    """A bucket padded to ``length`` elements as consecutive pieces ``(spec index, elements)``,
    with ``None`` for an alignment gap or the padding: what :func:`pack` concatenates, so splitting
    a flat bucket at these sizes undoes it (a split's transpose is a concatenate, where the
    transpose of :func:`unpack`'s slices pads every member to the whole bucket and adds).

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (3,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> bucket_pieces(plan, 0, length=8)  # a, b, then 3 elements of padding
    ((0, 3), (1, 2), (None, 3))
    """
    bucket = plan.buckets[bucket_index]
    length = bucket.length if length is None else length
    if length < bucket.length:
        raise ValueError(f"length {length} is shorter than bucket {bucket_index}'s {bucket.length} elements")
    pieces, end = [], 0
    for m, offset, n in zip(bucket.members, bucket.offsets, bucket.numels):
        if offset > end:
            pieces.append((None, offset - end))
        pieces.append((m, n))
        end = offset + n
    if length > end:
        pieces.append((None, length - end))
    return tuple(pieces)


def take_shard(shards: FlatShardPlan, bucket_index: int, rank: int, flat):
    """Rank ``rank``'s slice of a bucket padded to ``shards.padded_length(bucket_index)``."""
    if flat.shape[0] != shards.padded_length(bucket_index):
        raise ValueError(f"bucket {bucket_index} must be padded to {shards.padded_length(bucket_index)} "
                         f"elements before sharding, got {flat.shape[0]}")
    start, stop = shards.shard_range(bucket_index, rank)
    return flat[start:stop]
