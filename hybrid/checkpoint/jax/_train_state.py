"""A checkpoint as the train state a JAX run restores: ``{"params", "opt_state", "step"}`` (the
fields of flax's ``TrainState``, so a ``TrainState`` restores from it too), what hybrid writes as
an orbax checkpoint.

Its structure is the one the resuming run restores into: given as ``like=(params, opt_state)``
(what the run's ``model.init`` and ``tx.init`` make, placed and sharded as the arrays should be
written; with ``mapping=`` for a torch-named checkpoint), and this package's loader fills it.
Without ``like`` the params are nested dicts of the checkpoint's names and the state is what
``optax_from_manifest`` (a torch optimizer's param groups) or else ``optax.adam`` / ``adamw`` /
``sgd(momentum=)`` initialise: build the same transform to restore.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from hybrid.checkpoint._manifest import CheckpointError
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint.jax._load import load
from hybrid.checkpoint.jax._optax_groups import optax_from_manifest


def _nested(names_and_values) -> dict:
    tree: dict = {}
    for name, value in names_and_values:
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def default_like(ckpt: CheckpointReader):
    """``(params, opt_state)`` zeros in the layout a checkpoint's names and optimizer suggest."""
    params = _nested((s.name, jnp.zeros(s.shape, s.dtype)) for s in ckpt.manifest.plan.specs)
    info = ckpt.manifest.optimizer
    if info is None:
        return params, None
    if info.hyperparameters.get("param_groups"):
        return params, optax_from_manifest(ckpt.manifest, params).init(params)
    if info.name in ("adam", "adamw"):
        return params, getattr(optax, info.name)(0.0).init(params)
    if info.name == "sgd" and info.slots:
        return params, optax.sgd(0.0, momentum=0.9).init(params)
    raise CheckpointError(f"{ckpt.path}: holds {info.name!r} state; pass like=(params, opt_state) to say where it goes")


def train_state(ckpt: CheckpointReader, *, like=None, mapping=None) -> dict:
    """``{"params", "opt_state", "step"}`` filled from the opened checkpoint ``ckpt`` (everything
    checked and read first), laid out like ``like`` (see the module docstring)."""
    if like is None:
        if mapping is not None:
            raise ValueError("write_orbax: a mapping places torch's tensors into a JAX tree: pass like=(params, "
                             "opt_state), the tree and state the resuming run builds")
        like = default_like(ckpt)
    params, opt_state = like
    params, opt_state, step = load(ckpt, params, opt_state, mapping=mapping)
    tree = {"params": params, "step": step}
    if opt_state is not None:
        tree["opt_state"] = opt_state
    return tree
