"""The optax transform that continues a checkpoint's optimizer, torch's param groups included.

A torch optimizer with several param groups (no weight decay on biases and norms, another lr for
the head) records them in the manifest (``optimizer.hyperparameters["param_groups"]``, with the
parameter names of each group under ``"param_names"``). Resumed in JAX into one ``optax.adamw``,
every leaf would get the first group's decay: :func:`optax_from_manifest` builds the transform
that gives every leaf its own group's hyperparameters instead (``optax.partition`` by group, which
``hybrid.jax.zero`` runs on its flat shards too), keeping one moment state for all leaves so the
checkpoint's slots load into it.
"""

from __future__ import annotations

import os

import jax
import optax

from hybrid.checkpoint._formats import open_checkpoint
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint._manifest import CheckpointError, Manifest
from hybrid.jax._specs import _leaves

# torch's group keys that change nothing in the arithmetic (implementation choices).
_IGNORED = {"params", "param_names", "not_saved", "foreach", "fused", "capturable", "differentiable", "initial_lr"}
_SHARED = {"adam": ("betas", "eps", "decoupled_weight_decay"), "sgd": ("momentum", "nesterov", "dampening")}


def _manifest(checkpoint) -> Manifest:
    if isinstance(checkpoint, Manifest):
        return checkpoint
    if isinstance(checkpoint, CheckpointReader):
        return checkpoint.manifest
    if isinstance(checkpoint, (str, os.PathLike)):
        return open_checkpoint(checkpoint).manifest
    raise TypeError(f"optax_from_manifest: expected a checkpoint path, Checkpoint or Manifest, "
                    f"got {type(checkpoint).__name__}")


def _differing(groups: list[dict]) -> dict:
    keys = sorted({k for g in groups for k in g} - _IGNORED)
    return {k: [g.get(k) for g in groups] for k in keys if len({repr(g.get(k)) for g in groups}) > 1}


def _group_of_leaf(groups: list[dict], names: list[str], where: str) -> list[int]:
    """The group index of every leaf name, from each group's ``param_names``."""
    if len(groups) == 1:
        return [0] * len(names)
    if any("param_names" not in g for g in groups):
        raise CheckpointError(
            f"{where}: holds {len(groups)} param groups that differ in {_differing(groups)} but no "
            f"'param_names' per group (saved by an older hybrid): which leaf belongs to which group "
            f"cannot be known. Build the optax transform by hand (optax.partition by your labels)")
    group_of = {}
    for i, g in enumerate(groups):
        for n in g["param_names"]:
            if n in group_of:
                raise CheckpointError(f"{where}: parameter {n!r} is in param groups {group_of[n]} and {i}")
            group_of[n] = i
    missing = [n for n in names if n not in group_of]
    extra = sorted(set(group_of) - set(names))
    if missing or extra:
        raise CheckpointError(f"{where}: the param groups' names do not match the params tree: leaves in no "
                              f"group {missing}, group names that are no leaf {extra}")
    return [group_of[n] for n in names]


def optax_from_manifest(checkpoint, params, *, mapping=None) -> optax.GradientTransformation:
    """The optax transform continuing a checkpoint's torch optimizer (Adam, AdamW, SGD), group by group.

    Every leaf of ``params`` (named by key path, as the checkpoint names its tensors) gets the lr
    and weight decay of its torch param group: AdamW's decoupled decay (``adamw``), Adam's L2 decay
    added to the gradient before the moments, SGD's L2 decay before its momentum. Hyperparameters
    that live in the one moment state (Adam's betas and eps; SGD's momentum and nesterov) must be
    the same in all groups. Use it as it is or inside ``hybrid.jax.zero``, then load the state with
    ``hybrid.checkpoint.jax.load``.

    Args:
      checkpoint: a checkpoint directory (any format hybrid reads: a torch DCP checkpoint's param
        groups too), an opened checkpoint or its :class:`Manifest`.
      params: the JAX parameter tree the run continues with.
      mapping: a ``hybrid.core.ParamMapping`` (or ``ParamPairing``) where the tree's names are
        not torch's (a flax model): the groups' torch names are placed on its leaves through it.

    Returns:
      An ``optax.GradientTransformation``; a :class:`CheckpointError` names what cannot be
      reproduced (amsgrad, maximize, dampening, groups without ``param_names``, groups differing
      in betas, eps or momentum).

    >>> import dataclasses, jax.numpy as jnp, optax
    >>> from hybrid.checkpoint import Manifest, OptimizerInfo
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> groups = [{"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "param_names": ["w"]},
    ...           {"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "param_names": ["b"]}]
    >>> manifest = Manifest("torch", 1, None, 0, plan_buckets([TensorSpec("w", (2,), "float32")]),
    ...                     OptimizerInfo("adamw", ("mu", "nu"), 0, {"param_groups": groups}), {}, ())
    >>> params = {"w": jnp.ones(2), "b": jnp.ones(2)}
    >>> tx = optax_from_manifest(manifest, params)
    >>> u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    >>> [round(float(x), 6) + 0.0 for x in (u["w"][0], u["b"][0])]  # decay on w only: -lr * wd * w
    [-0.001, 0.0]
    """
    manifest = _manifest(checkpoint)
    where = "optax_from_manifest"
    info = manifest.optimizer
    if info is None:
        raise CheckpointError(f"{where}: the checkpoint holds no optimizer")
    groups = list(info.hyperparameters.get("param_groups") or ())
    if info.name not in ("adam", "adamw", "sgd") or not groups:
        raise CheckpointError(f"{where}: needs the param_groups of a torch Adam, AdamW or SGD; the checkpoint "
                              f"holds {info.name!r} with hyperparameters {sorted(info.hyperparameters)}")
    if mapping is not None:
        groups = _jax_named(groups, mapping, manifest, params)
    return optax_from_param_groups(info.name, groups, params, where=where)


def _jax_named(groups: list[dict], mapping, manifest: Manifest, params) -> list[dict]:
    """``groups`` with their torch parameter names given as the tree's names, through ``mapping``."""
    from hybrid.checkpoint._renamed import resolve_pairing
    names, leaves, _ = _leaves(params)  # an NNX State's arrays by their variables' names
    pairing = resolve_pairing(mapping, {n: tuple(x.shape) for n, x in zip(names, leaves)},
                              {s.name: s.shape for s in manifest.plan.specs})
    jax_name = {p.torch: p.jax for p in pairing.pairs}
    return [{**g, "param_names": [jax_name[n] for n in g["param_names"]]} if "param_names" in g else g
            for g in groups]


def optax_from_param_groups(name: str, groups: list[dict], params, *, where: str = "optax_from_param_groups"
                            ) -> optax.GradientTransformation:
    """The optax transform computing what torch's ``name`` optimizer (``"adam"``, ``"adamw"``,
    ``"sgd"``) computes with these param groups (torch's keys: ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``momentum``, ``nesterov``, ``param_names``); :func:`optax_from_manifest`
    without the checkpoint. A :class:`CheckpointError` names what optax cannot reproduce.

    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.ones(2)}
    >>> tx = optax_from_param_groups("sgd", [{"lr": 0.5, "momentum": 0.9}], params)
    >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> u["w"].tolist()
    [-0.5, -0.5]
    """
    if name not in ("adam", "adamw", "sgd") or not groups:
        raise CheckpointError(f"{where}: needs the param groups of a torch Adam, AdamW or SGD, got {name!r} "
                              f"with {len(groups)} group(s)")
    for i, g in enumerate(groups):
        for key in ("amsgrad", "maximize"):
            if g.get(key):
                raise CheckpointError(f"{where}: param group {i} has {key}=True, which optax's adam/sgd do not reproduce")
        if g.get("dampening"):
            raise CheckpointError(f"{where}: param group {i} has dampening={g['dampening']}; optax's trace has none")
    family = "sgd" if name == "sgd" else "adam"
    shared = {k: v for k, v in _differing(groups).items() if k in _SHARED[family]}
    if shared:
        raise CheckpointError(f"{where}: the param groups differ in {shared}, which one optax {family} state "
                              f"cannot hold; only lr and weight_decay may differ between groups")
    names, _, treedef = _leaves(params)
    group_of = _group_of_leaf(groups, names, where)
    labels = jax.tree_util.tree_unflatten(treedef, [f"group{i}" for i in group_of])
    used = sorted(set(group_of))

    def per_group(make, keys):
        # One transform where the groups agree in ``keys`` (no partition), else one per group.
        if len({tuple(float(groups[i].get(k, 0.0)) for k in keys) for i in used}) == 1:
            return make(groups[used[0]])
        return optax.partition({f"group{i}": make(groups[i]) for i in used}, labels)

    def decay(g):
        return optax.add_decayed_weights(float(g.get("weight_decay", 0.0)))

    def step(g):
        return optax.scale(-float(g["lr"]))

    first = groups[0]
    if family == "sgd":
        momentum = float(first.get("momentum", 0.0))
        middle = optax.trace(momentum, bool(first.get("nesterov", False))) if momentum else optax.identity()
        return optax.chain(per_group(decay, ["weight_decay"]), middle, per_group(step, ["lr"]))
    b1, b2 = (float(x) for x in first.get("betas", (0.9, 0.999)))
    adam = optax.scale_by_adam(b1, b2, float(first.get("eps", 1e-8)))
    if first.get("decoupled_weight_decay", name == "adamw"):
        return optax.chain(adam, per_group(lambda g: optax.chain(decay(g), step(g)), ["weight_decay", "lr"]))
    return optax.chain(per_group(decay, ["weight_decay"]), adam, per_group(step, ["lr"]))

