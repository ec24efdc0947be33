"""A torch DCP checkpoint (``torch.distributed.checkpoint.save`` of ``get_state_dict(model,
optimizer)``, from FSDP2, DDP or a plain model, at any world size) read as hybrid reads its own.

The metadata is read without trusting it (``_metadata.py``) and its entries sorted into model,
optimizer and step (``_layout.py``); the manifest then describes them in hybrid's terms: torch's
state keys as slots (``exp_avg`` -> ``mu``, ...), each parameter's step count, its param groups'
hyperparameters with their parameters' names. A read fills a range of a tensor from the chunks
that hold it (each rank's shard, as FSDP2 wrote it): only the chunks overlapping the range are
read, each with ``torch.load(weights_only=True)`` as torch's own reader does.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib

import numpy as np
import torch

from hybrid.core import TensorSpec, canonical_dtype
from hybrid.checkpoint._foreign import ForeignCheckpoint, check_step, foreign_manifest
from hybrid.checkpoint._manifest import CheckpointError, OptimizerInfo
from hybrid.checkpoint.dcp._layout import DcpLayout, classify
from hybrid.checkpoint.dcp._metadata import METADATA, checked_files, read_metadata
from hybrid.checkpoint.torch._state import SLOT_OF_TORCH_KEY, TORCH_KEY_OF_SLOT, _numpy, optimizer_info

_ADAM_KEYS = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
_KNOWN = "torch's Adam / AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq) and SGD with momentum (momentum_buffer)"


# Where torchtitan (``lr_scheduler``) and torch's recipes (``scheduler``) keep an LR scheduler's state.
_SCHEDULER_KEYS = ("lr_scheduler", "lr_schedulers", "scheduler")


def _scheduler_in(tree: dict) -> tuple[tuple, dict] | None:
    """``(sub-path, state)`` of an LR scheduler's ``state_dict()`` in ``tree``: itself, or its one
    child (a container of schedulers that saves ``{"lr_scheduler_0": ...}``)."""
    if "last_epoch" in tree and "base_lrs" in tree:
        return (), tree
    if len(tree) == 1:
        (key, child), = tree.items()
        if isinstance(child, dict) and "last_epoch" in child and "base_lrs" in child:
            return (key,), child
    return None


def _jsonable(v) -> bool:
    return isinstance(v, (int, float, bool, str)) or v is None or (
        isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v))


class DcpCheckpoint(ForeignCheckpoint):
    """A DCP checkpoint directory, opened for reading (see the module docstring).

    Args:
      path: the directory ``dcp.save`` wrote (``.metadata`` and ``__R_0.distcp`` files).
      step: the training step, for a checkpoint that records none (an entry named ``step``, or
        Adam's per-parameter step counts when they agree).
      param_names: the receiving model's parameter names: they are parameters even where the
        optimizer does not step them; the model's other tensors are buffers.
      model_key: where the model's entries lie (``"model"``, ``"app.model"``, ``""`` for the top
        level), where it cannot be told from the optimizer's parameters.

    >>> import os, tempfile, torch, torch.distributed.checkpoint as dcp
    >>> from torch.distributed.checkpoint.state_dict import get_state_dict
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> model_sd, optim_sd = get_state_dict(model, opt)
    >>> d = os.path.join(tempfile.mkdtemp(), "dcp")
    >>> _ = dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=d, no_dist=True)
    >>> ckpt = DcpCheckpoint(d)
    >>> ckpt.manifest.step, ckpt.manifest.optimizer.name, ckpt.manifest.optimizer.slots
    (1, 'adam', ('mu', 'nu'))
    >>> torch.equal(torch.from_numpy(ckpt.tensors("mu")["weight"]), opt.state[model.weight]["exp_avg"])
    True
    """

    def __init__(self, path: str | os.PathLike, *, step: int | None = None, param_names=None,
                 model_key: str | None = None):
        path = pathlib.Path(os.path.realpath(path))
        self._metadata = read_metadata(path)
        self._sizes = checked_files(path, self._metadata)  # before anything else is opened
        self._items: dict[str, dict] = {}
        for index, info in self._metadata.storage_data.items():
            offset = None if index.offset is None else tuple(index.offset)
            self._items.setdefault(index.fqn, {})[offset] = info
        self.path = path
        entries = self._metadata.state_dict_metadata
        self.layout = classify(list(entries), self._metadata.planner_data, self._is_tensor, self._value,
                               where=str(path), param_names=param_names, model_key=model_key)
        from hybrid.checkpoint._dtypes import check_storable
        check_storable({name: entries[key].properties.dtype for name, key in
                        [*self.layout.model.items(), *self.layout.buffers.items()]}, where=str(path))
        specs = [self._spec(name, key) for name, key in self.layout.model.items()]
        optimizer = self._optimizer([s.name for s in specs])
        recorded = self._recorded_step()
        if recorded is None and step is None and optimizer is not None and optimizer.count and not optimizer.counts:
            recorded = optimizer.count  # Adam's steps, which agree: one optimizer step per training step
        step = check_step(recorded, step, where=str(path), what="no entry named 'step' and no Adam step counts")
        if optimizer is not None and optimizer.name == "sgd":
            optimizer = dataclasses.replace(optimizer, count=step)  # SGD counts no steps: the run's, as torch saves
        buffers = {n: (tuple(entries[k].size), canonical_dtype(entries[k].properties.dtype))
                   for n, k in self.layout.buffers.items()}
        run_state, left_out, scheduler_path = self._other_state()
        manifest = foreign_manifest("torch", specs, step=step, optimizer=optimizer, buffers=buffers,
                                    metadata={"format": "dcp", "left_out": left_out,
                                              "dcp_layout": {**self.layout.writes_as(), "scheduler": scheduler_path}},
                                    run_state=run_state)
        super().__init__(path, manifest, "dcp")
        self._checked = True  # checked_files ran above

    # -- entries ---------------------------------------------------------------------------------

    def _is_tensor(self, key: str) -> bool:
        return hasattr(self._metadata.state_dict_metadata[key], "chunks")

    def _bytes(self, info) -> io.BytesIO:
        """An item's bytes (through the extensions that wrote it, e.g. compression)."""
        fd = os.open(self.path / info.relative_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            data = os.pread(fd, int(info.length), int(info.offset))
        finally:
            os.close(fd)
        if len(data) != int(info.length):
            raise CheckpointError(f"{self.path / info.relative_path}: ends before the {info.length} bytes the metadata "
                                  f"records at offset {info.offset}")
        stream: io.IOBase = io.BytesIO(data)
        if getattr(info, "transform_descriptors", None):
            from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
            stream = io.BytesIO(_StorageReaderTransforms().transform_load_stream(None, info.transform_descriptors,
                                                                                 stream).read())
        return stream

    def _value(self, key: str):
        """A bytes entry's value (a hyperparameter, a list of names): weights-only unpickling."""
        (info,) = self._items[key].values()
        try:
            return torch.load(self._bytes(info), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - named, with what it is
            raise CheckpointError(f"{self.path}: entry {key!r} cannot be read as plain data ({type(e).__name__}: "
                                  f"{e})") from None

    def _scalar(self, key: str) -> float:
        if self._is_tensor(key):
            return float(self._whole(key).reshape(-1)[0])
        value = self._value(key)
        return float(value.item() if torch.is_tensor(value) else value)

    def _spec(self, name: str, key: str) -> TensorSpec:
        meta = self._metadata.state_dict_metadata[key]
        return TensorSpec(name, tuple(int(d) for d in meta.size), canonical_dtype(meta.properties.dtype))

    def _recorded_step(self) -> int | None:
        keys = self.layout.step_keys
        values = {k: self._scalar(k) for k in keys}
        if len(set(values.values())) > 1:
            raise CheckpointError(f"{self.path}: holds several training steps {values}: which one is the run's?")
        return int(next(iter(values.values()))) if values else None

    # -- the run's other state ---------------------------------------------------------------------

    def _no_scheduler(self) -> str:
        tops = sorted({str(p[0]) for p in self.layout.paths.values() if len(p) > 1})
        return (f"no entry {' / '.join(_SCHEDULER_KEYS)} holding an LR scheduler's state_dict() (base_lrs, "
                f"last_epoch) beside the model; its nested entries are {tops}")

    def _other_state(self) -> tuple[dict, list[str], list | None]:
        """``(run_state, left out, the scheduler's path)``: the LR scheduler's state (an entry named
        as torchtitan's ``lr_scheduler``, or ``scheduler``, holding ``last_epoch``) for
        ``load(..., scheduler=)``, and every other entry beside the model, the optimizer and the
        step (a data loader's, a train state) carried; what is not plain data is left out, named."""
        from hybrid.checkpoint._other_state import CARRIED, Tensor, encode, nest
        from hybrid.checkpoint._write import check_json

        paths = self.layout.paths
        keys = list(self.layout.left_out) + [k for k in self.layout.step_keys if paths[k] != ("step",)]
        values, left_out = {}, []
        for k in keys:
            try:
                if self._is_tensor(k):
                    meta = self._metadata.state_dict_metadata[k]
                    dtype = canonical_dtype(meta.properties.dtype)
                    values[k] = Tensor(dtype, self._whole(k).reshape(tuple(meta.size)))
                else:
                    values[k] = self._value(k)
                encode(values[k])
            except (CheckpointError, TypeError, ValueError) as e:
                values.pop(k, None)
                left_out.append(f"{k} ({e})")
        run_state, scheduler_path = {}, None
        for top in _SCHEDULER_KEYS:
            mine = {k: v for k, v in values.items() if paths[k][0] == top and len(paths[k]) > 1}
            found = _scheduler_in(nest([(paths[k][1:], v) for k, v in mine.items()])) if mine else None
            if found is None:
                continue
            sub, state = found
            try:
                check_json(state, "scheduler")
            except ValueError:
                continue  # not JSON (a tensor in it?): carried as it is instead
            run_state["scheduler"], scheduler_path = state, [top, *sub]
            values = {k: v for k, v in values.items() if paths[k][:1 + len(sub)] != (top, *sub)}
            break
        if values:
            run_state[CARRIED] = {"from": "dcp", "entries": [{"path": list(paths[k]), "value": encode(v)}
                                                              for k, v in values.items()]}
        return run_state, left_out, scheduler_path

    # -- the optimizer ---------------------------------------------------------------------------

    def _optimizer(self, names: list[str]) -> OptimizerInfo | None:
        layout: DcpLayout = self.layout
        if not layout.groups and not layout.state:
            return None
        keys: dict[str, set] = {}  # torch state key -> parameters holding it
        for name, held in layout.state.items():
            for key, entry in held.items():
                if key != "step" and (self._is_tensor(entry) or self._value(entry) is not None):
                    keys.setdefault(key, set()).add(name)
        name, expected = self._identify(set(keys))
        counts = {n: int(self._scalar(held["step"])) for n, held in layout.state.items() if "step" in held}
        groups = []
        for g in layout.groups:  # JSON holds what torch's load_state_dict restores; a tensor lr stays the optimizer's
            hyper = {k: v for k, v in g.items() if k != "param_names"}
            kept = {k: (list(v) if isinstance(v, tuple) else v) for k, v in hyper.items() if _jsonable(v)}
            not_saved = sorted(k for k, v in hyper.items() if not _jsonable(v))
            groups.append({**kept, **({"not_saved": not_saved} if not_saved else {}), "param_names": g["param_names"]})
        holders = {SLOT_OF_TORCH_KEY[k]: v for k, v in keys.items()}
        return optimizer_info(name, expected, {"param_groups": groups}, names, counts, holders, sgd_count=0)

    def _identify(self, keys: set[str]) -> tuple[str, tuple[str, ...]]:
        """``(hybrid's optimizer name, its slots)`` from the state keys and param groups, or a
        CheckpointError naming what no optimizer hybrid reads keeps."""
        groups = self.layout.groups
        where = f"{self.path}"
        unknown = sorted(keys - _ADAM_KEYS - {"momentum_buffer"})
        if unknown:
            example = next(n for n, held in self.layout.state.items() if unknown[0] in held)
            raise CheckpointError(f"{where}: the optimizer state holds {unknown} (e.g. of {example!r}), which no "
                                  f"optimizer hybrid reads keeps: it reads {_KNOWN}")
        group_keys = set().union(*(g.keys() for g in groups)) if groups else set()
        if keys & _ADAM_KEYS or (not keys and "amsgrad" in group_keys):
            if not {"exp_avg", "exp_avg_sq"} <= keys and keys:
                raise CheckpointError(f"{where}: the optimizer state holds {sorted(keys)}: Adam keeps exp_avg and "
                                      f"exp_avg_sq together")
            if any("amsgrad" not in g for g in groups) or not groups:
                raise CheckpointError(f"{where}: holds Adam-like state (exp_avg, exp_avg_sq) but its param groups "
                                      f"lack 'amsgrad', which torch's Adam and AdamW keep: another optimizer "
                                      f"(RAdam? NAdam?), which hybrid does not read")
            decoupled = {bool(g.get("decoupled_weight_decay", False)) for g in groups}
            if len(decoupled) > 1:
                raise CheckpointError(f"{where}: param groups differ in decoupled_weight_decay: one optimizer is "
                                      f"Adam or AdamW, not both")
            slots = ("mu", "nu", "max_nu") if any(g.get("amsgrad") for g in groups) else ("mu", "nu")
            return ("adamw" if decoupled.pop() else "adam"), slots
        if keys == {"momentum_buffer"} or (not keys and "nesterov" in group_keys):
            if any("nesterov" not in g or "dampening" not in g for g in groups):
                raise CheckpointError(f"{where}: holds a momentum buffer but its param groups lack SGD's nesterov "
                                      f"and dampening: another optimizer, which hybrid does not read")
            return "sgd", ("trace",) if any(g.get("momentum") for g in groups) else ()
        described = sorted(group_keys - {"param_names"})
        raise CheckpointError(f"{where}: holds an optimizer whose param groups have {described} and no state hybrid "
                              f"knows: it reads {_KNOWN}")

    # -- reads -----------------------------------------------------------------------------------

    def _key(self, kind: str, name: str) -> str | None:
        if kind == "params":
            return self.layout.model[name]
        if kind == "buffers":
            return self.layout.buffers[name]
        return self.layout.state.get(name, {}).get(TORCH_KEY_OF_SLOT.get(kind, kind))

    def _chunk(self, key: str, chunk) -> np.ndarray:
        """One stored chunk of tensor ``key``, flat, in its stored dtype."""
        info = self._items[key].get(tuple(chunk.offsets))
        if info is None:
            raise CheckpointError(f"{self.path / METADATA}: records chunk {list(chunk.offsets)} of {key!r} but not "
                                  f"where it is stored")
        try:
            tensor = torch.load(self._bytes(info), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - named
            raise CheckpointError(f"{self.path / info.relative_path}: the chunk of {key!r} at bytes {info.offset}.."
                                  f"{info.offset + info.length} cannot be read ({type(e).__name__}: {e})") from None
        if not torch.is_tensor(tensor) or tuple(tensor.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"{self.path / info.relative_path}: the chunk of {key!r} holds "
                                  f"{getattr(tensor, 'shape', type(tensor).__name__)}, the metadata says "
                                  f"{list(chunk.sizes)}: the file is corrupt or was replaced")
        return _numpy(tensor).reshape(-1)

    def _whole(self, key: str) -> np.ndarray:
        meta = self._metadata.state_dict_metadata[key]
        out = np.empty(math.prod(meta.size), _numpy(torch.empty(0, dtype=meta.properties.dtype)).dtype)
        self._fill_key(key, [(0, out)])
        return out

    def _fill(self, kind: str, name: str, ranges) -> None:
        key = self._key(kind, name)
        if key is None:  # no such state for this parameter (none yet): zeros, as hybrid stores them
            for _, out in ranges:
                out[:] = 0
            return
        self._fill_key(key, ranges)

    def _fill_key(self, key: str, ranges) -> None:
        meta = self._metadata.state_dict_metadata[key]
        shape = tuple(int(d) for d in meta.size)
        for chunk in meta.chunks:
            runs = _Runs(shape, tuple(chunk.offsets), tuple(chunk.sizes))
            hits = [(first, out) for first, out in ranges if runs.overlaps(first, first + len(out))]
            if hits:
                runs.copy(self._chunk(key, chunk), hits)


class _Runs:
    """Where a chunk (``offsets``, ``sizes``) of a row-major tensor of ``shape`` lies in the flat
    tensor: runs of ``length`` contiguous elements at ``starts`` (one run for FSDP2's row shards)."""

    def __init__(self, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]):
        ndim = len(shape)
        self.empty = math.prod(sizes) == 0
        if ndim == 0:  # a scalar (Adam's step): one element
            self.length, self.starts = 1, np.zeros(1, np.int64)
            return
        strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
        j = ndim - 1
        while j >= 1 and sizes[j] == shape[j]:  # trailing whole dims merge into one run
            j -= 1
        self.length = sizes[j] * strides[j]
        lead = np.indices(sizes[:j]).reshape(j, -1).T if j else np.zeros((1, 0), np.int64)
        self.starts = offsets[j] * strides[j] + (lead + np.asarray(offsets[:j], np.int64)) @ np.asarray(
            strides[:j], np.int64)

    def overlaps(self, a: int, b: int) -> bool:
        return not self.empty and bool(self.starts[0] < b and self.starts[-1] + self.length > a)

    def copy(self, flat: np.ndarray, ranges) -> None:
        """Copy the chunk's elements (``flat``, in the chunk's own row-major order) into every
        ``(first, out)`` range of the flat tensor they overlap."""
        for first, out in ranges:
            a, b = first, first + len(out)
            lo = max(int(np.searchsorted(self.starts, a - self.length, side="right")), 0)
            hi = int(np.searchsorted(self.starts, b, side="left"))
            for r in range(lo, hi):
                s = int(self.starts[r])
                x, y = max(a, s), min(b, s + self.length)
                if x < y:
                    out[x - a:y - a] = flat[r * self.length + x - s:r * self.length + y - s]
