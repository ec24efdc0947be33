"""ZeRO stage 1 and 2 as an optax wrapper: optimizer state for this device's flat shard only."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, BucketPlan, ParamPairing
from hybrid.jax._copy import check_backend, pack_bucket, unpack_bucket, use_kernels
from hybrid.jax._elementwise import GLOBAL_DECISIONS, NON_ELEMENTWISE, check_exact_on_shards
from hybrid.jax._elementwise import non_elementwise as _non_elementwise
from hybrid.jax._masks import Binder, bind, contains_masks
from hybrid.jax._on_shards import on_shards
from hybrid.jax._specs import _Layout, axis_size, check_caps, check_per_device, check_state_per_device

_TRUST_RATIO = ("{} scales each leaf by a trust ratio, ||param|| / ||update|| of that whole leaf; on a flat "
                "shard it would be the ratio of the shard's norms. Use an elementwise optimizer (adamw) inside "
                "zero, or keep {} unsharded: optax.chain(hybrid.jax.bucketed_all_reduce(axis), optax.{}(...)).")
# What to do instead, by culprit (the key None for the rest).
_ADVICE = {
    "clip_by_global_norm": "For global-norm clipping use hybrid.jax.clip_by_global_norm(max_norm, axis) "
                           "inside zero: it sums the shards' squared norms over the axis.",
    "scale_by_trust_ratio": _TRUST_RATIO.format("LAMB (scale_by_trust_ratio)", "lamb", "lamb"),
    "scale_by_lars": _TRUST_RATIO.format("LARS (scale_by_lars)", "lars", "lars"),
    "apply_if_finite": "For skipping non-finite steps use " + GLOBAL_DECISIONS["apply_if_finite"] + ".",
    None: "Keep such a transform outside zero, after an unsharded reduction "
          "(optax.chain(hybrid.jax.bucketed_all_reduce(axis), transform)).",
}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner"], meta_fields=["plan_fingerprint"])
@dataclasses.dataclass(frozen=True)
class ZeroState:
    """State of :func:`zero`: the inner transform's state over this device's bucket shards.

    ``inner`` was initialised on a tuple of 1-D arrays, one per bucket (this device's slice of
    it). ``plan_fingerprint`` is static (part of the tree structure), so a params tree whose
    layout changed between ``init`` and ``update`` is caught at trace time.
    """

    inner: optax.OptState
    plan_fingerprint: str


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


def zero(inner: optax.GradientTransformation, axis_name, *, stage: int = 1,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
         first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES, mean: bool = True,
         order: Sequence[str] | None = None, check_elementwise: bool = True,
         copy_backend: str | None = None, ready_order: Sequence[str] | None = None,
         pairing: ParamPairing | None = None, plan: BucketPlan | None = None) -> optax.GradientTransformation:
    """Shard ``inner``'s optimizer state over ``axis_name`` (ZeRO stage 1 or 2).

    Gradients (per device, see :func:`hybrid.jax.local_grad`) are packed into the buckets of
    ``hybrid.core.plan_buckets``; every bucket is cut into equal slices by ``shard_flat``.
    Both stages reduce-scatter each bucket (``psum_scatter``) to this device's slice: in a
    functional step the full reduced gradient is never returned, so stage 1 and 2 are one program
    (see docs/jax.md). ``inner`` then updates the slices (params sliced alike for weight decay)
    and the updates are all-gathered back into the tree. ``init`` and ``update`` must run where
    ``axis_name`` is bound: ``jax.shard_map`` (state out_specs from :func:`hybrid.jax.state_specs`),
    ``jax.pmap``, or a multi-process mesh.

    Exact for elementwise transforms (sgd, momentum, adam, adamw, lion, ...), for
    :func:`hybrid.jax.clip_by_global_norm`, and for weight-decay masks and param groups
    (``optax.masked``, ``adamw(mask=...)``, ``add_decayed_weights(mask=...)``,
    ``optax.partition`` / ``multi_transform``, in chains): ``zero`` rewrites them per element of
    its flat slices (``hybrid.jax._masks``; a masked transform keeps state for the whole slice).
    Known non-elementwise optax transforms (``NON_ELEMENTWISE``: ``optax.clip_by_global_norm``,
    trust ratios, factored second moments ...), also inside ``inject_hyperparams``,
    ``MultiSteps`` and chains, and masks behind such wrappers raise a ValueError unless
    ``check_elementwise=False``, as do ``optax.apply_if_finite`` (use
    :func:`hybrid.jax.apply_if_finite`) and any transform that a small probe finds
    non-elementwise (see ``hybrid.jax._elementwise``).

    The first mistake, which no check can see: clipping *before* ``zero``,
    ``optax.chain(optax.clip_by_global_norm(c), zero(adamw, "dp"))``, clips each device's own
    gradient (zero reduces after it). Clip inside:
    ``zero(optax.chain(hybrid.jax.clip_by_global_norm(c, "dp"), adamw), "dp")``.

    Args:
      inner: any optax transform.
      axis_name: the data-parallel axis.
      stage: 1 or 2, accepted for parity with torch's ZeRO-1 / ZeRO-2; the same program.
      bucket_cap_bytes / first_bucket_cap_bytes: bucket caps, as DDP's.
      mean: average gradients over the axis (DDP) instead of summing.
      order: leaf names in registration order (see :func:`hybrid.jax.specs`).
      check_elementwise: refuse known non-elementwise inner transforms.
      copy_backend: ``"auto"`` | ``"cuda"`` | ``"reference"``: how buckets are packed and
        unpacked, as for :func:`hybrid.jax.bucketed_all_reduce`.
      ready_order, pairing: plan as torch's DDP holds its buckets after its rebuild, as for
        :func:`hybrid.jax.bucketed_all_reduce`: the slices are then torch's ZeRO2 slices.
      plan: a :class:`hybrid.core.BucketPlan` to cut as it is (:func:`hybrid.jax.auto_bucket_plan`
        with ``kind="reduce_scatter", after_step=[("all_gather", 1)]``), as for
        :func:`hybrid.jax.bucketed_all_reduce`.

    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> tx = zero(optax.sgd(0.1), "dp", stage=2)
    >>> params = {"w": jnp.ones((4, 3))}
    >>> def step(g):
    ...     state = tx.init(params)
    ...     return tx.update(g, state, params)[0]
    >>> out = jax.pmap(step, axis_name="dp")({"w": jnp.ones((4, 4, 3))})
    >>> round(float(out["w"][0, 0, 0]), 6)
    -0.1
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    check_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    check_backend(copy_backend)
    if check_elementwise:
        bad = _non_elementwise(inner)
        if bad:
            advice = " ".join(dict.fromkeys(_ADVICE.get(name, _ADVICE[None]) for name in bad))
            raise ValueError(f"zero: inner transform uses {bad}, which depend on statistics across "
                             f"elements or on tree structure and are not exact on flat shards. {advice} "
                             f"Or pass check_elementwise=False if you accept the difference")
    caps = dict(bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)
    if check_elementwise:
        check_exact_on_shards(inner, axis_name)

    def layout_of(tree, what):
        return _Layout.of(tree, what=what, order=order, ready_order=ready_order, pairing=pairing, plan=plan, **caps)

    def local_shards(layout, shards, tree, rank, cuda):
        # This device's slice of every bucket of a replicated tree: no communication.
        arrays = layout.spec_arrays(tree)
        out = []
        for b in range(layout.plan.num_buckets):
            flat = pack_bucket(layout.plan, b, arrays, length=shards.padded_length(b), cuda=cuda)
            size = shards.shard_sizes[b]
            out.append(jax.lax.dynamic_slice_in_dim(flat, rank * size, size))
        return tuple(out)

    masked = contains_masks(inner)

    def flat_inner(tree, layout, shards, rank):
        # Masks and labels are per leaf; on flat slices they become per element (see _masks).
        return bind(inner, Binder(tree, layout, shards, rank)) if masked else inner

    def init_fn(params):
        n = axis_size(axis_name, "zero.init")
        layout = layout_of(params, "zero.init")
        shards = layout.shards(n)
        rank = jax.lax.axis_index(axis_name)
        param_shards = local_shards(layout, shards, params, rank, use_kernels(copy_backend))
        with on_shards(axis_name):
            inner_state = flat_inner(params, layout, shards, rank).init(param_shards)
        return ZeroState(inner_state, shard_key(shards))

    def update_fn(updates, state, params=None):
        if not isinstance(state, ZeroState):
            raise TypeError(f"zero.update: state must be the ZeroState from zero.init, got {type(state).__name__}")
        n = axis_size(axis_name, "zero.update")
        check_per_device(updates, axis_name, "zero.update")
        check_state_per_device(state, axis_name, "zero.update")
        layout = layout_of(updates, "zero.update")
        shards = layout.shards(n)
        if shards.fingerprint() != state.plan_fingerprint:
            raise ValueError(f"zero.update: the updates' tree (names, shapes, dtypes) or the axis size "
                             f"differs from the one zero.init saw (plan {shards.fingerprint()} vs "
                             f"{state.plan_fingerprint}); re-run init after changing the model")
        rank = jax.lax.axis_index(axis_name)
        cuda = use_kernels(copy_backend)
        arrays = layout.spec_arrays(updates)
        grad_shards = []
        for b in range(layout.plan.num_buckets):
            flat = pack_bucket(layout.plan, b, arrays, length=shards.padded_length(b), cuda=cuda)
            shard = _reduce_scatter(flat, axis_name)  # both stages: see _reduce_scatter
            grad_shards.append(shard / n if mean else shard)
        param_shards = None
        if params is not None:
            param_layout = layout_of(params, "zero.update params")
            if param_layout.plan != layout.plan:
                raise ValueError("zero.update: params and updates must be trees of the same names, "
                                 "shapes and dtypes")
            param_shards = local_shards(param_layout, shards, params, rank, cuda)
        with on_shards(axis_name):
            new_shards, inner_state = flat_inner(updates, layout, shards, rank).update(
                tuple(grad_shards), state.inner, param_shards)
        out = {}
        for b, shard in enumerate(new_shards):
            full = _all_gather(shard, axis_name)
            out.update(unpack_bucket(layout.plan, b, full, cuda=cuda))
        return layout.unflatten(out), ZeroState(inner_state, state.plan_fingerprint)

    return optax.GradientTransformation(init_fn, update_fn)


def _reduce_scatter(flat, axis_name):
    """This device's slice of the bucket summed over the axis, at stage 1 as at stage 2.

    A functional step never returns the full reduced gradient, so stage 1 needs no all-reduce:
    reduce-scatter here plus all-gather of the updates moves what DDP's one all-reduce moves
    (ZeRO's P_os). A bucket of zero-size leaves has nothing to reduce, and XLA cannot lower a
    collective over it.
    """
    if flat.shape[0] == 0:
        return flat
    return jax.lax.psum_scatter(flat, axis_name, scatter_dimension=0, tiled=True)


def _all_gather(shard, axis_name):
    """The bucket of every device's updated slice, invariant over the axis.

    ``to="invarying"``: every device holds the same result, so shard_map may return it as P().
    An empty bucket is a constant, invariant too.
    """
    if shard.shape[0] == 0:
        return jnp.zeros((0,), shard.dtype)
    return jax.lax.all_gather(shard, axis_name, axis=0, tiled=True, to="invarying")
