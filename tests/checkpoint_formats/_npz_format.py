"""A format written for the registry's test: one ``arrays.npz`` of parameters by name and the step,
nothing else. It is what a new format takes: a reader (a ``ForeignCheckpoint`` that fills ranges
of named tensors), a writer, and ``FORMAT``; registered by name, it is recognised, opened,
converted to and from like the built-in ones."""

from __future__ import annotations

import pathlib

import numpy as np

from hybrid.checkpoint._foreign import ForeignCheckpoint, copy_ranges, foreign_manifest
from hybrid.checkpoint._plugin import CheckpointFormat
from hybrid.core import TensorSpec, canonical_dtype

FILE = "arrays.npz"
STEP = "__step__"


class NpzCheckpoint(ForeignCheckpoint):
    def __init__(self, path, *, step=None):
        path = pathlib.Path(path)
        with np.load(path / FILE) as z:
            self._arrays = {k: z[k] for k in z.files}
        recorded = int(self._arrays.pop(STEP))
        specs = [TensorSpec(n, a.shape, canonical_dtype(a.dtype)) for n, a in self._arrays.items()]
        super().__init__(path, foreign_manifest("numpy", specs, step=recorded if step is None else step,
                                                optimizer=None), "npz")

    def _fill(self, kind, name, ranges):
        copy_ranges(self._arrays[name].reshape(-1), ranges)


class NpzFormat(CheckpointFormat):
    name = "npz"
    signature = f"{FILE} (a test's format)"

    def detect(self, path) -> bool:
        return (pathlib.Path(path) / FILE).is_file()

    def open(self, path, *, step=None, param_names=None, **options):
        del param_names
        return NpzCheckpoint(path, step=step, **options)

    def writer(self, source, **options):
        del options
        source.verify()
        arrays, step = source.tensors("params"), source.manifest.step

        def write(path: pathlib.Path) -> None:
            path.mkdir()
            np.savez(path / FILE, **{STEP: np.asarray(step)}, **arrays)
        return write


FORMAT = NpzFormat()
