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
    """``value`` (stored dtype: bfloat16, the float8 types as their bits) in ``old``'s dtype:
    bits viewed where ``value`` holds those of ``old``'s dtype (ml_dtypes' types), else converted."""
    from hybrid.checkpoint._dtypes import storage_dtype
    from hybrid.core import canonical_dtype

    value, dtype = np.asarray(value), np.dtype(old.dtype)
    if value.dtype != dtype and value.dtype == storage_dtype(canonical_dtype(dtype)):
        return value.view(dtype)
    return value.astype(dtype, copy=False)


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


def jax_lacks(dtype: str) -> str | None:
    """Why JAX cannot hold an array of ``dtype`` (a checkpoint's dtype name) as it is, or None:
    complex32 has no JAX type; the 64-bit types need ``jax_enable_x64``.

    >>> jax_lacks("bfloat16") is None, jax_lacks("complex32")
    (True, 'JAX has no complex32 type')
    """
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # x64 off: "requested float64 will be truncated", said below
            jnp.zeros((0,), dtype)
    except TypeError:
        return f"JAX has no {dtype} type"
    if jax.dtypes.canonicalize_dtype(dtype) != np.dtype(dtype):
        return (f"JAX holds {dtype} only with jax.config.update('jax_enable_x64', True) (without it, "
                f"{jax.dtypes.canonicalize_dtype(dtype)})")
    return None


def check_jax_dtypes(dtypes: dict[str, str], wanted, *, where: str, what: str = "tensor",
                     converts_64: bool = False) -> None:
    """Raise CheckpointError naming the first of ``wanted`` (``{name: the receiving array's
    dtype}``) whose saved dtype (``dtypes[name]``) JAX cannot hold, or that is not the receiving
    dtype where either is held as bits (bfloat16, float8: no conversion), before anything is read.
    ``converts_64``: a 64-bit value goes into the 32-bit array given for it without x64 (a
    buffer's count, as the template asks), where parameters are refused."""
    from hybrid.checkpoint._dtypes import is_stored_as_bits
    from hybrid.core import canonical_dtype

    for name, into in wanted.items():
        if name not in dtypes:
            continue
        saved, into = dtypes[name], canonical_dtype(into)
        why = jax_lacks(saved)
        if why is not None and converts_64 and not why.startswith("JAX has no"):
            why = None
        if why is None and saved != into and (is_stored_as_bits(saved) or is_stored_as_bits(into)):
            why = f"the receiving array is {into}"
        if why is not None:
            raise CheckpointError(f"{where}: {what} {name!r} is {dtypes[name]}, and {why}: it cannot be loaded into "
                                  f"JAX bit for bit (load it in torch, or save it as another dtype)")
