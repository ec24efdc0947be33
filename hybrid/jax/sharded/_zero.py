"""ZeRO stage 1 and 2 as an optax wrapper: optimizer state for this device's flat shard only."""

from __future__ import annotations

import dataclasses

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, BucketPlan, ParamPairing
from hybrid.jax._copy import check_backend, pack_bucket, unpack_bucket, use_kernels
from hybrid.jax._elementwise import NON_ELEMENTWISE
from hybrid.jax.sharded._on_shards import on_shards
from hybrid.jax.sharded._global import own_slices
from hybrid.jax.sharded._xla_flags import on_xla_cpu
from hybrid.jax.sharded._params import local_slices
from hybrid.jax._specs import _Layout, axis_size, check_caps, check_per_device, check_state_per_device
from hybrid.jax.sharded._axis_aware import axis_aware
from hybrid.jax.sharded._zero3 import zero3
from hybrid.jax.sharded._jit import zero_jit
from hybrid.jax.sharded._slices import ZeroState, check_inner, check_plan, on_slices, zero_state

__all__ = ["NON_ELEMENTWISE", "ZeroState", "zero"]
_DEFAULTS = dict(bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_CAP_BYTES,
                 order=None, copy_backend=None, ready_order=None, pairing=None, plan=None)


def zero(inner: optax.GradientTransformation, axis_name, *, stage: int = 1,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
         first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES, mean: bool = True,
         order: Sequence[str] | None = None, check_elementwise: bool = True,
         copy_backend: str | None = None, ready_order: Sequence[str] | None = None,
         pairing: ParamPairing | None = None, plan: BucketPlan | None = None,
         mesh: Mesh | None = None) -> optax.GradientTransformation:
    """Shard ``inner``'s optimizer state over ``axis_name`` (ZeRO stage 1 or 2), or with the
    parameters and gradients too (stage 3).

    Gradients (per device, see :func:`hybrid.jax.local_grad`) are packed into the buckets of
    ``hybrid.core.plan_buckets``; every bucket is cut into equal slices by ``shard_flat``.
    Both stages reduce-scatter each bucket (``psum_scatter``) to this device's slice: in a
    functional step the full reduced gradient is never returned, so stage 1 and 2 are one program
    (see docs/jax-zero.md). ``inner`` then updates the slices (params sliced alike for weight decay)
    and the updates are all-gathered back into the tree. ``init`` and ``update`` must run where
    ``axis_name`` is bound: ``jax.shard_map`` (state out_specs from :func:`hybrid.jax.state_specs`),
    ``jax.pmap``, or a multi-process mesh.

    Stage 3 steps :class:`hybrid.jax.ParamShards` (this device's flat slice of every bucket, from
    :func:`hybrid.jax.shard_params`) with the gradient slices ``jax.grad`` returns through
    :func:`hybrid.jax.gathered` / :func:`hybrid.jax.gather_params` (already reduce-scattered;
    ``update`` divides by the axis size for the mean) and returns updates of the slices: no
    collective of its own. The bucket plan travels with the shards (``hybrid.core.zero3_plan``, the
    plan of ``hybrid.torch.ZeRO3``), so the caps, ``order``, ``pairing``, ``plan`` and
    ``copy_backend`` go to ``shard_params`` instead (given here at stage 3, a ValueError).
    Its state is the stage-2 state of the same plan (see docs/jax-zero.md, "ZeRO-3").

    Exact for elementwise transforms (sgd, momentum, adam, adamw, lion, ...), for global-norm
    clipping, and for weight-decay masks and param groups (``optax.masked``,
    ``adamw(mask=...)``, ``add_decayed_weights(mask=...)``, ``optax.partition`` /
    ``multi_transform``, in chains): ``zero`` rewrites masks per element of its flat slices
    (``hybrid.jax.sharded._masks``; a masked transform keeps state for the whole slice), and an
    ``optax.clip_by_global_norm`` in a chain or named chain to its axis-aware twin,
    :func:`hybrid.jax.clip_by_global_norm` (``hybrid.jax.sharded._axis_aware``). So an existing
    optax chain wrapped whole, ``zero(optax.chain(optax.clip_by_global_norm(c), adamw), "dp")``,
    gives the unsharded result. Known non-elementwise optax transforms (``NON_ELEMENTWISE``:
    trust ratios, factored second moments ...; a global-norm clip behind ``inject_hyperparams``,
    ``MultiSteps`` or a mask), and masks behind such wrappers raise a ValueError unless
    ``check_elementwise=False``, as do ``optax.apply_if_finite`` (use
    :func:`hybrid.jax.apply_if_finite`) and any transform that a small probe finds
    non-elementwise (see ``hybrid.jax._elementwise``).

    The one mistake no check can see: clipping *before* ``zero``,
    ``optax.chain(optax.clip_by_global_norm(c), zero(adamw, "dp"))``, clips each device's own
    gradient (zero reduces after it). Wrap the whole chain instead:
    ``zero(optax.chain(optax.clip_by_global_norm(c), adamw), "dp")``.

    Args:
      inner: any optax transform.
      axis_name: the data-parallel axis.
      stage: 1 or 2, accepted for parity with torch's ZeRO-1 / ZeRO-2 (the same program), or 3.
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
      mesh: run inside a plain ``jax.jit`` over this ``Mesh`` instead of ``shard_map``: gradients
        are ``jax.grad`` of the loss over the global batch, the state (and at stage 3 the
        ``ParamShards``) global arrays sharded ``P(axis_name)``; the same plan and state layout
        (``hybrid.jax.sharded._jit``, docs/jax.md).

    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> tx = zero(optax.sgd(0.1), "dp", stage=2)
    >>> params = {"w": jnp.ones((4, 3))}
    >>> def step(g):
    ...     state = tx.init(params)
    ...     return tx.update(g, state, params)[0]
    >>> out = jax.pmap(step, axis_name="dp")({"w": jnp.ones((4, 4, 3))})
    >>> round(float(out["w"][0, 0, 0]), 6)
    -0.1

    In a plain ``jax.jit`` over a mesh, plain ``jax.grad`` of the loss over the global batch:

    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    >>> tx = zero(optax.sgd(0.1, momentum=0.9), "data", stage=2, mesh=mesh)
    >>> w = jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))
    >>> state = jax.jit(tx.init)(w)
    >>> u, state = jax.jit(tx.update)(jax.grad(lambda w: jnp.sum(w ** 2))(w), state, w)
    >>> [round(v, 6) for v in u.tolist()]
    [-0.2, -0.2, -0.2, -0.2]
    >>> [s.data.shape for s in state.inner[0].trace[0].addressable_shards]  # momentum: 2 of 4 per device
    [(2,), (2,)]
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if mesh is not None:  # the plain-jit path: XLA partitions global buckets (hybrid.jax.sharded._jit)
        options = dict(bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes,
                       order=order, copy_backend=copy_backend, ready_order=ready_order, pairing=pairing, plan=plan)
        if stage == 3 and any(v != _DEFAULTS[k] for k, v in options.items()):
            raise ValueError(f"zero(stage=3): {sorted(k for k, v in options.items() if v != _DEFAULTS[k])} would "
                             f"have no effect: at stage 3 the bucket plan travels with the ParamShards; pass them "
                             f"to hybrid.jax.shard_params(params, axis, mesh=mesh) or hybrid.jax.init_shards")
        return zero_jit(inner, axis_name, mesh, stage=stage, mean=mean, check_elementwise=check_elementwise,
                        plan_options=options)
    inner = axis_aware(inner, axis_name)  # optax.clip_by_global_norm in the chain: its axis-aware twin
    if stage == 3:
        given = {k: v for k, v in dict(bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes,
                                       order=order, copy_backend=copy_backend, ready_order=ready_order,
                                       pairing=pairing, plan=plan).items() if v != _DEFAULTS[k]}
        if given:
            raise ValueError(f"zero(stage=3): {sorted(given)} would have no effect: at stage 3 the bucket plan "
                             f"travels with the ParamShards; pass them to hybrid.jax.shard_params (its plan is "
                             f"hybrid.core.zero3_plan, torch ZeRO3's: reverse registration order, no ready_order)")
        return zero3(inner, axis_name, mean=mean, check_elementwise=check_elementwise)
    check_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    check_backend(copy_backend)
    check_inner(inner, axis_name, check_elementwise)
    caps = dict(bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes)

    def layout_of(tree, what):
        return _Layout.of(tree, what=what, order=order, ready_order=ready_order, pairing=pairing, plan=plan, **caps)

    flat_inner = on_slices(inner)  # masks and labels are per leaf; on flat slices per element

    def init_fn(params):
        n = axis_size(axis_name, "zero.init")
        layout = layout_of(params, "zero.init")
        shards = layout.shards(n)
        rank = jax.lax.axis_index(axis_name)
        param_shards = local_slices(layout, shards, params, rank, use_kernels(copy_backend))
        with on_shards(axis_name):
            inner_state = flat_inner(params, layout, shards, rank).init(param_shards)
        return zero_state(inner_state, shards)

    def update_fn(updates, state, params=None):
        if not isinstance(state, ZeroState):
            raise TypeError(f"zero.update: state must be the ZeroState from zero.init, got {type(state).__name__}")
        n = axis_size(axis_name, "zero.update")
        check_per_device(updates, axis_name, "zero.update")
        check_state_per_device(state, axis_name, "zero.update")
        layout = layout_of(updates, "zero.update")
        shards = layout.shards(n)
        check_plan(state, shards)
        rank = jax.lax.axis_index(axis_name)
        cuda = use_kernels(copy_backend)
        arrays = layout.spec_arrays(updates)
        reduced = []
        for b in range(layout.plan.num_buckets):
            flat = pack_bucket(layout.plan, b, arrays, length=shards.padded_length(b), cuda=cuda)
            reduced.append(_reduce_scatter(flat, axis_name))  # both stages: see _reduce_scatter
        scale = (lambda shard: shard / n) if mean else (lambda shard: shard)
        param_shards, grad_shards = None, [scale(shard) for shard in reduced]
        if params is not None:
            param_layout = layout_of(params, "zero.update params")
            if param_layout.plan != layout.plan:
                raise ValueError("zero.update: params and updates must be trees of the same names, "
                                 "shapes and dtypes")
            if on_xla_cpu():
                # This device's slices of the params only (no whole param bucket), in one branch
                # with the reduced gradients: copied after the backward (not held through it), and
                # every bucket's update after all of the backward (see own_slices). XLA:CPU only:
                # a GPU's conditional reads its predicate back to the host (not measured there).
                # The gradients pass through by an operation: an identity would be forwarded out of
                # the conditional, and the ordering with it (max(x, x) is x, NaN and -0 included).
                through = scale if mean else (lambda shard: jnp.maximum(shard, shard))
                sliced = own_slices(layout.plan, shards, (param_layout.spec_arrays(params),), rank,
                                    riders=tuple(reduced), through=through)
                param_shards, grad_shards = tuple(t[0] for t in sliced), [t[1] for t in sliced]
            else:
                param_shards = local_slices(param_layout, shards, params, rank, cuda)
        with on_shards(axis_name):
            new_shards, inner_state = flat_inner(updates, layout, shards, rank).update(
                tuple(grad_shards), state.inner, param_shards)
        out = {}
        for b, shard in enumerate(new_shards):
            full = _all_gather(shard, axis_name)
            out.update(unpack_bucket(layout.plan, b, full, cuda=cuda))
        return layout.unflatten(out), dataclasses.replace(state, inner=inner_state)

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
