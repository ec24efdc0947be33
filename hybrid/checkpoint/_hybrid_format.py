"""hybrid's own format as a plug-in: a ``manifest.json`` and one safetensors file per rank, read
by :class:`hybrid.checkpoint.Checkpoint` and written by :func:`hybrid.checkpoint.save_arrays`.
Neither imports torch or JAX."""

from __future__ import annotations

import pathlib

from hybrid.core import plan_buckets
from hybrid.checkpoint._files import Checkpoint
from hybrid.checkpoint._manifest import MANIFEST
from hybrid.checkpoint._plugin import CheckpointFormat
from hybrid.checkpoint._protocol import previous, resolve
from hybrid.checkpoint._write import save_arrays


class HybridFormat(CheckpointFormat):
    name = "hybrid"
    signature = "manifest.json (hybrid)"

    def detect(self, path) -> bool:
        target = resolve(path)
        if (target / MANIFEST).exists() or (previous(path) / MANIFEST).exists():  # a save in progress too
            return True
        # hybrid's files without a manifest: its reader says why
        return target.is_dir() and any(target.glob("rank-*.safetensors"))

    def open(self, path, *, step=None, param_names=None, **options) -> Checkpoint:
        del param_names  # the manifest tells parameters from buffers
        if step is not None or options:
            raise ValueError(f"open_checkpoint: {sorted(['step'] * (step is not None) + list(options))} are for "
                             f"foreign checkpoints; {path} is hybrid's own")
        return Checkpoint(path)

    def writer(self, source, *, world_size: int = 1, **options):
        """Every tensor read whole, then written as ``world_size`` rank files by ``save_arrays``
        (the plan replanned over the saved tensors, whatever format they came from)."""
        del options
        m = source.manifest
        source.verify()
        params = source.tensors("params")
        slots = {s: source.tensors(s) for s in (m.optimizer.slots if m.optimizer else ())}
        buffers = source.buffers()
        metadata = {**m.metadata, "converted_from": source.format}

        def write(path: pathlib.Path) -> None:
            save_arrays(path, params, world_size=world_size, step=m.step, slots=slots, optimizer=m.optimizer,
                        plan=plan_buckets(m.plan.specs), framework=m.framework, metadata=metadata,
                        buffers=buffers, run_state=dict(m.run_state),
                        buffer_dtypes={n: e["dtype"] for n, e in m.buffers.items()})
        return write


FORMAT = HybridFormat()
