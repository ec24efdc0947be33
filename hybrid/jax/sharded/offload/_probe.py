"""Whether an inner transform can be stepped one bucket at a time, as :class:`OffloadedZero3` steps
it: run on two buckets together and stepped apart (global decisions measured over every bucket
first, ``hybrid.jax._decisions``), its updates must agree; one that does not is refused, saying why.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import optax

from hybrid.jax._decisions import applying, measuring
from hybrid.jax._elementwise import _probe_inputs, relative_difference
from hybrid.jax.sharded._masks import ProbeBinder, bind, contains_masks
from hybrid.jax.sharded._on_shards import on_shards

_PROBE_RTOL = 1e-6  # apart and together, an elementwise transform computes the same numbers


def count_decisions(inner, axis_name) -> int:
    """How many global decisions (``hybrid.jax.clip_by_global_norm``, ``hybrid.jax.apply_if_finite``)
    one update of ``inner`` takes: each needs every bucket's sum before any bucket steps."""
    params, grads = _probe_inputs()

    def run(params, grads):
        tx = bind(inner, ProbeBinder(axis_name, len(params), params[0].shape[0])) if contains_masks(inner) else inner
        with measuring() as recorded:
            tx.update(grads[0], tx.init(params), params)
        return len(recorded)

    counted = []
    with on_shards(axis_name):
        jax.eval_shape(jax.vmap(lambda p, g: counted.append(run(p, g)) or 0, in_axes=None, axis_size=1,
                                axis_name=axis_name), params, grads)
    return counted[0]


def _step_apart(inner, axis_name, params, grads, decisions: int) -> list:
    """``inner`` on each bucket (``params[i]``) as OffloadedZero3 steps it, one update per entry of
    ``grads``: with global decisions, every bucket measured first (on a fresh state: the decisions
    must see the gradients, not the state), then each stepped with the totals."""
    def tx_of(i):
        return bind(inner, ProbeBinder(axis_name, 1, params[i].shape[0])) if contains_masks(inner) else inner

    txs = [tx_of(i) for i in range(len(params))]
    states = [tx.init((p,)) for tx, p in zip(txs, params)]
    out = []
    for g in grads:
        totals = None
        if decisions:
            sums = []
            for i, tx in enumerate(txs):
                with measuring() as recorded:
                    tx.update((g[i],), tx.init((params[i],)), (params[i],))
                sums.append([v for _, v in recorded])
            totals = [sum(column) for column in zip(*sums)]
        step = []
        for i, tx in enumerate(txs):
            with applying(totals) if totals is not None else contextlib.nullcontext():
                (u,), states[i] = tx.update((g[i],), states[i], (params[i],))
            step.append(u)
        out.append(step)
    return out


def _per_bucket_difference(inner, axis_name, decisions: int) -> float:
    """Largest difference between ``inner`` run on two buckets together and stepped apart as
    OffloadedZero3 steps them, relative to the largest update (``inf`` where NaNs land differently).
    Twice: on the probe's inputs (a NaN in the last step: a skip decided apart shows) and on three
    steps of finite gradients (a NaN makes every later norm NaN, and a clip that depends on the
    state shows from the second step)."""
    params, grads = _probe_inputs()
    finite = [tuple(np.nan_to_num(x, nan=0.5) for x in g) for g in grads]
    return max(_difference_on(inner, axis_name, decisions, params, grads),
               _difference_on(inner, axis_name, decisions, params, [*finite, finite[0]]))


def _difference_on(inner, axis_name, decisions: int, params, grads) -> float:

    def run(params, grads):
        tx = bind(inner, ProbeBinder(axis_name, len(params), params[0].shape[0])) if contains_masks(inner) else inner
        state, out = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            out.append(u)
        return out

    def one(fn, *args):
        return jax.vmap(fn, in_axes=None, axis_size=1, axis_name=axis_name)(*args)

    with jax.ensure_compile_time_eval(), on_shards(axis_name):
        together = one(run, params, grads)
        apart = one(lambda p, g: _step_apart(inner, axis_name, p, g, decisions), params, grads)
    return max((relative_difference(a, apart[step][i]) for step, whole in enumerate(together)
                for i, a in enumerate(whole)), default=0.0)


def check_per_bucket(inner: optax.GradientTransformation, axis_name) -> None:
    """Raise a ValueError if stepping ``inner`` one bucket at a time differs from one update of all.

    Global-norm clipping and skipping non-finite steps (``hybrid.jax.clip_by_global_norm``,
    ``hybrid.jax.apply_if_finite``) are split as DeepSpeed's offload splits its clip: the sums of
    every bucket first, then each bucket stepped with the total. That is exact where they see the
    gradients (first in the chain); after a transform that keeps state they would need every
    bucket's new state before any bucket steps, and are refused.

    >>> import optax
    >>> from hybrid.jax import apply_if_finite, clip_by_global_norm
    >>> check_per_bucket(optax.adamw(1e-3), "dp")
    >>> check_per_bucket(apply_if_finite(optax.chain(clip_by_global_norm(1.0, "dp"), optax.adam(1e-3)), 3, "dp"), "dp")
    >>> check_per_bucket(optax.chain(optax.scale_by_adam(), clip_by_global_norm(1.0, "dp")), "dp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: OffloadedZero3: a global decision in the inner transform sees what a stateful transform before it made: ...
    """
    decisions = count_decisions(inner, axis_name)
    diff = _per_bucket_difference(inner, axis_name, decisions)
    if diff <= _PROBE_RTOL:
        return
    if decisions:
        raise ValueError(
            f"OffloadedZero3: a global decision in the inner transform sees what a stateful transform before it made: "
            f"stepped one bucket at a time its update differs by {diff:.3g} of its largest element. A global-norm "
            f"clip or a skip on non-finite updates is split over the buckets by summing every bucket's part "
            f"first, from the gradients alone, and only then stepping each bucket; placed after a transform that "
            f"keeps state (a clip after adam's scaling) its sum would need every bucket's new state before any "
            f"bucket steps. Put it first in the chain, on the gradients, as DeepSpeed's offload clips "
            f"(optax.chain(optax.clip_by_global_norm(c), optax.adamw(...))), or step such a transform with "
            f"hybrid.jax.zero(inner, axis, stage=3), which keeps its state on the devices")
    raise ValueError(
        f"OffloadedZero3: the inner transform decides over all buckets at once in a way that cannot be split: "
        f"stepped one bucket at a time its update differs by {diff:.3g} of its largest element, and it takes no "
        f"decision hybrid knows how to sum over buckets first (hybrid.jax.clip_by_global_norm and "
        f"hybrid.jax.apply_if_finite are). Step it with hybrid.jax.zero(inner, axis, stage=3), which keeps "
        f"its state on the devices, or pass check_elementwise=False if you accept the difference")
