"""``shard_map`` partition specs for the optimizer states of hybrid's transforms (in any optax chain)."""

from __future__ import annotations

import warnings

import jax
import optax
from jax.sharding import PartitionSpec

from hybrid.jax._all_reduce import BucketedAllReduceState
from hybrid.jax.sharded._params import ParamShards
from hybrid.jax.sharded._slices import ZeroState

# States whose arrays differ per device: ZeRO's shards, the all-reduce's bucket buffers.
_PER_DEVICE = (ZeroState, BucketedAllReduceState)


def state_specs(tx: optax.GradientTransformation, params, axis_name, *, axis_size: int):
    """``shard_map`` in/out specs for the state of ``tx``, any optax chain of hybrid and plain transforms.

    Inside a :class:`hybrid.jax.ZeroState` or :class:`hybrid.jax.BucketedAllReduceState`, every
    array with a dimension is per device (``P(axis_name)``: concatenated over devices, a ZeRO
    state leaf is the padded bucket, a bucket buffer the devices' buffers end to end) and scalars
    (step counts) are replicated (``P()``). Every other leaf, such as the state of a plain
    ``optax.adam`` chained after :func:`hybrid.jax.bucketed_all_reduce`, is replicated: it is
    computed from reduced gradients, the same on every device.

    For ``zero(..., stage=3)`` pass the :class:`hybrid.jax.ParamShards` its ``init`` takes, as
    global arrays (what ``shard_map`` returns) or one device's slices; the shards themselves take
    ``P(axis_name)``.

    >>> import jax.numpy as jnp, optax
    >>> from hybrid.jax import bucketed_all_reduce, zero
    >>> state_specs(zero(optax.sgd(0.1, momentum=0.9), "dp"), {"w": jnp.ones(3)}, "dp", axis_size=4).inner[0].trace
    (P('dp',),)
    >>> specs = state_specs(optax.chain(bucketed_all_reduce("dp"), optax.adam(1e-3)), {"w": jnp.ones(3)},
    ...                     "dp", axis_size=4)
    >>> specs[0].buckets, specs[1][0].mu["w"]
    ((P('dp',),), P())
    """
    if isinstance(params, ParamShards):
        params = _one_device(params, axis_size)
    # vmap binds axis_name (zero.init needs it) and adds a leading axis of axis_size to every
    # output: ndim beyond it tells arrays from scalars.
    shapes = jax.eval_shape(jax.vmap(tx.init, in_axes=None, axis_size=axis_size, axis_name=axis_name), params)

    if type(tx) is optax.MultiSteps and _reduces(shapes.inner_opt_state):
        warnings.warn("optax.MultiSteps runs its inner transform on every micro-step and keeps the result on the "
                      "k-th only: the collectives of hybrid's transforms inside it run every micro-step, thrown "
                      "away k - 1 times in k. hybrid.jax.MultiSteps takes the same arguments and state and runs "
                      "them on the k-th micro-step alone (torch's no_sync)", stacklevel=2)
    return _specs_of(shapes, axis_name)


def _reduces(state) -> bool:
    """Whether ``state`` holds a per-device state of hybrid's (zero's slices, bucket buffers)."""
    return any(isinstance(x, _PER_DEVICE) for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, _PER_DEVICE)))


def _is_node(x) -> bool:
    return isinstance(x, (*_PER_DEVICE, optax.MultiStepsState))


def _per_device(tree, axis_name):
    return jax.tree_util.tree_map(lambda s: PartitionSpec(axis_name) if s.ndim > 1 else PartitionSpec(), tree)


def _specs_of(shapes, axis_name):
    """Specs of a state's shapes (a leading axis of the axis size on every leaf)."""
    def spec(node):
        if isinstance(node, _PER_DEVICE):
            return _per_device(node, axis_name)
        if isinstance(node, optax.MultiStepsState):
            inner = _specs_of(node.inner_opt_state, axis_name)
            # MultiSteps around zero or bucketed_all_reduce accumulates this device's own
            # gradients (they reduce them): per device. Around a plain transform the gradients
            # it is given were reduced already, so its accumulator is the same on every device.
            reduces = _reduces(node.inner_opt_state)
            if reduces:
                _check_accumulable(node.acc_grads)
            acc = _per_device(node.acc_grads, axis_name) if reduces else _replicated(node.acc_grads)
            return node._replace(inner_opt_state=inner, acc_grads=acc, mini_step=PartitionSpec(),
                                 gradient_step=PartitionSpec(), skip_state=_replicated(node.skip_state))
        return PartitionSpec()

    return jax.tree_util.tree_map(spec, shapes, is_leaf=_is_node)


def _replicated(tree):
    return jax.tree_util.tree_map(lambda s: PartitionSpec(), tree)


def _check_accumulable(acc_grads) -> None:
    """A per-device accumulator is concatenated over the devices on its first dimension outside
    ``shard_map``; a scalar parameter's has none."""
    for path, s in jax.tree_util.tree_flatten_with_path(acc_grads)[0]:
        if s.ndim < 2:
            raise ValueError(f"state_specs: MultiSteps accumulates this device's own gradient of the scalar "
                             f"parameter {jax.tree_util.keystr(path)}, which has no dimension to hold one per "
                             f"device outside shard_map; give it shape (1,)")


def _one_device(shards: ParamShards, axis_size: int) -> ParamShards:
    """One device's slices (shapes and dtypes) of global or per-device ParamShards."""
    plan = shards.layout.shards
    if plan.world_size != axis_size:
        raise ValueError(f"state_specs: the shards were cut for {plan.world_size} device(s), axis_size={axis_size}")
    return ParamShards(tuple(jax.ShapeDtypeStruct((size,), x.dtype) for size, x in zip(plan.shard_sizes, shards.buckets)),
                       shards.layout)
