"""Weight-decay masks and param groups inside ``zero``: ``optax.masked`` and ``optax.partition`` on flat shards.

A mask (``optax.masked``, ``add_decayed_weights(mask=...)``, ``adamw(mask=...)``) or a label
(``optax.partition`` / ``multi_transform``) is given per leaf of the params tree, but ``zero``'s
inner transform sees one flat slice per bucket. ``zero`` knows where every leaf lies in those
slices (``FlatShardPlan.group_runs``), so it rebuilds the inner transform before each ``init`` and
``update``: every ``masked`` / ``partition`` it finds (through chains and named chains) becomes
its flat twin below, which applies the wrapped transform to the elements of the masked-in leaves.

The twin runs the wrapped transform on the whole slice with the masked-out elements set to zero
(gradient and parameter, as padding is), then keeps its result only where the mask is set. For an
elementwise transform that is exactly what optax computes on the masked-in leaves; a transform
coupling elements over the axis (``hybrid.jax.clip_by_global_norm``) sees zeros elsewhere, so its
norm covers the masked-in leaves only, as optax's does. The cost: the wrapped transform keeps
state for the whole slice (adam under two labels keeps two slices of moments); the common case,
a mask on ``add_decayed_weights``, is stateless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


MASKING = ("masked", "partition")


def closure_cells(fn) -> dict:
    """A function's closure as ``{free variable name: value}`` (empty cells left out)."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def _optax_kind(fn) -> str | None:
    """``"chain"``, ``"masked"``... for an optax combinator's update function, else None."""
    if not callable(fn) or not hasattr(fn, "__code__") or not (fn.__module__ or "").startswith("optax"):
        return None
    return fn.__qualname__.split(".<locals>")[0]


def _hybrid_kind(fn) -> str | None:
    """``"apply_if_finite"`` for :func:`hybrid.jax.apply_if_finite`'s update: a wrapper zero looks
    through as through a chain (its inner transform is rewritten, the wrapper rebuilt around it)."""
    if callable(fn) and getattr(fn, "__module__", None) == "hybrid.jax._finite" and \
            getattr(fn, "__qualname__", "").startswith("apply_if_finite.<locals>"):
        return "apply_if_finite"
    return None


def rebuilt_finite(cells: dict, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """:func:`hybrid.jax.apply_if_finite` of ``cells`` (its closure's) around a rewritten ``inner``."""
    from hybrid.jax._finite import apply_if_finite  # lazily: _finite is a leaf module, this is not
    return apply_if_finite(inner, cells["max_consecutive_errors"], cells["axis_name"])


def _unwrap(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    # optax.with_extra_args_support wraps a plain transform's update in a closure over it.
    update = getattr(tx, "update", None)
    cells = closure_cells(update) if hasattr(update, "__code__") else {}
    if _optax_kind(update) == "with_extra_args_support" and "tx" in cells:
        return _unwrap(cells["tx"])
    return tx


def _parts(tx):
    """``(kind, cells)`` of an optax chain, named chain, masked or partition, or of
    :func:`hybrid.jax.apply_if_finite`; ``(None, {})`` else."""
    tx = _unwrap(tx)
    update = getattr(tx, "update", None)
    kind = _optax_kind(update) or _hybrid_kind(update)
    if kind in ("chain", "named_chain", "apply_if_finite", *MASKING):
        cells = {**closure_cells(tx.init), **closure_cells(tx.update)}
        return kind, cells
    return None, {}


def _children(kind, cells) -> list:
    if kind == "chain":
        return [optax.GradientTransformation(i, u) for i, u in zip(cells["init_fns"], cells["update_fns"])]
    if kind == "named_chain":
        return [t for _, t in cells["transforms"]]
    if kind in ("masked", "apply_if_finite"):
        return [cells["inner"]]
    if kind == "partition":
        return list(cells["transforms"].values())
    return []


def contains_masks(tx) -> bool:
    """Whether ``tx`` holds a ``masked`` or ``partition`` that :func:`bind` rewrites."""
    kind, cells = _parts(tx)
    return kind in MASKING or any(contains_masks(t) for t in _children(kind, cells))


def outside_combinators(tx) -> list:
    """The transforms under ``tx``'s chains, named chains, masks and partitions: what :func:`bind`
    keeps as it is (a mask inside one of them is not rewritten)."""
    kind, cells = _parts(tx)
    if kind is None:
        return [tx]
    return [t for child in _children(kind, cells) for t in outside_combinators(child)]


class Binder:
    """Per-element masks and labels of this device's bucket slices, from per-leaf ones.

    ``tree`` is what a callable mask is called with, as optax calls it: the params in ``init``,
    the updates in ``update``. The per-leaf values become per-element runs by the core's
    ``FlatShardPlan.group_runs`` (alignment gaps and padding take the previous member's value),
    and each element of this device's slice (``rank`` may be traced; None: the whole bucket) looks its run up.
    """

    def __init__(self, tree, layout, shards, rank):
        self.tree, self.layout, self.shards, self.rank = tree, layout, shards, rank

    def _per_leaf(self, spec, what: str) -> list:
        values = spec(self.tree) if callable(spec) else spec
        try:
            per_leaf = jax.tree.map(lambda v, sub: jax.tree.map(lambda _: v, sub), values, self.tree)
        except ValueError as e:
            raise ValueError(f"zero: the {what} inside zero is not the params tree or a prefix of it "
                             f"({e})") from None
        return jax.tree.leaves(per_leaf)

    def _slices(self, value_of_leaf: list) -> tuple:
        group_of = [value_of_leaf[i] for i in self.layout.leaf_of_spec]
        runs = [(rank, r) for rank in range(self.shards.world_size) for r in self.shards.group_runs(rank, group_of)]
        out = []
        for b, size in enumerate(self.shards.shard_sizes):
            # Per rank in rank order: the runs' starts in the padded bucket ascend.
            starts = np.array([rank * size + r.lo for rank, r in runs if r.bucket == b], np.int32)
            values = np.array([r.group for _, r in runs if r.bucket == b], np.int32)
            if size == 0:
                out.append(jnp.zeros((0,), jnp.int32))
                continue
            # rank None: the whole padded bucket (zero(mesh=...) steps global buckets under jit)
            index = (jnp.arange(size * self.shards.world_size, dtype=jnp.int32) if self.rank is None
                     else self.rank * size + jnp.arange(size, dtype=jnp.int32))
            out.append(jnp.asarray(values)[jnp.searchsorted(jnp.asarray(starts), index, side="right") - 1])
        return tuple(out)

    def masks(self, mask) -> tuple:
        """One bool array per bucket slice: the elements of leaves ``mask`` selects."""
        return tuple(s == 1 for s in self._slices([int(bool(v)) for v in self._per_leaf(mask, "optax.masked mask")]))

    def labels(self, param_labels, keys: list) -> tuple:
        """One int32 array per bucket slice: each element's label, as its index in ``keys``."""
        labels = self._per_leaf(param_labels, "optax.partition param_labels")
        unknown = [x for x in dict.fromkeys(labels) if x not in keys]
        if unknown:
            raise ValueError(f"zero: optax.partition labels {unknown} have no transform (its keys: {keys})")
        return self._slices([keys.index(x) for x in labels])


class ProbeBinder:
    """The probe's elements (``num_leaves`` leaves of ``leaf_size``, split over ``axis_name``):
    masked in and out in turn, labels in turn, so each wrapped transform sees both kinds."""

    def __init__(self, axis_name, num_leaves: int, leaf_size: int):
        self.axis_name, self.num_leaves, self.leaf_size = axis_name, num_leaves, leaf_size

    def _pattern(self, k: int) -> tuple:
        size = self.leaf_size // jax.lax.axis_size(self.axis_name)
        index = jax.lax.axis_index(self.axis_name) * size + jnp.arange(size)
        return (index % k,) * self.num_leaves

    def masks(self, mask) -> tuple:
        del mask
        return tuple(s == 0 for s in self._pattern(2))

    def labels(self, param_labels, keys: list) -> tuple:
        del param_labels
        return self._pattern(len(keys))


def _where(masks, new, old):
    return tuple(jnp.where(m, n, o) for m, n, o in zip(masks, new, old))


def _zeros_outside(masks, tree):
    return None if tree is None else tuple(jnp.where(m, x, jnp.zeros((), x.dtype)) for m, x in zip(masks, tree))


def flat_masked(inner: optax.GradientTransformation, masks: tuple) -> optax.GradientTransformation:
    """``optax.masked(inner, mask)`` on flat slices: ``masks`` holds a bool array per slice."""

    def init_fn(params):
        return optax.MaskedState(inner_state=inner.init(_zeros_outside(masks, params)))

    def update_fn(updates, state, params=None):
        new, inner_state = inner.update(_zeros_outside(masks, updates), state.inner_state,
                                        _zeros_outside(masks, params))
        return _where(masks, new, updates), optax.MaskedState(inner_state=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def bind(tx: optax.GradientTransformation, binder) -> optax.GradientTransformation:
    """``tx`` with every ``masked`` / ``partition`` (through chains) replaced by its flat twin."""
    kind, cells = _parts(tx)
    if kind == "chain":
        return optax.chain(*(bind(t, binder) for t in _children(kind, cells)))
    if kind == "named_chain":
        return optax.named_chain(*((name, bind(t, binder)) for name, t in cells["transforms"]))
    if kind == "masked":
        return flat_masked(bind(cells["inner"], binder), binder.masks(cells["mask"]))
    if kind == "apply_if_finite":
        return rebuilt_finite(cells, bind(cells["inner"], binder))
    if kind == "partition":
        transforms = {k: bind(t, binder) for k, t in cells["transforms"].items()}
        return _flat_partition(transforms, binder.labels(cells["param_labels"], list(transforms)))
    return tx


def _flat_partition(transforms: dict, index: tuple) -> optax.GradientTransformation:
    """``optax.partition(transforms, labels)`` on flat slices: ``index`` holds each element's label
    (its position in ``transforms``) per slice; one masked twin per label, in optax's order."""
    parts = {k: flat_masked(tx, tuple(s == i for s in index)) for i, (k, tx) in enumerate(transforms.items())}

    def init_fn(params):
        return optax.transforms.PartitionState({k: tx.init(params) for k, tx in parts.items()})

    def update_fn(updates, state, params=None):
        new_states = {}
        for k, tx in parts.items():
            updates, new_states[k] = tx.update(updates, state.inner_states[k], params)
        return updates, optax.transforms.PartitionState(new_states)

    return optax.GradientTransformation(init_fn, update_fn)
