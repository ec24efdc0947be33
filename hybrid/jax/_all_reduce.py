"""Bucketed all-reduce: DDP's gradient buckets as an optax transform, one collective per bucket."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, BucketPlan, ParamPairing
from hybrid.jax._copy import check_backend, pack_bucket, unpack_bucket, use_kernels
from hybrid.jax._specs import _Layout, axis_size, check_caps, check_per_device, check_state_per_device, tracks_varying


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buckets"], meta_fields=["plan_fingerprint"])
@dataclasses.dataclass(frozen=True)
class BucketedAllReduceState:
    """State of :func:`bucketed_all_reduce` with persistent buckets: DDP's bucket buffers.

    ``buckets[b]`` is bucket ``b``'s flat buffer on this device, as last filled: this device's
    gradients of the previous step (``hybrid.core.pack`` of them), zeros after ``init``. Every
    update overwrites the members' ranges before reading them, so the contents never leak into a
    result; the buffers exist so a jitted step that donates its state fills them in place instead
    of allocating. They differ per device: under ``shard_map`` give them ``P(axis)`` out_specs
    (:func:`hybrid.jax.state_specs` does). ``plan_fingerprint`` is static pytree metadata, so an
    update whose tree differs from the one ``init`` saw fails at trace time.
    """

    buckets: tuple
    plan_fingerprint: str


def _reduce(flat, axis_name):
    # The one collective per bucket (a module function so tests can watch the buffers it sends).
    return jax.lax.psum(flat, axis_name)


def bucketed_all_reduce(axis_name, *, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                        first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_CAP_BYTES,
                        mean: bool = True, order: Sequence[str] | None = None,
                        copy_backend: str | None = None,
                        persistent_buckets: bool = True, ready_order: Sequence[str] | None = None,
                        pairing: ParamPairing | None = None, plan: BucketPlan | None = None
                        ) -> optax.GradientTransformation:
    """Sum (or average) per-device gradients over ``axis_name``, one collective per bucket.

    Gradients are packed into the flat buckets of ``hybrid.core.plan_buckets`` (the same buckets
    torch's DDP builds for the same names, shapes and caps), each bucket is reduced with one
    ``lax.psum``, and the result is unpacked into the tree. The updates must be *per-device*
    gradients: see :func:`hybrid.jax.local_grad` for why ``jax.grad`` inside ``shard_map`` does
    not give those.

    Args:
      axis_name: the mesh (``shard_map``) or ``pmap`` axis to reduce over.
      bucket_cap_bytes / first_bucket_cap_bytes: DDP's bucket caps.
      mean: divide by the axis size (DDP's average) instead of summing.
      order: leaf names in registration order (see :func:`hybrid.jax.specs`).
      ready_order: leaf names in the order the backward computes their gradients
        (:func:`hybrid.jax.gradient_ready_order`): buckets are rebuilt from it, as torch's DDP
        rebuilds its own after the first iteration, so the first bucket holds what is ready first.
      pairing: a :class:`hybrid.core.ParamPairing` to a torch module: plan over torch's names and
        layouts (leaves laid out as torch holds them inside the buckets), so that with
        ``ready_order`` the plan, its fingerprint and every packed bucket are torch's DDP's
        (docs/models.md); ``order`` is then the pairing's.
      copy_backend: how buckets are filled and emptied: ``"auto"`` (``hybrid.kernels``' CUDA
        kernels when JAX runs on a GPU and the library is built, ``hybrid.core.pack`` / ``unpack``
        otherwise), ``"cuda"`` or ``"reference"`` to force one; default ``$HYBRID_KERNELS`` or auto.
      persistent_buckets: keep one flat buffer per bucket in the state
        (:class:`BucketedAllReduceState`), as DDP's reducer does, and fill it in place; a step
        that donates its state then allocates no bucket-sized buffer to pack into. Costs one
        gradient-sized buffer per device between steps. The buffers differ per device: under
        ``shard_map`` take the state's specs from :func:`hybrid.jax.state_specs`. ``False``:
        ``optax.EmptyState``, buckets are concatenated afresh every step.
      plan: a :class:`hybrid.core.BucketPlan` to use as it is, over the tree's specs (in ``order``
        or the pairing's names): :func:`hybrid.jax.auto_bucket_plan`'s buckets chosen from a cost
        model, say, or a plan a torch run used. The caps and ``ready_order`` are then unused.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> tx = bucketed_all_reduce("dp")
    >>> g = {"w": jnp.arange(4.0).reshape(4, 1)}
    >>> out, _ = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name="dp")(g)
    >>> np.asarray(out["w"][0]).tolist()
    [1.5]
    """
    check_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    check_backend(copy_backend)

    def layout_of(tree, what):
        return _Layout.of(tree, what=what, order=order, bucket_cap_bytes=bucket_cap_bytes,
                          first_bucket_cap_bytes=first_bucket_cap_bytes, ready_order=ready_order, pairing=pairing,
                          plan=plan)

    def init_fn(params):
        if not persistent_buckets:
            return optax.EmptyState()
        plan = layout_of(params, "bucketed_all_reduce.init").plan
        buckets = tuple(jnp.zeros(b.length, b.dtype) for b in plan.buckets)
        if isinstance(axis_name, str) and _bound(axis_name) and tracks_varying(axis_name):
            # Per-device buffers from the start, so an update can tell them from a P() in_spec.
            buckets = tuple(jax.lax.pcast(x, axis_name, to="varying") for x in buckets)
        return BucketedAllReduceState(buckets, plan.fingerprint())

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name, "bucketed_all_reduce")
        check_per_device(updates, axis_name, "bucketed_all_reduce")
        if persistent_buckets:
            check_state_per_device(state, axis_name, "bucketed_all_reduce")
        layout = layout_of(updates, "bucketed_all_reduce")
        buffers = _buffers(state, layout.plan, persistent_buckets)
        arrays = layout.spec_arrays(updates)
        cuda = use_kernels(copy_backend)
        out, filled = {}, []
        for b in range(layout.plan.num_buckets):
            packed = pack_bucket(layout.plan, b, arrays, cuda=cuda, out=buffers[b])
            filled.append(packed)
            flat = _reduce(packed, axis_name)
            # The mean's divide comes after the sum, on the way out of the bucket: XLA fuses it
            # (and the unpacking slices) into the consumers of each leaf, the kernel into its copy,
            # so it costs no pass over the bucket of its own.
            out.update(unpack_bucket(layout.plan, b, flat, divisor=n if mean else None, cuda=cuda))
        if persistent_buckets:
            state = BucketedAllReduceState(tuple(filled), state.plan_fingerprint)
        return layout.unflatten(out), state

    return optax.GradientTransformation(init_fn, update_fn)


def _bound(axis_name) -> bool:
    # init may run where no axis is bound (a plain tx.init(params)): nothing varies there.
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def _buffers(state, plan, persistent: bool) -> tuple:
    """The state's bucket buffers to fill (``None`` each without persistent buckets), checked against ``plan``."""
    if not persistent:
        return (None,) * plan.num_buckets
    if not isinstance(state, BucketedAllReduceState):
        raise TypeError(f"bucketed_all_reduce.update: state must be the BucketedAllReduceState from "
                        f"its init, got {type(state).__name__}")
    if state.plan_fingerprint != plan.fingerprint():
        raise ValueError(f"bucketed_all_reduce.update: the updates' tree (names, shapes, dtypes) differs "
                         f"from the one bucketed_all_reduce.init saw (plan {plan.fingerprint()} vs "
                         f"{state.plan_fingerprint}); re-run init after changing the model")
    return state.buckets
