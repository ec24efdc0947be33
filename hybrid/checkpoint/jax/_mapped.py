"""``mapping=`` of :mod:`hybrid.checkpoint.jax`: a JAX tree saved under torch's names and layouts,
and loaded back from them.

A :class:`TorchView` re-expresses the params tree and the optax state under torch's names: the
params, and every part of the state laid out like them (Adam's ``mu`` / ``nu``, momentum's
``trace``), become flat ``{torch name: array in torch's layout}`` dicts, whose key-path names are
torch's names. ``hybrid.jax.zero``'s flat buckets are unpacked into whole tensors first (the
transposes of a mapping do not keep a bucket's elements contiguous, so they cannot be resharded
slice by slice); a zero planned with ``pairing=`` holds torch's names and layouts already, and its
fingerprint tells the two plans apart. The plain save and load then run on the view, and :meth:`TorchView.back` turns
what the load gave into the caller's structure, layouts and placement. Nothing here imports the
plain save/load: ``hybrid.checkpoint.jax`` calls in.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hybrid.core import ParamPairing, pack, shard_flat, unpack
from hybrid.jax import ZeroState
from hybrid.jax._specs import _Layout, _leaves
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint._renamed import resolve_pairing
from hybrid.checkpoint._manifest import CheckpointError


@dataclasses.dataclass(frozen=True)
class TorchView:
    """The params and optax state of a JAX run under torch's names (see the module docstring)."""

    pairing: ParamPairing
    params: dict
    state: object
    order: tuple[str, ...]
    world_size: int | None
    _treedef: object
    _shapes: tuple[tuple[int, ...], ...]
    _zeros: tuple[tuple[_Layout, int], ...]  # each ZeroState's layout and device count, in the state's order

    @classmethod
    def of(cls, mapping, params, opt_state, *, order, caps: dict, ready_order=None,
           checkpoint: CheckpointReader | None = None, host: bool) -> "TorchView":
        """The view of ``params`` / ``opt_state``; on a load (``checkpoint`` given) paired with the
        checkpoint's tensors; ``host=True`` (a save) reads every array to the host."""
        names, leaves, treedef = _leaves(params)
        shapes = [tuple(x.shape) for x in leaves]
        torch_specs = checkpoint.manifest.plan.specs if checkpoint is not None else None
        pairing = resolve_pairing(mapping, dict(zip(names, shapes)),
                                  None if torch_specs is None else {t.name: t.shape for t in torch_specs})

        def torch_named(named: dict) -> dict:
            return pairing.to_torch({n: np.asarray(v) if host else v for n, v in named.items()})

        zeros = []

        def view(node):
            if isinstance(node, ZeroState):
                n = _devices(node)
                layout = _zero_layout(node, n, params, pairing, order=order, ready_order=ready_order, caps=caps)
                zeros.append((layout, n))
                shards = shard_flat(layout.plan, n)
                # A zero planned with the pairing holds torch's names and layouts already.
                named = (lambda d: d) if layout.layouts is not None else torch_named
                return _map(node.inner, lambda x: _is_buckets(x, shards),
                            lambda flats: named(_whole(layout, flats) if host else _zeros(layout, flats)))
            return torch_named(dict(zip(names, jax.tree_util.tree_leaves(node))))

        is_node = lambda x: isinstance(x, ZeroState) or _like_params(x, treedef, shapes)
        state = None if opt_state is None else _map(opt_state, is_node, view)
        world = zeros[0][1] if zeros else None
        return cls(pairing, torch_named(dict(zip(names, leaves))), state, pairing.torch_names, world, treedef,
                   tuple(shapes), tuple(zeros))

    def back(self, params_like, state_like, loaded_params: dict, loaded_state):
        """What the plain load gave for this view, in the structure, layouts and placement of
        ``params_like`` and ``state_like`` (the caller's trees)."""
        names, _, _ = _leaves(params_like)

        def tree(loaded: dict):
            arrays = self.pairing.to_jax(loaded)
            return jax.tree_util.tree_unflatten(self._treedef, [arrays[n] for n in names])

        params = tree(loaded_params)
        if state_like is None:
            return params, None
        names_set = set(self.pairing.torch_names)
        is_view = lambda x: isinstance(x, dict) and set(x) == names_set
        zeros = iter(self._zeros)

        def rebuild(old, loaded):
            if isinstance(old, ZeroState):
                layout, n = next(zeros)
                shards = shard_flat(layout.plan, n)
                inner = _map(loaded, is_view, lambda d: _buckets(layout, shards, tree(d)))
                placed = jax.tree_util.tree_map(lambda new, o: jax.device_put(new, o.sharding), inner, old.inner)
                return dataclasses.replace(old, inner=placed)
            return tree(loaded)

        is_node = lambda x: isinstance(x, ZeroState) or _like_params(x, self._treedef, list(self._shapes))
        nodes, treedef = jax.tree_util.tree_flatten(state_like, is_leaf=is_node)
        loaded_nodes = treedef.flatten_up_to(loaded_state)
        return params, jax.tree_util.tree_unflatten(treedef, [rebuild(o, l) if is_node(o) else l
                                                              for o, l in zip(nodes, loaded_nodes)])


def _zero_layout(zero: ZeroState, n: int, params, pairing: ParamPairing, *, order, ready_order, caps) -> _Layout:
    """The layout ``hybrid.jax.zero`` packed ``zero`` by, over ``n`` devices: planned over the tree's
    own names and layouts, or (``zero(..., pairing=)``) over torch's; its fingerprint tells which."""
    plain = _Layout.of(params, what="checkpoint", order=order, ready_order=ready_order, **caps)
    candidates = [plain] if order is not None else [
        plain, _Layout.of(params, what="checkpoint", order=None, ready_order=ready_order, pairing=pairing, **caps)]
    for layout in candidates:
        if shard_flat(layout.plan, n).fingerprint() == zero.plan_fingerprint:
            return layout
    raise CheckpointError("the ZeroState was planned with other bucket caps, leaf order or ready order than given "
                          "here: pass the order=, ready_order= and bucket caps you gave hybrid.jax.zero")


def _like_params(x, treedef, shapes: list) -> bool:
    """A subtree laid out like the params (Adam's ``mu``, momentum's ``trace``): same structure and shapes."""
    leaves, x_def = jax.tree_util.tree_flatten(x)
    return x_def == treedef and [tuple(getattr(v, "shape", ())) for v in leaves] == shapes


def _map(tree, is_node, fn):
    """``tree`` with each subtree ``is_node`` accepts replaced by ``fn(subtree)`` (other leaves kept)."""
    nodes, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_node)
    return jax.tree_util.tree_unflatten(treedef, [fn(n) if is_node(n) else n for n in nodes])


def _devices(zero: ZeroState) -> int:
    leaves = jax.tree_util.tree_leaves(zero.inner)
    sharding = next((x.sharding for x in leaves if getattr(x, "ndim", 0) == 1 and hasattr(x, "sharding")), None)
    if sharding is None:
        raise CheckpointError("a ZeroState must be passed as the global arrays shard_map/jit returned "
                              "(sharded over the mesh), not as host arrays")
    return len(sharding.device_set)


def _is_buckets(x, shards) -> bool:
    """One slot of a zero state: a plain tuple of one padded flat array per bucket."""
    return (type(x) is tuple and len(x) == len(shards.bucket_plan.buckets)
            and all(getattr(f, "shape", None) == (shards.padded_length(b),) for b, f in enumerate(x)))


def _whole(layout: _Layout, flats) -> dict:
    """``{jax name: whole tensor}`` of one zero slot (its global flat buckets), on the host."""
    out = {}
    for b, flat in enumerate(flats):
        for i, a in unpack(layout.plan, b, np.asarray(flat)).items():
            out[layout.plan.specs[i].name] = a
    return out


def _zeros(layout: _Layout, flats) -> dict:
    """Host zeros in the shape and dtype of each tensor of one zero slot: what a load fills in."""
    dtypes = [flats[b].dtype for b, bucket in enumerate(layout.plan.buckets) for _ in bucket.members]
    members = [i for bucket in layout.plan.buckets for i in bucket.members]
    return {layout.plan.specs[i].name: np.zeros(layout.plan.specs[i].shape, d) for i, d in zip(members, dtypes)}


def _buckets(layout: _Layout, shards, tree) -> tuple:
    """The padded flat buckets of a tree laid out as ``layout``: a zero slot."""
    arrays = layout.spec_arrays(tree)
    return tuple(pack(layout.plan, b, arrays, length=shards.padded_length(b)) for b in range(len(layout.plan.buckets)))
