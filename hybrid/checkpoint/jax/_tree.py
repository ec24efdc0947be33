"""What saving and loading JAX state share: finding the optimizer's slot node in an optax state,
host copies, the layout a zero state was planned with, and which rank a flat slice belongs to."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hybrid.core import shard_flat, unpack
from hybrid.jax import ParamShards, ZeroState
from hybrid.jax._specs import _Layout
from hybrid.checkpoint._manifest import CheckpointError

_SLOTS = {optax.ScaleByAdamState: ("mu", "nu"), optax.TraceState: ("trace",)}
_NODES = (ZeroState, optax.ScaleByScheduleState, *_SLOTS)


def _as_dtype(value: np.ndarray, old) -> np.ndarray:
    """``value`` (stored dtype: bfloat16 as its bits) in ``old``'s dtype."""
    value = np.asarray(value).view(old.dtype) if jnp.dtype(old.dtype) == jnp.bfloat16 else value
    return value.astype(old.dtype, copy=False)


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


def _rank(index: tuple[slice, ...], flat, n: int) -> int:
    """The rank whose slice of zero's padded flat bucket ``flat`` (over ``n`` devices) is ``index``."""
    return (index[0].start or 0) // (flat.shape[0] // n)
