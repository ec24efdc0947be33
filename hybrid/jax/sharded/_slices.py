"""What every ZeRO stage shares: the inner transform run on this device's flat bucket slices.

``zero`` (stages 1 and 2, ``_zero.py``) and its stage 3 (``_zero3.py``) hand the inner optax
transform a tuple of 1-D arrays, one slice per bucket of ``shard_flat``'s plan, so their states
are one type (:class:`ZeroState`) and one layout: what a checkpoint stores, whatever the stage.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import optax

from hybrid.jax._elementwise import GLOBAL_DECISIONS, check_exact_on_shards
from hybrid.jax._elementwise import non_elementwise as _non_elementwise
from hybrid.jax.sharded._masks import Binder, bind, contains_masks

_TRUST_RATIO = ("{} scales each leaf by a trust ratio, ||param|| / ||update|| of that whole leaf; on a flat "
                "shard it would be the ratio of the shard's norms. Use an elementwise optimizer (adamw) inside "
                "zero, or keep {} unsharded: optax.chain(hybrid.jax.bucketed_all_reduce(axis), optax.{}(...)).")
# What to do instead, by culprit (the key None for the rest).
_ADVICE = {
    "clip_by_global_norm": "zero rewrites optax.clip_by_global_norm to its axis-aware twin only in a chain or "
                           "named chain it wraps, not behind inject_hyperparams, MultiSteps or a mask: move the "
                           "clip into such a chain, or write hybrid.jax.clip_by_global_norm(max_norm, axis) there "
                           "(it sums the shards' squared norms over the axis).",
    "scale_by_trust_ratio": _TRUST_RATIO.format("LAMB (scale_by_trust_ratio)", "lamb", "lamb"),
    "scale_by_lars": _TRUST_RATIO.format("LARS (scale_by_lars)", "lars", "lars"),
    "apply_if_finite": "For skipping non-finite steps use " + GLOBAL_DECISIONS["apply_if_finite"] + ".",
    None: "Keep such a transform outside zero, after an unsharded reduction "
          "(optax.chain(hybrid.jax.bucketed_all_reduce(axis), transform)).",
}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner", "plan_tag"],
                   meta_fields=["plan_fingerprint"])
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """State of :func:`zero`: the inner transform's state over this device's bucket shards.

    ``inner`` was initialised on a tuple of 1-D arrays, one per bucket (this device's slice of
    it), at every stage. ``plan_fingerprint`` is static (part of the tree structure), so a params
    tree whose layout changed between ``init`` and ``update`` is caught at trace time.

    ``plan_tag`` is a uint32 scalar, the first 32 bits of the bucket plan's fingerprint
    (:meth:`hybrid.core.BucketPlan.tag`), the same on every device. A checkpointer that writes a
    tree's leaves and not its static metadata (orbax's ``StandardSave``) keeps it, so a reader knows
    which plan the flat buckets are laid out by: stages 1-2 and stage 3 plan the same params into
    buckets of the same lengths but another order, and the lengths alone cannot tell them apart.
    """

    inner: optax.OptState
    plan_fingerprint: str
    plan_tag: jax.Array


def zero_state(inner, shards) -> ZeroState:
    """A new :class:`ZeroState` of ``inner`` over the shard plan ``shards``."""
    return ZeroState(inner, shard_key(shards), jax.numpy.asarray(shards.bucket_plan.tag(), jax.numpy.uint32))


class _ShardKey(str):
    """``ZeroState.plan_fingerprint``: the shard plan's fingerprint (compared and hashed as that
    string), whose repr says what it is, since JAX prints it when a state spec tree differs."""

    def __repr__(self):
        return (f"{str.__repr__(self)} (zero's shard plan: bucket plan {self.bucket_plan!r} cut for "
                f"axis_size={self.axis_size})")


def shard_key(shards) -> str:
    key = _ShardKey(shards.fingerprint())
    key.bucket_plan, key.axis_size = shards.bucket_plan.fingerprint(), shards.world_size
    return key


def check_plan(state, shards, what: str = "zero.update") -> None:
    """Raise unless ``state`` is a :class:`ZeroState` of the shard plan ``shards`` (the updates')."""
    if not isinstance(state, ZeroState):
        raise TypeError(f"{what}: state must be the ZeroState from zero.init, got {type(state).__name__}")
    if shards.fingerprint() != state.plan_fingerprint:
        raise ValueError(f"{what}: the updates' tree (names, shapes, dtypes) or the axis size "
                         f"differs from the one zero.init saw (plan {shards.fingerprint()} vs "
                         f"{state.plan_fingerprint}); re-run init after changing the model")


def check_inner(inner: optax.GradientTransformation, axis_name, check_elementwise: bool) -> None:
    """Refuse an inner transform that is not exact on flat slices (see ``hybrid.jax._elementwise``)."""
    if not check_elementwise:
        return
    bad = _non_elementwise(inner)
    if bad:
        advice = " ".join(dict.fromkeys(_ADVICE.get(name, _ADVICE[None]) for name in bad))
        raise ValueError(f"zero: inner transform uses {bad}, which depend on statistics across "
                         f"elements or on tree structure and are not exact on flat shards. {advice} "
                         f"Or pass check_elementwise=False if you accept the difference")
    check_exact_on_shards(inner, axis_name)


def on_slices(inner: optax.GradientTransformation):
    """``inner`` for this device's slices: ``(tree, layout, shards, rank) -> transform`` with its
    masks and labels, given per leaf of ``tree``, rewritten per element (``hybrid.jax.sharded._masks``)."""
    if not contains_masks(inner):
        return lambda tree, layout, shards, rank: inner
    return lambda tree, layout, shards, rank: bind(inner, Binder(tree, layout, shards, rank))
