"""Sharded checkpoints from and into JAX: params and the optax state of ``hybrid.jax.zero`` (the
padded flat buckets, sharded over the mesh) or of a plain, unsharded optax transform.

ZeRO stage 3 needs no format of its own: its :class:`hybrid.jax.ParamShards` are the parameters
cut exactly as the files store them, and its state is the stage-2 state of the same plan. Pass
the shards where the params tree goes; the plan travels with them (no ``order`` or caps needed).

The optimizer state is found by type: ``optax.ScaleByAdamState`` (slots ``mu``, ``nu`` and its
``count``; adam, adamw, ...) and ``optax.TraceState`` (slot ``trace``: sgd with momentum), inside
a :class:`hybrid.jax.ZeroState` or not. Any ``optax.ScaleByScheduleState`` count is restored too.
The mesh may be one process's devices (single controller) or span the processes of a
``jax.distributed`` job: there every process saves and loads, each writing and reading only the
slices its own devices hold (``_jax_processes.py`` has the save's agreement).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, shard_flat, unpack
from hybrid.jax import ParamShards, ZeroState
from hybrid.jax._specs import _Layout, _leaves
from hybrid.checkpoint._files import Checkpoint
from hybrid.checkpoint._jax_mapped import TorchView
from hybrid.checkpoint._manifest import CheckpointError, Manifest, OptimizerInfo
from hybrid.checkpoint._optax_groups import optax_from_manifest  # noqa: F401  (public: torch's param groups in optax)
from hybrid.checkpoint._jax_processes import save_from_processes
from hybrid.checkpoint._write import check_json, save_sharded, to_storage

_SLOTS = {optax.ScaleByAdamState: ("mu", "nu"), optax.TraceState: ("trace",)}
_NODES = (ZeroState, optax.ScaleByScheduleState, *_SLOTS)


def _is_node(x) -> bool:
    return isinstance(x, _NODES)


def _nodes(state) -> list:
    return [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_node) if _is_node(x)]


def _map_nodes(state, fn):
    return jax.tree_util.tree_map(lambda x: fn(x) if _is_node(x) else x, state, is_leaf=_is_node)


def _slot_node(state) -> tuple[Any, ZeroState | None]:
    """The one optimizer node holding slots, and the ZeroState around it (None: unsharded)."""
    found = []
    for node in _nodes(state):
        if isinstance(node, ZeroState):
            found += [(inner, node) for inner in _nodes(node.inner) if type(inner) in _SLOTS]
        elif type(node) in _SLOTS:
            found.append((node, None))
    if len(found) != 1:
        kinds = [type(n).__name__ for n, _ in found]
        raise CheckpointError(f"the optax state must hold exactly one ScaleByAdamState or TraceState, found {kinds}")
    return found[0]


def _host(x) -> np.ndarray:
    """``x`` on the host: a replicated global array from this process's copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.sharding.is_fully_replicated:
            raise CheckpointError(f"an array sharded across processes ({x.sharding}) outside a hybrid.jax.zero "
                                  f"state: a checkpoint holds replicated params and buffers, and zero's shards")
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _world_of(array) -> int:
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        raise CheckpointError("a ZeroState must be passed as the global arrays shard_map/jit returned "
                              "(sharded over the mesh), not as host arrays")
    return len(sharding.device_set)


def _layout(params, order, caps, ready_order=None, pairing=None) -> _Layout:
    if isinstance(params, ParamShards):
        return params.layout.layout
    return _Layout.of(params, what="checkpoint", order=order, ready_order=ready_order, pairing=pairing, **caps)


def _host_params(params, layout: _Layout) -> list[np.ndarray]:
    """Every parameter whole, on the host, in the plan's spec order (stage 3: unpacked from the
    global padded buckets of its shards)."""
    if not isinstance(params, ParamShards):
        return [_host(p) for p in layout.spec_arrays(params)]
    per_spec = {}
    for b, flat in enumerate(params.buckets):
        per_spec.update(unpack(layout.plan, b, _host(flat)))
    return [per_spec[i] for i in range(len(layout.plan.specs))]


def _caps(bucket_cap_bytes, first_bucket_cap_bytes, pairing, mapping) -> dict:
    """The bucket caps, once ``mapping`` and ``pairing`` are known not to both be given."""
    if mapping is not None and pairing is not None:
        raise ValueError("give mapping= or pairing=, not both: a zero state planned with pairing= holds torch's "
                         "names and layouts already, and is saved and loaded as it is")
    return dict(bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)


def _check_zero(zero: ZeroState, layout: _Layout, world_size: int) -> None:
    if shard_flat(layout.plan, world_size).fingerprint() != zero.plan_fingerprint:
        raise CheckpointError("the ZeroState was planned with other bucket caps or leaf order than given here: "
                              "pass the order=, bucket caps, ready_order= and pairing= you gave hybrid.jax.zero")


def save(path: str | os.PathLike, params, opt_state=None, *, step: int, order=None, world_size: int | None = None,
         stage: int | None = None, optimizer: str | None = None, hyperparameters: dict | None = None,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES,
         metadata: dict | None = None, buffers=None, state: dict | None = None, mapping=None,
         ready_order=None, pairing=None, timeout_s: float = 60.0) -> Manifest:
    """Save params and optax state as a sharded checkpoint, every rank's file written in parallel.

    With a ``hybrid.jax.zero`` state (global arrays, as a jitted ``shard_map`` step returns them)
    device ``r``'s slices become rank ``r``'s file, in the zero plan's layout: no gathering of
    state. With a plain optax state (unsharded, e.g. ``optax.adam(...).init(params)``) the
    arrays are cut into ``world_size`` files (default 1).

    Under ``jax.distributed`` (several processes) this is a collective, as orbax's save is: every
    process calls it with the same arguments; each writes the files of the zero slices its devices
    hold (at stage 3 with the ParamShards' slices, so no process gathers the parameters; of an
    unsharded state: files ``p, p + P, ...``), process 0 writes the manifest once all
    files are in place, and every process returns the manifest. ``path`` must be on a file system
    all processes share. A process that fails makes the others raise with its error; one that dies
    or stalls is named in a RuntimeError once ``timeout_s`` has passed, and the previous checkpoint
    at ``path`` stays in place.

    Args:
      path: the checkpoint directory; an existing one is replaced only once the save is complete.
      params: the parameter pytree (replicated global arrays or host arrays), or the global
        :class:`hybrid.jax.ParamShards` of ZeRO stage 3.
      opt_state: the optax state, or None for parameters alone.
      step: the training step to record.
      order, bucket_cap_bytes, first_bucket_cap_bytes, ready_order, pairing: what
        ``hybrid.jax.zero`` was given. With ``pairing`` the plan is over torch's names and layouts,
        so the checkpoint is too: torch's ``hybrid.checkpoint.torch.load`` reads it as its own.
      world_size: files to write for an unsharded state (a zero state has its own).
      stage, optimizer, hyperparameters, metadata: recorded in the manifest (``optimizer``
        defaults to "adam" for a ScaleByAdamState, "sgd" for a TraceState).
      buffers: the non-trainable collection (flax's ``batch_stats``), replicated: saved once,
        named by key path as the parameters are (torch's buffer names for the same layout);
        read back with :func:`load_buffers`.
      state: JSON-serializable run state (data position, seeds), read back with
        :func:`hybrid.checkpoint.read_state`. An optax schedule needs nothing: its step count
        lives in the optimizer state, which the load restores.
      mapping: a ``hybrid.core.ParamMapping`` (or a resolved ``ParamPairing``): save under torch's
        names and layouts (docs/models.md), so torch's ``hybrid.checkpoint.torch.load`` reads the
        checkpoint as its own. A zero state is gathered and written as whole tensors, in as many
        files as it has devices. Buffers keep their JAX names.
      timeout_s: with several processes, how long the save may wait for the others (the slowest
        process's write included); unused in one process. The default, 60 s, stays below
        ``jax.distributed``'s heartbeat timeout (100 s), so a process that died is named by this
        save's error before JAX terminates the job; raise both for shards that take longer to write.

    >>> import jax.numpy as jnp, optax, tempfile, os
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    >>> state = optax.adam(1e-3).init(params)
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save(d, params, state, step=0, world_size=2).optimizer.slots
    ('mu', 'nu')
    """
    caps = _caps(bucket_cap_bytes, first_bucket_cap_bytes, pairing, mapping)
    if mapping is not None:
        view = TorchView.of(mapping, params, opt_state, order=order, caps=caps, ready_order=ready_order, host=True)
        return save(path, view.params, view.state, step=step, order=view.order, world_size=world_size or view.world_size,
                    stage=stage, optimizer=optimizer, hyperparameters=hyperparameters, metadata=metadata,
                    buffers=buffers, state=state, timeout_s=timeout_s, **caps)
    layout = _layout(params, order, caps, ready_order, pairing)
    # Stage 3 under jax.distributed: no process holds the parameters whole; each writes its
    # devices' slices of them, as of the optimizer state.
    sliced_params = isinstance(params, ParamShards) and jax.process_count() > 1
    host_params = None if sliced_params else [to_storage(p) for p in _host_params(params, layout)]
    extras = dict(metadata=metadata, buffers=_named_buffers(buffers),
                  run_state={"state": check_json(dict(state), "state")} if state is not None else {})
    info, slots, zero = None, {}, None
    if opt_state is not None:
        node, zero = _slot_node(opt_state)
        kinds = _SLOTS[type(node)]
        count = int(_host(node.count)) if "count" in node._fields else int(step)  # TraceState: tuple.count is a method
        info = OptimizerInfo(optimizer or ("adam" if "nu" in kinds else "sgd"), kinds, count,
                             dict(hyperparameters or {}))
        slots = {s: getattr(node, s) for s in kinds}
    common = dict(plan=layout.plan, step=step, stage=stage, optimizer=info, **extras)
    if zero is None:
        if sliced_params:
            raise CheckpointError("save: ZeRO stage 3's ParamShards across processes are saved with their "
                                  "hybrid.jax.zero(..., stage=3) state (opt_state), whose slices lie as theirs do")
        # Unsharded: whole arrays (replicated), cut into world_size files.
        arrays = {"params": host_params,
                  **{s: [to_storage(_host(a)) for a in layout.spec_arrays(v)] for s, v in slots.items()}}
        world_size = world_size or 1
        if jax.process_count() > 1:  # the files are dealt out to the processes
            mine = [r for r in range(world_size) if r % jax.process_count() == jax.process_index()]
            return save_from_processes(path, world_size=world_size, ranks=mine, arrays=arrays, timeout_s=timeout_s,
                                       **common)
        return save_sharded(path, world_size=world_size, arrays=arrays, framework="jax", **common)
    n = _world_of(slots[info.slots[0]][0])
    if world_size not in (None, n):
        raise ValueError(f"save: world_size={world_size}, but the zero state is sharded over {n} devices")
    _check_zero(zero, layout, n)
    if jax.process_count() > 1:  # each process writes the files of the devices it holds
        kinds, arrays = dict(slots), {"params": host_params}
        if sliced_params:  # the same plan cut over the same devices: files as one process writes them
            kinds, arrays = {**kinds, "params": params.buckets}, {}
        flats = _local_slices(kinds, n)
        return save_from_processes(path, world_size=n, ranks=sorted(flats), flat_kinds=tuple(kinds), flats=flats,
                                   arrays=arrays, timeout_s=timeout_s, **common)
    flats = {s: [to_storage(_host(a)) for a in v] for s, v in slots.items()}
    return save_sharded(path, world_size=n, flats=flats, arrays={"params": host_params}, framework="jax", **common)


def _local_slices(slots: dict[str, tuple], n: int) -> dict[int, dict[str, list[np.ndarray]]]:
    """This process's slices of zero's padded flat buckets: ``{rank: {slot: [slice of bucket b]}}``
    for the ranks whose slice it holds as replica 0 (a slice on several devices is written once)."""
    out: dict[int, dict[str, list[np.ndarray]]] = {}
    for slot, flats in slots.items():
        for flat in flats:
            for shard in flat.addressable_shards:
                if shard.replica_id == 0:
                    mine = out.setdefault(_rank(shard.index, flat, n), {})
                    mine.setdefault(slot, []).append(to_storage(np.asarray(shard.data)))
    # zero's flats share one sharding, so the process holding a rank's slice holds all of them
    assert all(set(mine) == set(slots) and all(len(mine[s]) == len(slots[s]) for s in slots)
               for mine in out.values()), "zero's flat buckets are sharded alike"
    return out


def _as_dtype(value: np.ndarray, old) -> np.ndarray:
    """``value`` (stored dtype: bfloat16 as its bits) in ``old``'s dtype."""
    value = np.asarray(value).view(old.dtype) if jnp.dtype(old.dtype) == jnp.bfloat16 else value
    return value.astype(old.dtype, copy=False)


def _like(value: np.ndarray, old):
    """``value`` (stored dtype, the whole array) as an array of ``old``'s dtype, placed as ``old`` is."""
    value = _as_dtype(value, old).reshape(old.shape)
    if isinstance(old, jax.Array) and old.committed:
        if old.is_fully_addressable:
            return jax.device_put(value, old.sharding)
        # Other processes hold the rest of the mesh: this one places what its devices hold.
        return jax.make_array_from_callback(old.shape, old.sharding, lambda index: value[index])
    return jnp.asarray(value)  # uncommitted, as the given array was: jit places it


def _rank(index: tuple[slice, ...], flat, n: int) -> int:
    """The rank whose slice of zero's padded flat bucket ``flat`` (over ``n`` devices) is ``index``."""
    return (index[0].start or 0) // (flat.shape[0] // n)


def _ranks_here(flat, n: int) -> set[int]:
    """The ranks whose slice of a zero flat bucket this process's devices hold."""
    return {_rank(index, flat, n) for index in flat.sharding.addressable_devices_indices_map(flat.shape).values()}


def _from_slices(old, n: int, slices: dict[int, np.ndarray]):
    """A zero flat bucket placed as ``old``, each device given its rank's slice (``slices[rank]``)."""
    def data(index):
        return _as_dtype(slices[_rank(index, old, n)], old)

    return jax.make_array_from_callback(old.shape, old.sharding, data)


def load(path: str | os.PathLike, params, opt_state=None, *, order=None,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES,
         mapping=None, ready_order=None, pairing=None):
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

    >>> import jax.numpy as jnp, optax, tempfile, os
    >>> params = {"w": jnp.arange(6.0).reshape(2, 3)}
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt"); _ = save(d, params, step=3, world_size=2)
    >>> loaded, _, step = load(d, {"w": jnp.zeros((2, 3))})
    >>> step, loaded["w"].tolist()
    (3, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    """
    caps = _caps(bucket_cap_bytes, first_bucket_cap_bytes, pairing, mapping)
    if mapping is not None:
        view = TorchView.of(mapping, params, opt_state, order=order, caps=caps, ready_order=ready_order, path=path,
                            host=False)
        loaded_params, loaded_state, step = load(path, view.params, view.state, order=view.order, **caps)
        return (*view.back(params, opt_state, loaded_params, loaded_state), step)
    layout = _layout(params, order, caps, ready_order, pairing)
    ckpt = Checkpoint(path)
    ckpt.check_model(layout.plan.specs, what="params")
    ckpt.verify()
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


def _named_buffers(buffers) -> dict[str, np.ndarray]:
    if buffers is None:
        return {}
    names, leaves, _ = _leaves(buffers)
    return {n: _host(x) for n, x in zip(names, leaves)}


def load_buffers(path: str | os.PathLike, buffers):
    """The checkpoint's buffers (torch's persistent buffers, or what JAX saved with ``buffers=``)
    in the structure, dtypes and placement of ``buffers`` (e.g. flax's ``batch_stats``), matched by
    key-path name; a missing, extra or mis-shaped buffer raises CheckpointError naming it.

    >>> import jax.numpy as jnp, tempfile, os
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = save(d, {"w": jnp.ones(2)}, step=1, buffers={"bn": {"mean": jnp.full(3, 0.5)}})
    >>> load_buffers(d, {"bn": {"mean": jnp.zeros(3)}})["bn"]["mean"].tolist()
    [0.5, 0.5, 0.5]
    """
    ckpt = Checkpoint(path)
    names, leaves, treedef = _leaves(buffers)
    ckpt.check_buffers({n: tuple(np.shape(x)) for n, x in zip(names, leaves)}, what="buffers")
    saved = ckpt.buffers()
    return jax.tree_util.tree_unflatten(treedef, [_like(saved[n], x) for n, x in zip(names, leaves)])


def _refuse_per_parameter_state(ckpt: Checkpoint, info: OptimizerInfo) -> None:
    """optax holds one count and every slot for every leaf: a torch state that does not is refused."""
    partial = [n for n in info.without_state if len(info.without_state) < len(ckpt.manifest.plan.specs)]
    if partial or info.counts or info.slot_params:
        raise CheckpointError(
            f"{ckpt.path}: torch's optimizer state is per parameter here (no state yet: {partial}; step counts "
            f"that differ: {info.counts}; slots held by some parameters only: {sorted(info.slot_params)}), and an "
            f"optax state holds one count and every slot for every leaf: resume it in torch, or save it once "
            f"every parameter has stepped alike")


def _flat_slices(ckpt: Checkpoint, kinds: dict[str, tuple], shards) -> dict[str, tuple]:
    """``{kind: buckets}``: every device's slices of each kind for the flat plan ``shards``, each
    bucket's global padded array placed as ``kinds[kind][b]`` is (resharded from the saved world
    size). Each process reads only the slices of the ranks its own devices hold (no communication
    under ``jax.distributed``), every kind and file in one pass, the files in parallel."""
    plan, n = ckpt.reshard_to(shards), shards.world_size
    ranks = sorted(_ranks_here(next(iter(kinds.values()))[0], n))
    read = ckpt.slices_of(list(kinds), plan, ranks)
    return {kind: tuple(_from_slices(o, n, {r: read[kind, r][b] for r in ranks}) for b, o in enumerate(old))
            for kind, old in kinds.items()}


def _load_state(ckpt: Checkpoint, layout: _Layout, opt_state):
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
            return ZeroState(_map_nodes(x.inner, replace), x.plan_fingerprint)
        return x

    return _map_nodes(opt_state, replace)
