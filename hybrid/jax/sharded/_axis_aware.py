"""Global-norm transforms inside ``zero``, rewritten to their axis-aware form.

``optax.clip_by_global_norm`` takes the norm of the updates it is handed; inside ``zero`` those
are this device's flat slices, so it would clip each device by its own slice's norm. Its
axis-aware twin, :func:`hybrid.jax.clip_by_global_norm`, sums the slices' squared norms over the
axis and clips by optax's own rule (``select(norm < max_norm, t, t / norm * max_norm)``). So
``zero(optax.chain(optax.clip_by_global_norm(c), adamw), axis)``, the chain a flax user already
has wrapped whole, is rewritten to the twin and gives the unsharded result. Only what is reached
through ``chain`` and ``named_chain`` is rewritten; behind other wrappers (``inject_hyperparams``,
``MultiSteps``, masks) it stays refused, naming the fix. The state is the same (``EmptyState``).
"""

from __future__ import annotations

import optax

from hybrid.jax.sharded._masks import _children, _optax_kind, _parts, _unwrap, closure_cells, rebuilt_finite


def axis_aware(inner: optax.GradientTransformation, axis_name) -> optax.GradientTransformation:
    """``inner`` with each ``optax.clip_by_global_norm`` reached through chains and named chains
    replaced by ``hybrid.jax.clip_by_global_norm(max_norm, axis_name)``; ``inner`` itself where
    there is none.

    >>> from hybrid.jax._elementwise import non_elementwise
    >>> chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    >>> non_elementwise(chain), non_elementwise(axis_aware(chain, "dp"))  # what zero would refuse
    (['clip_by_global_norm'], [])
    """
    # Imported here: hybrid.jax._clip imports this package (its _on_shards), whose __init__ imports zero.
    from hybrid.jax._clip import clip_by_global_norm

    tx = _unwrap(inner)
    if _optax_kind(getattr(tx, "update", None)) == "clip_by_global_norm":
        return clip_by_global_norm(closure_cells(tx.update)["max_norm"], axis_name)
    kind, cells = _parts(inner)
    if kind == "chain":
        children = _children(kind, cells)
        rewritten = [axis_aware(t, axis_name) for t in children]
        changed = any(a is not b for a, b in zip(rewritten, children))
        return optax.chain(*rewritten) if changed else inner
    if kind == "named_chain":
        named = [(name, axis_aware(t, axis_name)) for name, t in cells["transforms"]]
        changed = any(a is not b for (_, a), (_, b) in zip(named, cells["transforms"]))
        return optax.named_chain(*named) if changed else inner
    if kind == "apply_if_finite":  # hybrid.jax.apply_if_finite around the chain users write
        rewritten = axis_aware(cells["inner"], axis_name)
        return rebuilt_finite(cells, rewritten) if rewritten is not cells["inner"] else inner
    return inner
