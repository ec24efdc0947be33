"""Writing a checkpoint (any format hybrid reads) as an orbax checkpoint that orbax's own
``StandardCheckpointer().restore(path, target)`` gives back as a flax train state.

The tree written is ``{"params": params, "opt_state": optax state, "step": step}`` (the fields
of flax's ``TrainState``, so a ``TrainState`` restores from it too), saved by orbax's
``StandardCheckpointer``. Its structure is the one the resuming run restores into: give it as
``like=(params, opt_state)`` (what the run's ``model.init`` and ``tx.init`` make, placed and
sharded as the arrays should be written; with ``mapping=`` for a torch-named checkpoint), and
hybrid's JAX loader fills it. Without ``like`` the params are nested dicts of the checkpoint's
names and the state is what ``optax_from_manifest`` (a torch optimizer's param groups) or else
``optax.adam`` / ``adamw`` / ``sgd(momentum=)`` initialise: build the same transform to restore.
"""

from __future__ import annotations

import os

from hybrid.checkpoint._formats import open_checkpoint
from hybrid.checkpoint._manifest import CheckpointError


def _nested(names_and_values) -> dict:
    tree: dict = {}
    for name, value in names_and_values:
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def default_like(ckpt):
    """``(params, opt_state)`` zeros in the layout a checkpoint's names and optimizer suggest."""
    import jax.numpy as jnp
    import optax

    params = _nested((s.name, jnp.zeros(s.shape, s.dtype)) for s in ckpt.manifest.plan.specs)
    info = ckpt.manifest.optimizer
    if info is None:
        return params, None
    if info.hyperparameters.get("param_groups"):
        from hybrid.checkpoint.jax import optax_from_manifest
        return params, optax_from_manifest(ckpt.manifest, params).init(params)
    if info.name in ("adam", "adamw"):
        return params, getattr(optax, info.name)(0.0).init(params)
    if info.name == "sgd" and info.slots:
        return params, optax.sgd(0.0, momentum=0.9).init(params)
    raise CheckpointError(f"{ckpt.path}: holds {info.name!r} state; pass like=(params, opt_state) to say where it goes")


def orbax_tree(checkpoint, *, like=None, mapping=None) -> dict:
    """The tree :func:`write_orbax` saves: ``{"params", "opt_state", "step"}`` filled from the
    checkpoint (everything checked and read first)."""
    from hybrid.checkpoint import jax as ckpt_jax

    ckpt = open_checkpoint(checkpoint)
    if like is None:
        if mapping is not None:
            raise ValueError("write_orbax: a mapping places torch's tensors into a JAX tree: pass like=(params, "
                             "opt_state), the tree and state the resuming run builds")
        like = default_like(ckpt)
    params, opt_state = like
    params, opt_state, step = ckpt_jax.load(ckpt, params, opt_state, mapping=mapping)
    tree = {"params": params, "step": step}
    if opt_state is not None:
        tree["opt_state"] = opt_state
    return tree


def write_orbax(checkpoint, path: str | os.PathLike, *, like=None, mapping=None) -> None:
    """Write ``checkpoint`` (a path or an opened checkpoint) as an orbax checkpoint at ``path``,
    with orbax's own ``StandardCheckpointer``; ``path`` must not exist (``hybrid.checkpoint
    .convert`` leaves nothing there unless the write completes).

    Args:
      like: ``(params, opt_state)`` in the structure, dtypes and shardings to write (the
        resuming run's ``init``); default: see the module docstring.
      mapping: a ``hybrid.core.ParamMapping`` for a checkpoint in torch's names and layouts.

    >>> import os, tempfile, numpy as np, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    >>> from hybrid.checkpoint import jax as ckpt
    >>> params = {"w": jnp.arange(6.0).reshape(2, 3)}
    >>> state = optax.adam(0.1).init(params)
    >>> root = tempfile.mkdtemp(); _ = ckpt.save(os.path.join(root, "h"), params, state, step=4)
    >>> write_orbax(os.path.join(root, "h"), os.path.join(root, "orbax"), like=(params, state))
    >>> with ocp.StandardCheckpointer() as checkpointer:
    ...     back = checkpointer.restore(os.path.join(root, "orbax"), {"params": params, "opt_state": state, "step": 0})
    >>> int(back["step"]), np.array_equal(back["params"]["w"], params["w"])
    (4, True)
    """
    import orbax.checkpoint as ocp

    if os.path.lexists(path):
        raise FileExistsError(f"write_orbax: {path} exists")
    tree = orbax_tree(checkpoint, like=like, mapping=mapping)
    with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the save and ends its threads
        checkpointer.save(os.path.abspath(path), tree)
