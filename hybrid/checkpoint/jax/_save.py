"""Saving JAX state: replicated params (or stage 3's ParamShards) and a zero or plain optax state,
from one process or from every process of a ``jax.distributed`` job."""

from __future__ import annotations

import os

import jax
import numpy as np

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES
from hybrid.jax import ParamShards, ZeroState
from hybrid.jax._specs import _leaves
from hybrid.checkpoint._manifest import CheckpointError, Manifest, OptimizerInfo
from hybrid.checkpoint._write import check_json, save_sharded, to_storage
from hybrid.checkpoint.jax._mapped import TorchView
from hybrid.checkpoint.jax._processes import save_from_processes
from hybrid.checkpoint.jax._tree import (_SLOTS, _caps, _check_zero, _host, _host_params, _layout, _rank, _slot_node,
                                         _world_of)


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
        scalars = _state_scalars(opt_state, node)
        if scalars:  # a schedule's own count, MultiSteps' and apply_if_finite's counters: loaded as saved
            from hybrid.checkpoint._other_state import CARRIED, carried
            extras["run_state"] = {**extras["run_state"], CARRIED: carried(scalars, source="jax", where=str(path))}
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


def _named_buffers(buffers) -> dict[str, np.ndarray]:
    if buffers is None:
        return {}
    names, leaves, _ = _leaves(buffers)
    return {n: _host(x) for n, x in zip(names, leaves)}


def _state_scalars(opt_state, node) -> list[tuple[tuple, object]]:
    """``[(("opt_state", *key path), value)]``: every scalar of the optax state but the slot node's
    count (which the manifest's optimizer count is), as plain numbers."""
    def name(key) -> str:
        for field in ("name", "key", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)

    own = id(getattr(node, "count", None)) if "count" in getattr(node, "_fields", ()) else None
    # zero's plan tag says how the saved buckets were laid out: the manifest's plan says that here,
    # and the state a load fills keeps its own plan's tag.
    tags = {id(z.plan_tag) for z in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ZeroState))
            if isinstance(z, ZeroState)}
    return [(("opt_state", *(name(k) for k in path)), _host(x).item())
            for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
            if np.ndim(x) == 0 and id(x) != own and id(x) not in tags]
