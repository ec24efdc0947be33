"""Loading a checkpoint (either frontend's, any world size) into JAX params and optax state, placed
as the given arrays are; under ``jax.distributed`` each process reads only its devices' slices."""

from __future__ import annotations

import dataclasses

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, shard_flat
from hybrid.jax import OffloadedZero3, ParamShards, ZeroState
from hybrid.jax._specs import _Layout, _leaves
from hybrid.checkpoint._formats import detect_format, open_checkpoint
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint._manifest import CheckpointError, OptimizerInfo
from hybrid.checkpoint.jax._mapped import TorchView
from hybrid.checkpoint.jax._offloaded import load_offloaded
from hybrid.checkpoint.jax._tree import _SLOTS, _as_dtype, _caps, _check_zero, _layout, _map_nodes, _rank, _slot_node, _world_of


def _like(value: np.ndarray, old):
    """``value`` (stored dtype, the whole array) as an array of ``old``'s dtype, placed as ``old`` is."""
    value = _as_dtype(value, old).reshape(old.shape)
    if isinstance(old, jax.Array) and old.committed:
        if old.is_fully_addressable:
            return jax.device_put(value, old.sharding)
        # Other processes hold the rest of the mesh: this one places what its devices hold.
        return jax.make_array_from_callback(old.shape, old.sharding, lambda index: value[index])
    return jnp.asarray(value)  # uncommitted, as the given array was: jit places it


def _ranks_here(flat, n: int) -> set[int]:
    """The ranks whose slice of a zero flat bucket this process's devices hold."""
    return {_rank(index, flat, n) for index in flat.sharding.addressable_devices_indices_map(flat.shape).values()}


def _from_slices(old, n: int, slices: dict[int, np.ndarray]):
    """A zero flat bucket placed as ``old``, each device given its rank's slice (``slices[rank]``)."""
    def data(index):
        return _as_dtype(slices[_rank(index, old, n)], old)

    return jax.make_array_from_callback(old.shape, old.sharding, data)


def load(path, params, opt_state=None, *, order=None,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES,
         mapping=None, ready_order=None, pairing=None, format: str | None = None):
    """Load a checkpoint (from either frontend, any world size) into the layout of ``params`` and
    ``opt_state``; returns ``(params, opt_state, step)``, placed as the given arrays are.

    ``params`` and ``opt_state`` give the structure, shardings and (for a zero state) the world
    size to load into: pass what ``init`` made (at stage 3, the global ``ParamShards``). Every file is verified and every tensor matched by
    name, shape and dtype before anything is built; a bad checkpoint raises
    :class:`~hybrid.checkpoint.CheckpointError` naming the file. With ``opt_state=None`` only the
    parameters are loaded. Under ``jax.distributed`` every process calls it (no communication):
    each builds the global arrays from the zero slices of its own devices, read alone.

    With ``mapping`` (a ``hybrid.core.ParamMapping`` or ``ParamPairing``) the checkpoint holds
    torch's names and layouts (a torch save, or a JAX save with the same mapping): each tensor is
    placed through the mapping, and one the mapping cannot place is a ``MappingError`` naming it.
    ``order``, the bucket caps, ``ready_order`` and ``pairing`` are what ``hybrid.jax.zero`` was
    given (a state planned with ``pairing`` holds torch's names and layouts: it reads a torch
    checkpoint as it is, without ``mapping``).

    ``format`` insists on ``"hybrid"``, ``"dcp"`` (torch's distributed checkpoint: FSDP2's, read
    through ``mapping`` into a flax tree) or ``"orbax"`` (a flax params tree and its optax state,
    saved by orbax's own API); by default the directory tells. ``path`` may also be a checkpoint
    opened by ``hybrid.checkpoint.open_checkpoint`` (for its options, e.g. ``step=``).

    >>> import jax.numpy as jnp, optax, tempfile, os
    >>> from hybrid.checkpoint.jax import save
    >>> params = {"w": jnp.arange(6.0).reshape(2, 3)}
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save(d, params, step=3, world_size=2)
    >>> loaded, _, step = load(d, {"w": jnp.zeros((2, 3))})
    >>> step, loaded["w"].tolist()
    (3, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    """
    caps = _caps(bucket_cap_bytes, first_bucket_cap_bytes, pairing, mapping)
    ckpt = _open(path, format, params if mapping is None else None, order, caps, ready_order, pairing)
    if mapping is not None:
        if isinstance(opt_state, OffloadedZero3):
            raise ValueError("load: a checkpoint read through a mapping goes into an OffloadedZero3 in two steps: "
                             "load(path, params, opt.zero_state(), mapping=...) (its state on the devices once), "
                             "then opt.load_zero_state(state)")
        view = TorchView.of(mapping, params, opt_state, order=order, caps=caps, ready_order=ready_order,
                            checkpoint=ckpt, host=False)
        loaded_params, loaded_state, step = load(ckpt, view.params, view.state, order=view.order, **caps)
        return (*view.back(params, opt_state, loaded_params, loaded_state), step)
    layout = _layout(params, order, caps, ready_order, pairing)
    from hybrid.checkpoint.jax._tree import check_jax_dtypes
    check_jax_dtypes({s.name: s.dtype for s in ckpt.manifest.plan.specs}, {s.name: s.dtype for s in layout.plan.specs},
                     where=str(ckpt.path))
    ckpt.check_model(layout.plan.specs, what="params")
    ckpt.verify()
    if isinstance(opt_state, OffloadedZero3):
        if not isinstance(params, ParamShards):
            raise TypeError(f"load: an OffloadedZero3 steps ZeRO-3 shards: pass its ParamShards (or "
                            f"hybrid.jax.abstract_shards) as params, got {type(params).__name__}")
        load_offloaded(ckpt, layout, opt_state, _refuse_per_parameter_state)  # the state first, a slot at a time
        new_params, _, step = load(ckpt, params, None, order=order, **caps)
        return new_params, opt_state, step
    if isinstance(params, ParamShards):
        new_params = ParamShards(_flat_slices(ckpt, {"params": params.buckets}, params.layout.shards)["params"],
                                 params.layout)
    else:
        whole = ckpt.tensors("params")
        old_leaves = layout.spec_arrays(params)
        new_params = layout.unflatten({i: _like(whole[s.name], old)
                                       for i, (s, old) in enumerate(zip(layout.plan.specs, old_leaves))})
    if opt_state is None:
        return new_params, None, ckpt.manifest.step
    return new_params, _load_state(ckpt, layout, opt_state), ckpt.manifest.step


def _open(path, format, params, order, caps, ready_order, pairing) -> CheckpointReader:
    """The checkpoint opened; an orbax directory is told the params tree loaded into (its ZeRO-3
    ParamShards saved as they are hold no names)."""
    if params is not None and not isinstance(path, CheckpointReader) and (format or detect_format(path)) == "orbax":
        like = _layout(params, order, caps, ready_order, pairing).abstract()
        return open_checkpoint(path, format=format, params_like=like)
    return open_checkpoint(path, format=format)


def load_buffers(path, buffers, *, format: str | None = None):
    """The checkpoint's buffers (torch's persistent buffers, or what JAX saved with ``buffers=``)
    in the structure, dtypes and placement of ``buffers`` (e.g. flax's ``batch_stats``), matched by
    key-path name; a missing, extra or mis-shaped buffer raises CheckpointError naming it.

    >>> import jax.numpy as jnp, tempfile, os
    >>> from hybrid.checkpoint.jax import save
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = save(d, {"w": jnp.ones(2)}, step=1, buffers={"bn": {"mean": jnp.full(3, 0.5)}})
    >>> load_buffers(d, {"bn": {"mean": jnp.zeros(3)}})["bn"]["mean"].tolist()
    [0.5, 0.5, 0.5]
    """
    ckpt = open_checkpoint(path, format=format)
    names, leaves, treedef = _leaves(buffers)
    ckpt.check_buffers({n: tuple(np.shape(x)) for n, x in zip(names, leaves)}, what="buffers")
    from hybrid.checkpoint.jax._tree import check_jax_dtypes
    check_jax_dtypes({n: e["dtype"] for n, e in ckpt.manifest.buffers.items()},
                     {n: np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype for n, x in zip(names, leaves)},
                     where=str(ckpt.path), what="buffer", converts_64=True)
    saved = ckpt.buffers()
    return jax.tree_util.tree_unflatten(treedef, [_like(saved[n], x) for n, x in zip(names, leaves)])


def _refuse_per_parameter_state(ckpt: CheckpointReader, info: OptimizerInfo) -> None:
    """optax holds one count and every slot for every leaf: a torch state that does not is refused."""
    partial = [n for n in info.without_state if len(info.without_state) < len(ckpt.manifest.plan.specs)]
    if partial or info.counts or info.slot_params:
        raise CheckpointError(
            f"{ckpt.path}: torch's optimizer state is per parameter here (no state yet: {partial}; step counts "
            f"that differ: {info.counts}; slots held by some parameters only: {sorted(info.slot_params)}), and an "
            f"optax state holds one count and every slot for every leaf: resume it in torch, or save it once "
            f"every parameter has stepped alike")


def _flat_slices(ckpt: CheckpointReader, kinds: dict[str, tuple], shards) -> dict[str, tuple]:
    """``{kind: buckets}``: every device's slices of each kind for the flat plan ``shards``, each
    bucket's global padded array placed as ``kinds[kind][b]`` is (resharded from the saved world
    size). Each process reads only the slices of the ranks its own devices hold (no communication
    under ``jax.distributed``), every kind and file in one pass, the files in parallel."""
    plan, n = ckpt.reshard_to(shards), shards.world_size
    ranks = sorted(_ranks_here(next(iter(kinds.values()))[0], n))
    read = ckpt.slices_of(list(kinds), plan, ranks)
    return {kind: tuple(_from_slices(o, n, {r: read[kind, r][b] for r in ranks}) for b, o in enumerate(old))
            for kind, old in kinds.items()}


def _load_state(ckpt: CheckpointReader, layout: _Layout, opt_state):
    info = ckpt.manifest.optimizer
    if info is None:
        raise CheckpointError(f"{ckpt.path}: holds no optimizer state (saved without an optimizer)")
    _refuse_per_parameter_state(ckpt, info)
    node, zero = _slot_node(opt_state)
    slots = _SLOTS[type(node)]
    if set(info.slots) != set(slots):
        raise CheckpointError(f"{ckpt.path}: holds {info.name} state {list(info.slots)}, but the optax state "
                              f"({type(node).__name__}) keeps {list(slots)}")
    values: dict[str, Any] = {}
    if zero is None:
        for s in slots:
            whole = ckpt.tensors(s)
            old = layout.spec_arrays(getattr(node, s))
            values[s] = layout.unflatten({i: _like(whole[spec.name], o)
                                          for i, (spec, o) in enumerate(zip(layout.plan.specs, old))})
    else:
        n = _world_of(getattr(node, slots[0])[0])
        _check_zero(zero, layout, n)
        values = _flat_slices(ckpt, {s: getattr(node, s) for s in slots}, shard_flat(layout.plan, n))

    def replace(x):
        if x is node:
            fields = {**values, **({"count": _like(np.asarray(info.count), x.count)} if "count" in x._fields else {})}
            return x._replace(**fields)
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=_like(np.asarray(info.count), x.count))
        if isinstance(x, ZeroState):
            return dataclasses.replace(x, inner=_map_nodes(x.inner, replace))
        return x

    return _with_saved_scalars(_map_nodes(opt_state, replace), ckpt)


def _state_path(parts) -> tuple:
    """A leaf's path in an optax state, the same whether it sits in a ZeroState (its field
    ``inner``, wherever the zero transform is in the chain) or not."""
    return tuple(str(p) for p in parts if str(p) != "inner")


def _with_saved_scalars(opt_state, ckpt: CheckpointReader):
    """``opt_state`` with every scalar the checkpoint carries for it (an orbax save's schedule counts,
    MultiSteps' and apply_if_finite's counters, under ``opt_state``) as saved, matched by key path,
    rather than the optimizer's count."""
    from hybrid.checkpoint._other_state import carried_entries

    saved = {_state_path(path[1:]): value for path, value in carried_entries(ckpt.manifest.run_state)
             if path[:1] == ("opt_state",)}
    arrays = ckpt.state_arrays() if hasattr(ckpt, "state_arrays") else {}  # an orbax save's MultiSteps acc_grads
    saved.update({_state_path(path[1:]): value for path, value in arrays.items() if path[:1] == ("opt_state",)})
    if not saved:
        return opt_state
    leaves, treedef = jax.tree_util.tree_flatten_with_path(opt_state)

    def name(key) -> str:
        for field in ("name", "key", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)

    out = []
    for path, leaf in leaves:
        at = _state_path(name(k) for k in path)
        value = saved.get(at)
        if value is not None and np.shape(value) != np.shape(leaf):
            raise CheckpointError(f"{ckpt.path}: the optimizer state's {'.'.join(at)!r} is saved with shape "
                                  f"{list(np.shape(value))}, the state loaded into holds {list(np.shape(leaf))}")
        out.append(leaf if value is None else _like(np.asarray(value), leaf))
    return jax.tree_util.tree_unflatten(treedef, out)
