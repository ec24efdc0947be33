"""A checkpoint in a JAX tree's names and layouts, read under torch's through a mapping.

An orbax checkpoint of a flax model names its tensors by key path (``Dense_0.kernel``) and lays
them out as flax does (``(in, out)``); a torch module wants ``0.weight`` as ``(out, in)``.
:func:`to_torch_names` wraps the checkpoint in a reader that presents every tensor under its
torch name and layout (a ``hybrid.core.ParamMapping`` resolved against both sides), so torch's
loaders read it as their own: parameters and optimizer slots alike, relaid exactly (transposes).
Buffers keep their names. The other way, a torch-named checkpoint into a JAX tree, is
``hybrid.checkpoint.jax.load(..., mapping=)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hybrid.core import MappingError, ParamMapping, ParamPairing, TensorSpec
from hybrid.checkpoint._foreign import ForeignCheckpoint, copy_ranges, foreign_manifest
from hybrid.checkpoint._manifest import OptimizerInfo
from hybrid.checkpoint._reader import CheckpointReader


def resolve_pairing(mapping, jax_shapes: dict, torch_shapes: dict | None = None) -> ParamPairing:
    """``mapping`` (a ParamMapping, or a ParamPairing checked against them) resolved for the JAX
    tensors ``{name: shape}`` and, where known, torch's."""
    if isinstance(mapping, ParamMapping):
        return mapping.pair(jax_shapes, torch_shapes)
    if not isinstance(mapping, ParamPairing):
        raise TypeError(f"mapping must be a hybrid.core.ParamMapping or ParamPairing, got {type(mapping).__name__}")
    given = {p.jax: p.jax_shape for p in mapping.pairs}
    if given != jax_shapes:
        wrong = sorted(set(given.items()) ^ set(jax_shapes.items()))
        raise MappingError(f"the pairing was made for another tree: (name, shape) in one of them only: {wrong}")
    return mapping


def _renamed_optimizer(info: OptimizerInfo | None, name: dict[str, str]) -> OptimizerInfo | None:
    """``info`` with every parameter name it holds given by ``name`` (JAX -> torch)."""
    if info is None:
        return None
    groups = [{**g, "param_names": [name[n] for n in g["param_names"]]} if "param_names" in g else g
              for g in info.hyperparameters.get("param_groups", ())]
    hyper = {**info.hyperparameters, **({"param_groups": groups} if groups else {})}
    return dataclasses.replace(info, hyperparameters=hyper, without_state=tuple(name[n] for n in info.without_state),
                               counts={name[n]: c for n, c in info.counts.items()},
                               slot_params={s: tuple(name[n] for n in ns) for s, ns in info.slot_params.items()})


class _TorchNamed(ForeignCheckpoint):
    """``base`` under torch's names and layouts (see the module docstring)."""

    def __init__(self, base: CheckpointReader, pairing: ParamPairing):
        self.base, self.pairing = base, pairing
        saved = {s.name: s for s in base.manifest.plan.specs}
        specs = [TensorSpec(p.torch, p.torch_shape, saved[p.jax].dtype) for p in pairing.pairs]
        names = {p.jax: p.torch for p in pairing.pairs}
        buffers = {n: (tuple(e["shape"]), e["dtype"]) for n, e in base.manifest.buffers.items()}
        manifest = foreign_manifest(base.manifest.framework, specs, step=base.manifest.step,
                                    optimizer=_renamed_optimizer(base.manifest.optimizer, names), buffers=buffers,
                                    metadata={**base.manifest.metadata, "mapped_from": "jax names"})
        super().__init__(base.path, dataclasses.replace(manifest, run_state=dict(base.manifest.run_state)),
                         base.format)
        self._by_torch = {p.torch: p for p in pairing.pairs}

    def _check_files(self) -> None:
        self.base.verify()

    def _fill(self, kind: str, name: str, ranges) -> None:
        if kind == "buffers":
            copy_ranges(self.base.buffers()[name].reshape(-1), ranges)
            return
        pair = self._by_torch[name]
        whole = self.base.tensors(kind, [pair.jax])[pair.jax]
        copy_ranges(np.ascontiguousarray(pair.layout.to_torch(whole)).reshape(-1), ranges)


def to_torch_names(checkpoint: CheckpointReader, mapping, torch_shapes: dict | None = None) -> CheckpointReader:
    """``checkpoint`` (in a JAX tree's names and layouts) read under torch's, through ``mapping``.

    Args:
      checkpoint: an opened checkpoint (``hybrid.checkpoint.open_checkpoint``).
      mapping: a ``hybrid.core.ParamMapping`` or a resolved ``ParamPairing``.
      torch_shapes: the torch module's ``{name: shape}`` (its names decide between a rule's
        candidates, and its shapes are checked); None: torch's names as the rules give them.

    >>> import numpy as np, os, tempfile
    >>> from hybrid.checkpoint import save_arrays, open_checkpoint
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> kernel = np.arange(6, dtype=np.float32).reshape(2, 3)      # flax Dense: (in, out)
    >>> _ = save_arrays(d, {"Dense_0.kernel": kernel, "Dense_0.bias": np.zeros(3, np.float32)})
    >>> torch_named = to_torch_names(open_checkpoint(d), ParamMapping.flax(renames={"Dense_0": "fc"}))
    >>> weight = torch_named.tensors("params")["fc.weight"]           # torch Linear: (out, in)
    >>> weight.shape, np.array_equal(weight, kernel.T)
    ((3, 2), True)
    """
    jax_shapes = {s.name: s.shape for s in checkpoint.manifest.plan.specs}
    return _TorchNamed(checkpoint, resolve_pairing(mapping, jax_shapes, torch_shapes))
