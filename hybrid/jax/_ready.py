"""The order in which a JAX backward pass computes each parameter's gradient, read from its jaxpr.

This is the JAX side of what torch's DDP observes in its first iteration and rebuilds its buckets
from (``rebuild_buckets``): the order gradients become ready. Planning buckets in that order puts
the gradients the backward finishes first in the first bucket, and, with a
:class:`hybrid.core.ParamPairing`, gives the plan torch's DDP holds after its rebuild
(:meth:`~hybrid.core.ParamPairing.torch_ready_order` settles the order inside a module).
"""

from __future__ import annotations

import jax

from hybrid.jax._specs import _leaves


def _position(var, jaxpr) -> tuple | None:
    """Where ``var`` (an output of ``jaxpr``) is computed: the index of the equation, and inside a
    call (``jit``, ``remat``, a custom VJP) the position within the called jaxpr; None for an
    input passed through or a constant (a gradient nothing computes: a parameter the loss does
    not use)."""
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v is var for v in eqn.outvars):
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own jaxpr
            if inner is not None and hasattr(inner, "eqns") and len(inner.outvars) == len(eqn.outvars):
                k = next(k for k, v in enumerate(eqn.outvars) if v is var)
                below = _position(inner.outvars[k], inner)
                return (i,) + (below if below is not None else ())
            return (i,)
    return None


def gradient_ready_order(fun, params, *args, **kwargs) -> list[str]:
    """Leaf names of ``params`` in the order ``jax.grad(fun)`` computes their gradients.

    Traces ``jax.grad(fun)(params, *args, **kwargs)`` (nothing runs) and ranks each gradient by
    the equation that completes it, looking inside ``jit`` and ``remat`` calls. Leaves whose
    gradient nothing computes (unused by ``fun``) are left out, as torch's DDP leaves unused
    parameters out of its observed order. Names are :func:`hybrid.jax.specs`'s.

    Args:
      fun: the loss, ``fun(params, *args, **kwargs) -> scalar``.
      params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``s).
      *args, **kwargs: example inputs of the right shapes (a batch).

    >>> import jax.numpy as jnp
    >>> def loss(p, x):
    ...     h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    ...     return jnp.sum(h @ p["l2"]["w"] + p["l2"]["b"])
    >>> p = {"l1": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}, "l2": {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}}
    >>> gradient_ready_order(loss, p, jnp.ones((5, 3)))  # last layer first, a bias before its weight
    ['l2.b', 'l2.w', 'l1.b', 'l1.w']
    """
    closed = jax.make_jaxpr(jax.grad(fun))(params, *args, **kwargs)
    names, _, _ = _leaves(params)
    positions = [_position(v, closed.jaxpr) for v in closed.jaxpr.outvars]
    ranked = sorted((pos, i) for i, pos in enumerate(positions) if pos is not None)
    return [names[i] for _, i in ranked]
