"""TensorSpecs of a pytree, and the bucket layout a transform derives from them.

Names are the pytree key path joined with "." (dict keys, attribute names, sequence indices), so
``{"layers": [{"weight": w}]}`` names ``w`` ``"layers.0.weight"`` exactly as torch's
``named_parameters`` does for the module of the same shape.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybrid.core import (BucketPlan, FlatShardPlan, ParamPairing, TensorSpec, canonical_dtype, plan_buckets,
                         rebuild_plan, shard_flat, zero3_plan)


def _entry_name(entry) -> str:
    tu = jax.tree_util
    if isinstance(entry, tu.DictKey):
        return str(entry.key)
    if isinstance(entry, tu.GetAttrKey):
        return entry.name
    if isinstance(entry, tu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, tu.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def key_path_name(path) -> str:
    """The "."-joined name of a pytree key path: ``(DictKey('a'), SequenceKey(0))`` -> ``"a.0"``.

    >>> import jax
    >>> [key_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
    ['a.0', 'a.1']
    """
    return ".".join(_entry_name(e) for e in path) or "_"


def _nnx_variable():
    """flax NNX's ``Variable`` class where flax is already imported (hybrid never imports flax)."""
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)


def _variable_paths(tree) -> frozenset:
    """Key paths of the flax NNX ``Variable``s (``nnx.Param`` ...) in ``tree``: an ``nnx.State``
    from ``nnx.split(model, nnx.Param)`` keeps each array under its variable's ``.value``."""
    variable = _nnx_variable()
    if variable is None:
        return frozenset()
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, variable))[0]
    return frozenset(p for p, x in pairs if isinstance(x, variable))


def _leaves(tree):
    """``(names, leaves, treedef)``: each leaf named by its key path, an NNX variable's array by
    the variable's path (``h.0.attn.kernel``, not ``h.0.attn.kernel.value``), as
    ``nnx.to_pure_dict`` names it and as a linen tree and torch name the same tensor."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    variables = _variable_paths(tree)
    names = [key_path_name(p[:-1] if variables and p[:-1] in variables and p[-1] == _VALUE else p)
             for p, _ in pairs]
    return names, [x for _, x in pairs], treedef


_VALUE = jax.tree_util.GetAttrKey("value")


def _order(names: list[str], order: Sequence[str] | None) -> list[int]:
    """Leaf index of each spec: leaf order, or the order of names given in ``order``."""
    if order is None:
        return list(range(len(names)))
    order = list(order)
    where = {n: i for i, n in enumerate(names)}
    missing = [n for n in order if n not in where]
    extra = sorted(set(names) - set(order))
    if missing or extra or len(set(order)) != len(order):
        raise ValueError(f"order must name every leaf exactly once; unknown names {missing}, "
                         f"leaves not named {extra}")
    return [where[n] for n in order]


def specs(params, *, order: Sequence[str] | None = None, device: str = "cpu") -> tuple[TensorSpec, ...]:
    """TensorSpecs of a pytree's leaves, named by key path, in leaf order (or ``order``).

    JAX flattens dicts in sorted key order, while torch registers parameters in the order a module
    assigns them; pass ``order=[name for name, _ in module.named_parameters()]`` (or any list of
    the tree's names) to follow a registration order, so both sides get the same plan and
    fingerprint.

    A flax NNX ``nnx.State`` (``nnx.split(model, nnx.Param)``) keeps each array under its
    variable's ``.value``: the spec is named by the variable (``h.0.attn.c_attn.kernel``), as
    ``nnx.to_pure_dict`` names it, so NNX, linen and torch names cross through one mapping.

    Args:
      params: a pytree of arrays (dict, list, flax/equinox module, flax NNX state...).
      order: leaf names in the registration order to follow; default the pytree's leaf order.
      device: the device string written into every spec (torch's side uses ``"cuda:0"`` etc.).

    >>> import jax.numpy as jnp
    >>> [s.name for s in specs({"layers": [{"weight": jnp.ones((2, 3))}], "bias": jnp.ones(2)})]
    ['bias', 'layers.0.weight']
    >>> [s.name for s in specs({"w": jnp.ones(2), "b": jnp.ones(2)}, order=["w", "b"])]
    ['w', 'b']
    """
    names, leaves, _ = _leaves(params)
    out = []
    for i in _order(names, order):
        x = leaves[i]
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"leaf {names[i]!r} is a {type(x).__name__}, expected an array")
        out.append(TensorSpec(names[i], tuple(int(d) for d in x.shape), canonical_dtype(np.dtype(x.dtype)), device))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A tree's bucket plan and how to go between its leaves and the plan's flat buckets.

    With a :class:`hybrid.core.ParamPairing` the plan is over torch's names and layouts (the
    tensors torch's DDP buckets): each leaf is laid out as torch holds it on the way into a bucket
    (a Dense kernel transposed to a Linear weight) and back on the way out.
    """

    plan: BucketPlan
    leaf_of_spec: tuple[int, ...]
    treedef: object
    # per spec: (layout from the leaf to the spec's tensor, the leaf's shape), with a pairing
    layouts: tuple | None = None

    @classmethod
    def of(cls, tree, *, what: str, order, bucket_cap_bytes: int, first_bucket_cap_bytes: int,
           ready_order=None, pairing: ParamPairing | None = None, plan: BucketPlan | None = None) -> "_Layout":
        tree_specs, perm, treedef, layouts = _paired_specs(tree, what, order, pairing)
        if plan is not None:
            return cls(_given(plan, tree_specs, ready_order, what), perm, treedef, layouts)
        plan = plan_buckets(tree_specs, bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)
        if ready_order is not None:
            plan = _rebuilt(plan, ready_order, pairing, what)
        return cls(plan, perm, treedef, layouts)

    @classmethod
    def zero3(cls, tree, *, what: str, order, bucket_cap_bytes: int | None, first_bucket_cap_bytes: int | None,
              pairing: ParamPairing | None = None, plan: BucketPlan | None = None) -> "_Layout":
        """The layout of ZeRO stage 3: :func:`hybrid.core.zero3_plan` over the tree's specs (in
        ``order``, or torch's names and order through ``pairing``), the plan of torch's ``ZeRO3``."""
        tree_specs, perm, treedef, layouts = _paired_specs(tree, what, order, pairing)
        if plan is not None:
            return cls(_given(plan, tree_specs, None, what), perm, treedef, layouts)
        plan = zero3_plan(tree_specs, bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)
        return cls(plan, perm, treedef, layouts)

    def abstract(self) -> object:
        """The tree as ``jax.ShapeDtypeStruct``s of its leaves (JAX's shapes, not the specs' torch layouts)."""
        leaves = [None] * len(self.leaf_of_spec)
        for i, (spec, leaf) in enumerate(zip(self.plan.specs, self.leaf_of_spec)):
            shape = spec.shape if self.layouts is None else self.layouts[i][1]
            leaves[leaf] = jax.ShapeDtypeStruct(shape, spec.dtype)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def spec_arrays(self, tree) -> list:
        leaves = jax.tree_util.tree_leaves(tree)
        out = [leaves[i] for i in self.leaf_of_spec]
        if self.layouts is None:
            return out
        # leaves of the parameters' shape are laid out as torch holds them; others (a mask's
        # booleans, a scalar) are per leaf and pass as they are
        return [layout.to_torch(x) if tuple(getattr(x, "shape", ())) == shape and x.ndim else x
                for x, (layout, shape) in zip(out, self.layouts)]

    def unflatten(self, per_spec: dict) -> object:
        leaves = [None] * len(self.leaf_of_spec)
        for spec_index, leaf_index in enumerate(self.leaf_of_spec):
            x = per_spec[spec_index]
            if self.layouts is not None:
                layout, shape = self.layouts[spec_index]
                x = layout.to_jax(x, shape) if tuple(getattr(x, "shape", ())) == layout.torch_shape(shape) and x.ndim else x
            leaves[leaf_index] = x
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def shards(self, world_size: int) -> FlatShardPlan:
        return shard_flat(self.plan, world_size)


def _paired_specs(tree, what: str, order, pairing: ParamPairing | None):
    """``(specs, leaf index of each spec, treedef, per-spec (layout, leaf shape) or None)``: the
    tree's specs in ``order`` or, with a pairing, torch's names, shapes and registration order."""
    names, leaves, treedef = _leaves(tree)
    if not leaves:
        raise ValueError(f"{what}: the tree has no leaves, nothing to bucket")
    for n, x in zip(names, leaves):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{what}: leaf {n!r} has dtype {x.dtype}; only floating-point "
                            f"gradients and parameters can be bucketed")
    if pairing is None:
        return specs(tree, order=order), tuple(_order(names, order)), treedef, None
    if order is not None:
        raise ValueError(f"{what}: give order or pairing, not both (the pairing holds torch's registration order)")
    where = {n: i for i, n in enumerate(names)}
    unknown = [p.jax for p in pairing.pairs if p.jax not in where]
    unpaired = sorted(set(names) - set(pairing.jax_names))
    if unknown or unpaired:
        raise ValueError(f"{what}: the pairing does not fit the tree: pairing tensors not in the tree "
                         f"{unknown}, leaves the pairing does not place {unpaired}")
    perm = [where[p.jax] for p in pairing.pairs]
    tree_specs = tuple(TensorSpec(p.torch, p.torch_shape, canonical_dtype(np.dtype(leaves[i].dtype)))
                       for p, i in zip(pairing.pairs, perm))
    return tree_specs, tuple(perm), treedef, tuple((p.layout, p.jax_shape) for p in pairing.pairs)


def _given(plan: BucketPlan, tree_specs, ready_order, what: str) -> BucketPlan:
    """A plan given whole (``plan=``, e.g. :func:`hybrid.jax.auto_bucket_plan`'s), checked against the tree."""
    if not isinstance(plan, BucketPlan):
        raise TypeError(f"{what}: plan must be a hybrid.core.BucketPlan, got {type(plan).__name__}")
    if ready_order is not None:
        raise ValueError(f"{what}: give plan or ready_order, not both (the plan's buckets are in their order already)")
    if tuple(plan.specs) != tuple(tree_specs):
        theirs = {s.name: s for s in plan.specs}
        diff = [(s.name, theirs.get(s.name)) for s in tree_specs if theirs.get(s.name) != s][:3]
        raise ValueError(f"{what}: the plan is over other tensors than the tree's (first differences, tree spec "
                         f"vs plan spec: {[(s, t) for s, t in diff] or 'the order'}); plan with the same tree, order "
                         f"and pairing")
    return plan


def _rebuilt(plan: BucketPlan, ready_order, pairing: ParamPairing | None, what: str) -> BucketPlan:
    """The plan rebuilt from a gradient-ready order of leaf names, as torch's DDP rebuilds its
    buckets after the first iteration (with a pairing: in the order torch's autograd would give)."""
    ready = list(ready_order)
    names = pairing.torch_ready_order(ready) if pairing is not None else ready
    index = {s.name: i for i, s in enumerate(plan.specs)}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise ValueError(f"{what}: ready_order names {unknown}, which are no leaves of the tree "
                         f"(leaves: {sorted(index)[:8]}...)")
    return rebuild_plan(plan, [index[n] for n in names], size_limits=plan.size_limits)


def check_caps(bucket_cap_bytes, first_bucket_cap_bytes, *, none_ok: bool = False) -> None:
    """Raise unless each cap is an int >= 0 (or None, the default, where ``none_ok``)."""
    for name, v in (("bucket_cap_bytes", bucket_cap_bytes), ("first_bucket_cap_bytes", first_bucket_cap_bytes)):
        if v is None and none_ok:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")


def _bound_axes() -> list[str]:
    """The axis names bound where we are traced (shard_map's mesh axes, pmap's and vmap's names)."""
    try:
        from jax._src import core  # no public API lists them; only used to word an error
        return sorted(str(a) for a in core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):
        return []


def axis_size(axis_name, what: str) -> int:
    """Size of a bound mesh axis, or a ValueError that names the axes that are bound."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        bound = _bound_axes()
        where = (f"the axes bound here are {bound}: a typo, or a mesh axis of another name?" if bound else
                 f"no axis is bound here; call it inside jax.shard_map(..., mesh=Mesh(devices, "
                 f"({axis_name!r},))) or jax.pmap(..., axis_name={axis_name!r})")
        raise ValueError(f"{what}: axis name {axis_name!r} is not bound; {where}") from None


def varying_axes(x) -> frozenset:
    """The manual axes over which ``x``'s value may differ between devices (its type's "vma").

    JAX 0.10 keeps them in ``jax.typeof(x).manual_axis_type.varying``; older JAX in ``.vma``.
    Outside ``shard_map``, or with ``check_vma=False``, nothing is tracked: the set is empty.
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def tracks_varying(axis_name) -> bool:
    """Whether JAX tracks which values vary over ``axis_name`` here (``shard_map``, ``check_vma=True``).

    ``axis_index`` varies over its axis by definition, so its type says whether tracking is on;
    under ``pmap``, ``vmap`` or ``check_vma=False`` it is off.
    """
    return axis_name in varying_axes(jax.lax.axis_index(axis_name))


def check_per_device(tree, axis_name, what: str) -> None:
    """Raise if a leaf of ``tree`` is invariant over ``axis_name`` where JAX tracks that.

    Inside ``shard_map`` a gradient of replicated parameters taken with ``jax.grad`` is already
    summed over the axis (the transpose of the invariant-to-varying cast is a ``psum``) and its
    type says so: it is invariant. Reducing it again would give ``axis_size`` times the gradient.
    """
    if not isinstance(axis_name, str) or not tracks_varying(axis_name):
        return
    names, leaves, _ = _leaves(tree)
    summed = [n for n, x in zip(names, leaves) if axis_name not in varying_axes(x)]
    if summed:
        reducer = "zero" if what.startswith("zero") else "bucketed_all_reduce"
        raise ValueError(
            f"{what}: gradient leaf {summed[0]!r} (and {len(summed) - 1} more) is invariant over "
            f"{axis_name!r}: it is already identical on every device, so it was reduced before {reducer}, "
            f"and reducing it again would scale it by the axis size. Either it comes from jax.grad of "
            f"replicated (P()) parameters inside shard_map, which sums the gradient over the axis: take "
            f"per-device gradients with hybrid.jax.local_grad(loss, {axis_name!r}) instead of jax.grad; or "
            f"it was reduced on purpose (lax.pmean / lax.psum, or bucketed_all_reduce before zero): drop "
            f"that reduction, {reducer} does it once; or it is state that entered shard_map replicated: "
            f"optax.MultiSteps around {reducer} accumulates this device's own gradients, so its "
            f"acc_grads need P({axis_name!r}) specs, which hybrid.jax.state_specs(tx, params, "
            f"{axis_name!r}, axis_size=...) gives")


def check_state_per_device(state, axis_name, what: str) -> None:
    """Raise if an array of a per-device state arrived replicated over ``axis_name`` (a ``P()`` spec).

    A ZeRO shard or a bucket buffer holds this device's own numbers, so it varies over the axis
    where JAX tracks that; replicated, it came in through an in_spec of ``P()``, and the step's
    out_spec of ``P()`` would fail in JAX with a message that names no leaf.
    """
    if not isinstance(axis_name, str) or not tracks_varying(axis_name):
        return
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if getattr(x, "ndim", 0) >= 1 and axis_name not in varying_axes(x):
            raise ValueError(
                f"{what}: state leaf {key_path_name(path)!r} is replicated over {axis_name!r} (a P() "
                f"spec), but it holds this device's own part of the state (P({axis_name!r})): pass "
                f"hybrid.jax.state_specs(tx, params, {axis_name!r}, axis_size=mesh.size) as the state's "
                f"in_specs and out_specs in shard_map, for init and for the step")
