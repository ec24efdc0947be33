"""Bucket boundaries for :func:`hybrid.jax.bucketed_all_reduce` and :func:`hybrid.jax.zero` chosen
from a cost model, as torch's ``bucket_cap_mb="auto"`` chooses them (``hybrid.core.auto_plan``).

JAX computes every gradient inside one XLA program: nothing times them one by one as torch's
gradient hooks do. The order is the backward's (:func:`hybrid.jax.gradient_ready_order`, read from
the jaxpr); the times are a model: the backward's duration shared out in proportion to each
gradient's elements (a dense layer's backward FLOPs are proportional to its parameters), or times
the caller measured (a profile).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid.core import (DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, BucketPlan, CopyCost, ParamPairing,
                         auto_plan, ready_times_by_elements)
from hybrid.jax._specs import _Layout


def auto_bucket_plan(params, cost, *, backward_s: float | None = None, ready_order: Sequence[str] | None = None,
                     ready_s: Sequence[float] | None = None, order: Sequence[str] | None = None,
                     pairing: ParamPairing | None = None, copy: CopyCost = CopyCost(), kind: str = "all_reduce",
                     after_step: Sequence[tuple[str, int]] = ()) -> BucketPlan:
    """The bucket plan :func:`hybrid.core.auto_plan` chooses for ``params``' gradients: pass it as
    ``plan=`` to :func:`hybrid.jax.bucketed_all_reduce` or :func:`hybrid.jax.zero`.

    Args:
      params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
      cost: a :class:`hybrid.core.CostModel` of the axis (:func:`hybrid.jax.measure_collectives`).
      backward_s: the backward's duration: the gradients' ready times are this shared out in
        proportion to their elements, in ready order. Or give ``ready_s`` instead.
      ready_order: leaf names in the order the backward computes them
        (:func:`hybrid.jax.gradient_ready_order`); default: the reverse of ``order``.
      ready_s: seconds from the backward's start to each gradient of ``ready_order`` (measured).
      order, pairing: as for :func:`hybrid.jax.bucketed_all_reduce` (the plan is over their specs).
      copy: what packing a gradient into a bucket and out costs (:class:`hybrid.core.CopyCost`);
        a one-leaf bucket is packed by a reshape, so the plan marks it in place.
      kind, after_step: the collective per bucket and those after the step: ``"all_reduce"`` for
        ``bucketed_all_reduce``; ``"reduce_scatter"``, ``[("all_gather", 1)]`` for ``zero``.

    >>> import jax.numpy as jnp
    >>> from hybrid.core import CostModel
    >>> model = CostModel.fit([("all_reduce", n, 1e-4 + n * 1e-9) for n in (1 << 10, 1 << 24)], world_size=2)
    >>> params = {"a": jnp.zeros((512, 512)), "b": jnp.zeros(512), "c": jnp.zeros((512, 512))}
    >>> plan = auto_bucket_plan(params, model, backward_s=0.2, ready_order=["c", "b", "a"])
    >>> [[plan.specs[m].name for m in b.members] for b in plan.buckets]  # a long backward hides them one by one
    [['c'], ['b'], ['a']]
    >>> plan = auto_bucket_plan(params, model, backward_s=0.002, ready_order=["c", "b", "a"])
    >>> [[plan.specs[m].name for m in b.members] for b in plan.buckets]  # a short one: the last two together
    [['c'], ['b', 'a']]
    """
    if (backward_s is None) == (ready_s is None):
        raise ValueError("auto_bucket_plan needs backward_s (ready times modelled from it) or ready_s (measured), "
                         "exactly one of them")
    layout = _Layout.of(params, what="auto_bucket_plan", order=order, bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES,
                        first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_CAP_BYTES, pairing=pairing)
    specs = layout.plan.specs
    index = {s.name: i for i, s in enumerate(specs)}
    if ready_order is None:
        if ready_s is not None:
            raise ValueError("auto_bucket_plan: ready_s needs the ready_order its times belong to")
        indices = list(reversed(range(len(specs))))
    else:
        names = list(ready_order)
        if pairing is not None:
            names = pairing.torch_ready_order(names)
        unknown = [n for n in names if n not in index]
        if unknown:
            raise ValueError(f"auto_bucket_plan: ready_order names {unknown}, which are no leaves of the tree")
        indices = [index[n] for n in names]
        seen = set(indices)
        missing = [i for i in reversed(range(len(specs))) if i not in seen]  # unused by the loss: last
        if ready_s is not None and missing:
            raise ValueError(f"auto_bucket_plan: ready_s times {len(indices)} gradients, the tree has {len(specs)}")
        indices += missing
    times = list(ready_s) if ready_s is not None else ready_times_by_elements(specs, indices, backward_s)
    return auto_plan(specs, indices, times, cost, copy=copy, kind=kind, after_step=after_step, in_place=True)
