"""Which inner transforms ``zero`` can run on flat shards: a walk over what a transform is, and a probe.

``zero(inner)`` is exact only if ``inner``'s update of one element depends on that element alone
(its gradient, parameter and state), or couples elements only through collectives over the axis
(``hybrid.jax.clip_by_global_norm``, ``hybrid.jax.apply_if_finite``). Two checks:

- a walk over the transform's closures and optax's wrappers (``inject_hyperparams``'s factory,
  ``MultiSteps``'s inner optimizer, chains and named chains) for known non-elementwise optax
  transforms, which also catches what depends on leaf boundaries or shapes (masks, factoring);
- a probe that runs ``inner`` on a small flat input whole (axis of size 1) and split in two
  shards (axis of size 2), as ``zero`` would, and compares the updates.

Masks and partitions (``optax.masked``, ``partition``) reached through chains are not refused:
``zero`` rewrites them for its slices (``hybrid.jax.sharded._masks``); the probe runs the rewritten form.

What no guard here can catch: a non-elementwise transform *before* ``zero`` in a chain,
``optax.chain(optax.clip_by_global_norm(c), zero(inner, axis))``. ``zero`` sees only the
gradients handed to its update: per device and varying over the axis whether or not a clip
scaled them, and ``optax.chain`` gives it no view of the transforms before it. The docs
(docs/jax.md, "The first mistake") and ``zero``'s docstring show the right chain instead.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from hybrid.jax.sharded._on_shards import on_shards
from hybrid.jax.sharded._masks import MASKING, ProbeBinder, bind, closure_cells, contains_masks, outside_combinators

# optax transforms whose result depends on statistics across elements, leaves or shapes: run on
# per-bucket flat shards they would silently compute something else. Matched on the qualified name
# of their update function (``clip_by_global_norm.<locals>.update_fn``).
NON_ELEMENTWISE = (
    "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip", "scale_by_trust_ratio",
    "scale_by_factored_rms", "scale_by_param_block_norm", "scale_by_param_block_rms",
    "centralize", "masked", "multi_transform", "partition", "normalize_by_update_norm",
    "scale_by_lbfgs", "scale_by_polyak", "scale_by_muon", "scale_by_sm3", "scale_by_novograd",
    "scale_by_zoom_linesearch", "scale_by_backtracking_linesearch", "scale_by_distance_over_gradients",
    "scale_by_lars", "per_example_global_norm_clip",
)

# optax transforms that take one decision for the whole tree: on shards each device decides alone.
GLOBAL_DECISIONS = {
    "apply_if_finite": "hybrid.jax.apply_if_finite(inner, max_consecutive_errors, axis_name), "
                       "which takes the skip decision over all devices",
}


def _injected_inner(cells: dict):
    """The transform ``optax.inject_hyperparams(factory)(...)`` wraps, rebuilt from its init's closure."""
    try:
        schedules = {k: 0.0 for k in cells["sched_hps"]}
        return cells["inner_factory"](**cells["other_hps"], **cells["numeric_hps"], **schedules)
    except Exception:  # a factory that cannot be rebuilt this way: the probe still runs it
        return None


def optax_names(inner, names) -> list[str]:
    """Names out of ``names`` of the optax transforms reachable from ``inner``.

    Follows update and init closures, ``functools.partial``, bound methods (``MultiSteps``'s
    ``gradient_transformation()``) into their object's attributes, and
    ``optax.inject_hyperparams``, whose inner transform is built only inside its update: it is
    rebuilt from the factory and hyperparameters the wrapper holds.
    """
    found, seen = [], set()

    def visit(obj, depth):
        if depth > 16 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, optax.GradientTransformation):
            visit(obj.update, depth + 1)
            visit(obj.init, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            for a in (*obj.args, *obj.keywords.values()):
                visit(a, depth + 1)
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):  # a bound method
            visit(obj.__func__, depth + 1)
            visit(obj.__self__, depth + 1)
        elif callable(obj) and hasattr(obj, "__code__"):
            if (obj.__module__ or "").startswith("optax"):
                outer = obj.__qualname__.split(".<locals>")[0]
                if outer in names and outer not in found:
                    found.append(outer)
            cells = closure_cells(obj)
            if "inner_factory" in cells and "numeric_hps" in cells:
                visit(_injected_inner(cells), depth + 1)
            for x in cells.values():
                visit(x, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, depth + 1)
        elif type(obj).__module__.startswith("optax") and hasattr(obj, "__dict__"):
            for x in vars(obj).values():  # MultiSteps: its inner optimizer `_opt`
                visit(x, depth + 1)

    visit(inner, 0)
    return found


def non_elementwise(inner) -> list[str]:
    """Names of known non-elementwise optax transforms reachable from ``inner``.

    Masks and partitions (``masked``, ``partition`` / ``multi_transform``, ``adamw(mask=...)``)
    that ``zero`` rewrites for its flat slices (reached through chains, named chains and other
    masks: ``hybrid.jax.sharded._masks``) are left out; behind any other wrapper they are named.
    """
    found = optax_names(inner, NON_ELEMENTWISE)
    hidden = {n for t in outside_combinators(inner) for n in optax_names(t, MASKING)}
    return [n for n in found if n not in MASKING or n in hidden]


# The probe: two leaves (zero hands its inner one flat slice per bucket) of 8 elements, the
# second leaf's parameters and gradients larger, so per-leaf and per-shard statistics differ from
# whole ones; two steps, the second with one NaN in the second shard of the second leaf.
_PROBE_STEPS, _PROBE_HALF = 2, 4
# Elementwise transforms give the same updates up to rounding (bitwise for optax's elementwise
# transforms; clip_by_global_norm's psum of two partial norms differs in the last bits, which
# adamw's weight decay can amplify by cancellation to ~1e-5 of an element). Non-elementwise ones
# measured differ by 0.2 to 1 of the update's largest element (lamb, adafactor, apply_if_finite).
_PROBE_RTOL = 1e-3


def _probe_inputs():
    r = np.random.default_rng(0)
    n = 2 * _PROBE_HALF
    params = tuple(r.normal(size=n).astype(np.float32) * s for s in (np.float32(1), np.float32(3)))
    grads = [tuple(r.normal(size=n).astype(np.float32) * s for s in (np.float32(0.1), np.float32(2)))
             for _ in range(_PROBE_STEPS)]
    grads[-1][1][-1] = np.nan
    return params, grads


def probe_difference(inner, axis_name) -> float:
    """Largest difference between ``inner``'s updates of a flat input whole and on two shards.

    Relative to the largest update of the leaf and step; ``inf`` where NaNs land elsewhere. The
    whole input runs under an axis ``axis_name`` of size 1, the shards under one of size 2, so
    collectives over the axis (``hybrid.jax.clip_by_global_norm``) combine the shards as inside
    ``zero``. Runs eagerly (also when called inside a trace), on a few dozen numbers.
    """
    params, grads = _probe_inputs()

    def run(params, grads):
        # Masks and partitions run as zero runs them: rewritten for flat slices, here with
        # elements masked in and out in turn (each wrapped transform sees both).
        tx = bind(inner, ProbeBinder(axis_name, len(params), 2 * _PROBE_HALF)) if contains_masks(inner) else inner
        state, out = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            out.append(u)
        return out

    def halves(tree):
        return jax.tree_util.tree_map(lambda x: x.reshape(2, _PROBE_HALF), tree)

    with jax.ensure_compile_time_eval(), on_shards(axis_name):
        whole = jax.vmap(run, in_axes=None, axis_size=1, axis_name=axis_name)(params, grads)
        split = jax.vmap(run, axis_size=2, axis_name=axis_name)(halves(params), halves(grads))
    return max((relative_difference(a, b) for a, b in zip(jax.tree_util.tree_leaves(whole),
                                                          jax.tree_util.tree_leaves(split), strict=True)), default=0.0)


def relative_difference(a, b) -> float:
    """Largest difference of two arrays relative to their largest element; ``inf`` where their
    shapes or NaNs differ.

    >>> relative_difference(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
    0.2
    """
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("inf")
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    scale = max(np.abs(a).max(initial=0), np.abs(b).max(initial=0))
    return float(np.abs(a - b).max() / scale) if scale > 0 else 0.0


def check_exact_on_shards(inner, axis_name) -> None:
    """Raise a ValueError if ``zero(inner, axis_name)`` would not equal ``inner`` unsharded.

    For what the name walk of ``zero`` cannot see: optax's global skip decisions, and transforms
    (optax's or anyone's) whose update of an element depends on others, found by the probe.

    >>> import jax.numpy as jnp, optax
    >>> check_exact_on_shards(optax.adam(1e-3), "dp")
    >>> def normalize():  # a non-elementwise transform written outside optax
    ...     return optax.stateless(lambda u, p: jax.tree_util.tree_map(lambda x: x / jnp.linalg.norm(x), u))
    >>> check_exact_on_shards(normalize(), "dp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: zero: the inner transform updates an element depending on other elements: ...
    """
    global_ = optax_names(inner, tuple(GLOBAL_DECISIONS))
    if global_:
        fixes = "; ".join(f"instead of optax.{n} use {GLOBAL_DECISIONS[n]}" for n in global_)
        raise ValueError(f"zero: the inner transform uses optax.{global_[0]}, which decides for the "
                         f"whole tree, but on shards every device would decide for its shard alone "
                         f"(one NaN on one device would skip the step there and update the other "
                         f"shards); {fixes}")
    try:
        diff = probe_difference(inner, axis_name)
    except Exception as e:
        raise ValueError(f"zero: could not run the inner transform on a small flat input to check "
                         f"that it is elementwise ({type(e).__name__}: {e}); zero runs it on a tuple "
                         f"of 1-D shards with params, under axis {axis_name!r}. Pass "
                         f"check_elementwise=False to skip the check") from e
    if diff > _PROBE_RTOL:
        raise ValueError(
            f"zero: the inner transform updates an element depending on other elements: on two "
            f"shards its update differs from the unsharded one by {diff:.3g} of its largest element; "
            f"zero is exact only for elementwise transforms (sgd, momentum, adam, adamw, lion, "
            f"rmsprop, ...). Shard an elementwise optimizer instead, use "
            f"hybrid.jax.clip_by_global_norm for clipping and hybrid.jax.apply_if_finite for skipping "
            f"non-finite steps, keep this transform unsharded (after hybrid.jax.bucketed_all_reduce), "
            f"or pass check_elementwise=False if you accept a different result")
