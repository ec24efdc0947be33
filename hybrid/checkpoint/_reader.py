"""What every loader reads a checkpoint through: a manifest (what is saved, in which layout) and
verified reads of ranges of the saved tensors, whatever wrote the files.

:class:`CheckpointReader` holds the reads every loader makes (whole tensors by name, a rank's
resharded slices, buffers, the run state) on top of two methods a format provides: ``verify``
(check the files before anything is changed) and ``_read`` (fill arrays with ranges of the saved
tensors). hybrid's own directories are read by :class:`hybrid.checkpoint.Checkpoint`; torch DCP
and orbax directories by the readers of ``hybrid.checkpoint.dcp`` and ``hybrid.checkpoint.orbax``
(``hybrid.checkpoint.open_checkpoint`` picks one), which present their tensors in the same terms.
"""

from __future__ import annotations

import pathlib

import numpy as np

from hybrid.core import FlatShardPlan, ReshardPlan, reshard
from hybrid.checkpoint._dtypes import storage_dtype
from hybrid.checkpoint._manifest import CheckpointError, Manifest


class CheckpointReader:
    """A checkpoint opened for reading (see the module docstring).

    Subclasses set ``path`` (the directory, named in errors), ``manifest`` and ``format``
    (``"hybrid"``, ``"dcp"``, ``"orbax"``), and implement :meth:`verify` and :meth:`_read`.
    """

    path: pathlib.Path
    manifest: Manifest
    format: str = "hybrid"

    def verify(self, ranks=None) -> None:
        """Check the files holding the slices of ``ranks`` (default all) before anything changes."""
        raise NotImplementedError

    def _read(self, requests: dict[int, list[tuple[str, int, np.ndarray]]]) -> None:
        """Fill arrays from the files: ``requests[rank]`` lists ``(key, first element, out)``, the
        elements ``[first, first + len(out))`` of tensor ``key`` (``"params/0"``, ``"mu/3"``,
        ``"buffers/NAME"``) of rank ``rank``'s slice into the 1-D array ``out`` (stored dtype)."""
        raise NotImplementedError

    def kinds(self) -> list[str]:
        """What is saved per bucket: ``"params"`` and the optimizer's slots."""
        return ["params", *([] if self.manifest.optimizer is None else self.manifest.optimizer.slots)]

    def reshard_to(self, dst: FlatShardPlan) -> ReshardPlan:
        return reshard(self.manifest.shards, dst)

    def slices(self, kind: str, plan: ReshardPlan, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s slices of every bucket of ``plan.dst`` for ``kind`` (stored dtypes)."""
        return self.slices_of([kind], plan, [rank])[kind, rank]

    def slices_of(self, kinds, plan: ReshardPlan, ranks) -> dict[tuple[str, int], list[np.ndarray]]:
        """``{(kind, rank): slices}``: :meth:`slices` for several kinds and destination ranks,
        read together (the files in parallel threads, each file's ranges in file order)."""
        requests: dict[int, list] = {}
        out = {(kind, rank): self._request_slices(kind, plan, rank, requests) for kind in kinds for rank in ranks}
        self._read(requests)
        return out

    def _request_slices(self, kind: str, plan: ReshardPlan, rank: int, requests: dict[int, list]) -> list[np.ndarray]:
        """Destination rank ``rank``'s slices, one array per bucket, their reads added to
        ``requests`` (by source file); padding is zero."""
        sizes = plan.dst.shard_sizes
        out = [np.empty(n, storage_dtype(b.dtype)) for n, b in zip(sizes, plan.dst.bucket_plan.buckets)]
        filled = [0] * len(sizes)  # copies come sorted by destination: what lies between is padding
        for c in plan.copies(rank):
            flat = out[c.dst_bucket]
            flat[filled[c.dst_bucket]:c.dst_start] = 0
            requests.setdefault(c.src_rank, []).append(
                (f"{kind}/{c.src_bucket}", c.src_start, flat[c.dst_start:c.dst_start + c.length]))
            filled[c.dst_bucket] = c.dst_start + c.length
        for b, n in enumerate(sizes):
            out[b][filled[b]:] = 0
        return out

    def tensors(self, kind: str, names=None) -> dict[str, np.ndarray]:
        """The tensors of ``kind`` (default every one) whole, by name, in registration order
        (stored dtypes); each is read straight from the files into its own array."""
        plan, shards = self.manifest.plan, self.manifest.shards
        out, requests = {}, {}
        for i, spec in enumerate(plan.specs):
            if names is not None and spec.name not in names:
                continue
            b, position = plan.locate(i)
            offset, size = plan.buckets[b].offsets[position], shards.shard_sizes[b]
            array = np.empty(spec.numel, storage_dtype(spec.dtype))
            k = 0
            while k < spec.numel:  # the runs of the tensor in consecutive ranks' slices
                rank, start = divmod(offset + k, size)
                n = min(spec.numel - k, size - start)
                requests.setdefault(rank, []).append((f"{kind}/{b}", start, array[k:k + n]))
                k += n
            out[spec.name] = array.reshape(spec.shape)
        self._read(requests)
        return out

    def buffers(self) -> dict[str, np.ndarray]:
        """The replicated buffers by name, whole (stored dtypes), from rank 0's file."""
        if not self.manifest.buffers:
            return {}
        out = {name: np.empty(entry["shape"], storage_dtype(entry["dtype"]))
               for name, entry in self.manifest.buffers.items()}
        self._read({0: [(f"buffers/{name}", 0, a.reshape(-1)) for name, a in out.items()]})
        return out

    def run_state(self) -> dict:
        """What the run saved beside the tensors (``"scheduler"``, ``"state"``), once the manifest
        is known to be the one the files were written for."""
        self.verify([0])
        return dict(self.manifest.run_state)

    def scheduler_state(self) -> dict:
        """The LR scheduler's ``state_dict()`` the checkpoint holds, or a CheckpointError that
        names the format read and why it holds none (:meth:`_no_scheduler`)."""
        state = self.manifest.run_state.get("scheduler")
        if state is None:
            raise CheckpointError(f"{self.path}: this {self.format} checkpoint holds no LR scheduler state "
                                  f"({self._no_scheduler()})")
        return state

    def _no_scheduler(self) -> str:
        return f"the {self.format} format keeps none hybrid reads"

    def check_buffers(self, shapes: dict[str, tuple], *, what: str) -> None:
        """Raise CheckpointError unless ``shapes`` (name -> shape) are the checkpoint's buffers."""
        saved = {n: tuple(e["shape"]) for n, e in self.manifest.buffers.items()}
        missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
        if missing or extra:
            raise CheckpointError(f"{self.path}: buffers differ: {what} has {missing} which the checkpoint lacks, "
                                  f"the checkpoint has {extra} which {what} lacks")
        for name, shape in shapes.items():
            if tuple(shape) != saved[name]:
                raise CheckpointError(f"{self.path}: buffer {name!r} is {list(saved[name])} in the checkpoint and "
                                      f"{list(shape)} in {what}")

    def check_model(self, specs, *, what: str) -> None:
        """Raise CheckpointError unless ``specs`` hold the checkpoint's tensors (names, shapes, dtypes)."""
        saved = {s.name: s for s in self.manifest.plan.specs}
        mine = {s.name: s for s in specs}
        missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
        if missing or extra:
            raise CheckpointError(f"{self.path}: saved from another model: {what} has {missing} which the "
                                  f"checkpoint lacks, the checkpoint has {extra} which {what} lacks")
        for name, s in mine.items():
            t = saved[name]
            if (s.shape, s.dtype) != (t.shape, t.dtype):
                raise CheckpointError(f"{self.path}: tensor {name!r} is {t.dtype}{list(t.shape)} in the "
                                      f"checkpoint and {s.dtype}{list(s.shape)} in {what}")
