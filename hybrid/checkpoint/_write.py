"""Writing a checkpoint from one process: whole arrays or padded flat buckets, every rank's file."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from hybrid.core import BucketPlan, FlatShardPlan, MemberSlice, TensorSpec, canonical_dtype, plan_buckets, shard_flat
from hybrid.checkpoint._files import storage_dtype, write_shard
from hybrid.checkpoint._protocol import abandon_save, begin_save, commit_save, remove_previous_part
from hybrid.checkpoint._manifest import Manifest, OptimizerInfo


def to_storage(array: np.ndarray) -> np.ndarray:
    """``array`` as stored on disk (bfloat16 as its raw uint16 bits)."""
    array = np.asarray(array)
    return array.view(storage_dtype(canonical_dtype(array.dtype)))


def slice_pieces(shards: FlatShardPlan, bucket: int, rank: int, arrays: Sequence[np.ndarray] | None = None, *,
                 piece: Callable[[MemberSlice], np.ndarray] | None = None) -> list[np.ndarray]:
    """Rank ``rank``'s slice of bucket ``bucket`` as 1-D pieces of ``arrays`` (one per spec, stored
    dtypes), or of what ``piece(member_slice)`` gives, and zeros for alignment gaps and padding:
    the bucket is never packed whole.

    >>> from hybrid.core import TensorSpec, plan_buckets, shard_flat
    >>> plan = plan_buckets([TensorSpec("a", (3,), "float32"), TensorSpec("b", (2,), "float32")])
    >>> arrays = [np.arange(3, dtype=np.float32), np.arange(10, 12, dtype=np.float32)]
    >>> [p.tolist() for p in slice_pieces(shard_flat(plan, 2), 0, 1, arrays)]
    [[10.0, 11.0], [0.0]]
    """
    if piece is None:
        piece = lambda m: np.asarray(arrays[m.tensor]).reshape(-1)[m.start:m.stop]
    start, stop = shards.shard_range(bucket, rank)
    dtype = storage_dtype(shards.bucket_plan.buckets[bucket].dtype)
    pieces, pos = [], 0
    for m in shards.member_slices(bucket, rank):
        if m.shard_offset > pos:
            pieces.append(np.zeros(m.shard_offset - pos, dtype))
        pieces.append(piece(m))
        pos = m.shard_offset + m.stop - m.start
    if stop - start > pos or not pieces:
        pieces.append(np.zeros(stop - start - pos, dtype))
    return pieces


def rank_tensors(plan: BucketPlan, world_size: int, rank: int, *, flats: Mapping[str, list[np.ndarray]] = {},
                 arrays: Mapping[str, Sequence[np.ndarray]] = {}) -> dict[str, list[np.ndarray]]:
    """Rank ``rank``'s file contents: its slice of every bucket of every kind, from padded flat
    buckets (``flats[kind][b]``) or from whole arrays (``arrays[kind][spec_index]``)."""
    shards = shard_flat(plan, world_size)
    out = {}
    for kind, per_bucket in flats.items():
        for b, flat in enumerate(per_bucket):
            start, stop = shards.shard_range(b, rank)
            out[f"{kind}/{b}"] = [flat[start:stop]]
    for kind, per_spec in arrays.items():
        for b in range(plan.num_buckets):
            out[f"{kind}/{b}"] = slice_pieces(shards, b, rank, per_spec)
    return out


def buffer_entries(buffers: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None
                   ) -> tuple[dict[str, dict], dict[str, list[np.ndarray]]]:
    """The manifest's ``buffers`` field and rank 0's extra file contents for replicated buffers
    (``{name: array}`` in stored dtypes; ``dtypes[name]``: the logical dtype of one stored as its
    bits, a bfloat16 or float8 buffer as unsigned integers, default the array's own)."""
    meta, tensors = {}, {}
    for name, array in buffers.items():
        array = np.asarray(array)
        meta[name] = {"shape": list(array.shape), "dtype": (dtypes or {}).get(name) or canonical_dtype(array.dtype)}
        tensors[f"buffers/{name}"] = [to_storage(array).reshape(-1)]
    return meta, tensors


def dtypes_of(plan: BucketPlan, kinds) -> dict[str, str]:
    return {f"{kind}/{b}": bucket.dtype for kind in kinds for b, bucket in enumerate(plan.buckets)}


def save_sharded(path: str | os.PathLike, *, plan: BucketPlan, world_size: int, framework: str, step: int,
                 flats: Mapping[str, list[np.ndarray]] = {}, arrays: Mapping[str, Sequence[np.ndarray]] = {},
                 stage: int | None = None, optimizer: OptimizerInfo | None = None,
                 metadata: dict | None = None, buffers: Mapping[str, np.ndarray] | None = None,
                 run_state: dict | None = None, buffer_dtypes: Mapping[str, str] | None = None) -> Manifest:
    """Save ``world_size`` rank files from this process, written in parallel, the manifest last.

    Each kind comes as padded flat buckets (``flats[kind][b]`` of ``padded_length(b)`` elements) or
    as whole arrays in the plan's spec order (``arrays[kind]``), in stored dtypes. ``buffers``
    (replicated, by name) go into rank 0's file once; ``run_state`` is JSON kept in the manifest."""
    shards = shard_flat(plan, world_size)
    for kind, per_bucket in flats.items():
        lengths = [len(f) for f in per_bucket]
        want = [shards.padded_length(b) for b in range(plan.num_buckets)]
        assert lengths == want, f"{kind}: flat lengths {lengths}, the plan pads to {want}"
    buffer_meta, buffer_tensors = buffer_entries(buffers or {}, buffer_dtypes)
    body = Manifest(framework, world_size, stage, int(step), plan, optimizer, dtypes_of(plan, [*flats, *arrays]),
                    (), dict(metadata or {}), buffer_meta, check_json(run_state or {}, "run state"))
    digest = body.body_digest()

    def contents(rank):
        tensors = rank_tensors(plan, world_size, rank, flats=flats, arrays=arrays)
        return {**tensors, **buffer_tensors} if rank == 0 else tensors

    begin_save(path)
    with concurrent.futures.ThreadPoolExecutor(min(world_size, 8)) as pool:
        try:
            files = list(pool.map(lambda r: write_shard(path, r, world_size, contents(r), body_digest=digest,
                                                         dtypes=body.tensor_dtypes()),
                                  range(world_size)))
            manifest = dataclasses.replace(body, files=tuple(files))
            commit_save(path, manifest, remove_previous=False)
        except BaseException:
            abandon_save(path)  # nothing committed: no half-written .NAME.saving left behind
            raise
        remove_previous_part(path, 0, 1, map=pool.map)  # the old files in parallel threads
    return manifest


def save_arrays(path: str | os.PathLike, params: Mapping[str, np.ndarray], *, world_size: int = 1, step: int = 0,
                slots: Mapping[str, Mapping[str, np.ndarray]] | None = None, optimizer: OptimizerInfo | None = None,
                plan: BucketPlan | None = None, stage: int | None = None, framework: str = "numpy",
                metadata: dict | None = None, buffers: Mapping[str, np.ndarray] | None = None,
                run_state: dict | None = None, buffer_dtypes: Mapping[str, str] | None = None) -> Manifest:
    """Save whole arrays by name (registration order) as a checkpoint of ``world_size`` shards.

    Args:
      path: the checkpoint directory (replaced atomically if it exists).
      params: ``{name: array}`` in registration order.
      world_size: how many rank files to cut the buckets into.
      step: the training step to record.
      slots: optimizer state per slot, ``{"mu": {name: array}, ...}``; needs ``optimizer``.
      optimizer: what the slots belong to (:class:`OptimizerInfo`).
      plan: the bucket plan to cut by; default ``plan_buckets`` of the arrays' specs.
      stage, framework, metadata: recorded in the manifest.
      buffers: replicated non-trainable arrays by name (BatchNorm statistics), saved once.
      buffer_dtypes: the logical dtype of a buffer given as its stored bits (``{name: "bfloat16"}``).
      run_state: JSON the run needs back (``{"scheduler": ..., "state": ...}``).

    >>> import numpy as np, tempfile, os
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> m = save_arrays(d, {"w": np.ones((2, 2), np.float32), "b": np.zeros(3, np.float32)}, world_size=2)
    >>> [f.name for f in m.files]
    ['rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors']
    """
    slots = dict(slots or {})
    if slots and optimizer is None:
        raise ValueError("save_arrays: slots need an optimizer (OptimizerInfo) saying what they are")
    if optimizer is not None and set(slots) != set(optimizer.slots):
        raise ValueError(f"save_arrays: slots {sorted(slots)} differ from the optimizer's {list(optimizer.slots)}")
    specs = [TensorSpec(name, tuple(np.shape(a)), canonical_dtype(np.asarray(a).dtype)) for name, a in params.items()]
    plan = plan_buckets(specs) if plan is None else plan
    names = [s.name for s in plan.specs]

    def ordered(values: Mapping[str, np.ndarray], kind: str) -> list[np.ndarray]:
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"save_arrays: {kind} lacks {missing}")
        return [to_storage(values[n]) for n in names]

    arrays = {"params": ordered(params, "params"), **{k: ordered(v, k) for k, v in slots.items()}}
    return save_sharded(path, plan=plan, world_size=world_size, arrays=arrays, framework=framework, step=step,
                        stage=stage, optimizer=optimizer, metadata=metadata, buffers=buffers, run_state=run_state,
                        buffer_dtypes=buffer_dtypes)


def check_json(value: dict, what: str) -> dict:
    """``value`` if it survives a JSON round trip, else a ValueError naming the first key that does not."""
    for key, item in value.items():
        try:
            json.dumps(item, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the {what} must be JSON-serializable: {key!r} is not ({e}); convert it (e.g. "
                             f"tensors and arrays with .tolist()) before saving") from None
    return value

