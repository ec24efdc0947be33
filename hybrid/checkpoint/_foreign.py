"""What the readers of other tools' checkpoints (torch DCP, orbax) share: a manifest that describes
their tensors in hybrid's terms, and reads by tensor name.

A foreign checkpoint has no bucket plan: its tensors are stored one by one (DCP as chunks of each
tensor, orbax as one array per leaf). Its manifest says so with a plan of one bucket per tensor
and a world of one, so element ``i`` of bucket ``b`` is element ``i`` of tensor ``b`` (flattened,
row-major), and every loader's resharding (``hybrid.core.reshard``) reads from it as from a
one-file hybrid checkpoint. A reader then only has to fill ranges of named tensors
(:meth:`ForeignCheckpoint._fill`).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from hybrid.core import Bucket, BucketPlan, TensorSpec
from hybrid.checkpoint._manifest import CheckpointError, Manifest, OptimizerInfo
from hybrid.checkpoint._reader import CheckpointReader


def one_bucket_per_tensor(specs: Sequence[TensorSpec]) -> BucketPlan:
    """The plan of a foreign checkpoint: each tensor alone in its bucket, at offset 0.

    >>> plan = one_bucket_per_tensor([TensorSpec("w", (2, 3), "float32"), TensorSpec("b", (3,), "float32")])
    >>> plan.bucket_indices(), plan.buckets[0].length
    ([[0], [1]], 6)
    """
    buckets = tuple(Bucket(s.dtype, s.device, (i,), (0,), (s.numel,), s.numel, 0) for i, s in enumerate(specs))
    return BucketPlan(tuple(specs), buckets, (0,))


def foreign_manifest(framework: str, specs: Sequence[TensorSpec], *, step: int, optimizer: OptimizerInfo | None,
                     buffers: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                     metadata: dict | None = None, run_state: dict | None = None) -> Manifest:
    """A manifest describing a foreign checkpoint's tensors (``buffers``: name -> (shape, dtype);
    ``run_state``: its LR scheduler's state and the entries it carries, ``_other_state``)."""
    plan = one_bucket_per_tensor(specs)
    kinds = ["params", *(optimizer.slots if optimizer is not None else ())]
    dtypes = {f"{kind}/{b}": bucket.dtype for kind in kinds for b, bucket in enumerate(plan.buckets)}
    buffer_meta = {n: {"shape": list(shape), "dtype": dtype} for n, (shape, dtype) in (buffers or {}).items()}
    return Manifest(framework, 1, None, int(step), plan, optimizer, dtypes, (), dict(metadata or {}), buffer_meta,
                    dict(run_state or {}))


def copy_ranges(flat: np.ndarray, ranges: Sequence[tuple[int, np.ndarray]]) -> None:
    """Copy ``flat[first:first + len(out)]`` into each ``out`` of ``ranges`` (``(first, out)``)."""
    for first, out in ranges:
        out[:] = flat[first:first + len(out)]


class ForeignCheckpoint(CheckpointReader):
    """A checkpoint another tool wrote, read through hybrid's reads (see the module docstring).

    Subclasses build the manifest (:func:`foreign_manifest`), check their files in
    :meth:`_check_files` (once, before any read) and fill ranges in :meth:`_fill`.
    """

    def __init__(self, path: str | os.PathLike, manifest: Manifest, format: str):
        self.path = pathlib.Path(path)
        self.manifest = manifest
        self.format = format
        self._checked = False
        plan = manifest.plan
        self._name_of_bucket = [plan.specs[b.members[0]].name for b in plan.buckets]

    def _check_files(self) -> None:
        """Raise CheckpointError unless every file the reads will open is safe and present."""

    def verify(self, ranks=None) -> None:
        del ranks  # one "rank": every tensor is read by name
        if not self._checked:
            self._check_files()
            self._checked = True

    def _fill(self, kind: str, name: str, ranges: list[tuple[int, np.ndarray]]) -> None:
        """Fill each ``(first, out)`` with elements ``[first, first + len(out))`` of tensor ``name``
        of ``kind`` (``"params"``, a slot, ``"buffers"``), flattened, in its stored dtype."""
        raise NotImplementedError

    def _read(self, requests: dict[int, list[tuple[str, int, np.ndarray]]]) -> None:
        self.verify()
        wanted: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
        for rank, items in requests.items():
            assert rank == 0, f"a foreign checkpoint is read as one rank, got a request for rank {rank}"
            for key, first, out in items:
                kind, _, where = key.partition("/")
                name = where if kind == "buffers" else self._name_of_bucket[int(where)]
                wanted.setdefault((kind, name), []).append((first, out))
        self._fill_many(wanted)

    def _fill_many(self, wanted: dict[tuple[str, str], list[tuple[int, np.ndarray]]]) -> None:
        """:meth:`_fill` every ``(kind, name)`` of ``wanted`` (a reader may read them together)."""
        for (kind, name), ranges in wanted.items():
            self._fill(kind, name, ranges)


def check_step(recorded: int | None, given: int | None, *, where: str, what: str) -> int:
    """The training step of a foreign checkpoint: the one it records, or the one given for a
    checkpoint that records none; a given step that contradicts a recorded one is an error."""
    if recorded is None and given is None:
        raise CheckpointError(f"{where}: records no training step ({what}): pass step= (the step the run is "
                              f"at) to open it")
    if recorded is not None and given is not None and int(given) != int(recorded):
        raise CheckpointError(f"{where}: records step {recorded}, but step={given} was given")
    return int(recorded if recorded is not None else given)
