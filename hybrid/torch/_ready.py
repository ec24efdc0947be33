"""The order in which torch's own backward makes each parameter's gradient ready, observed on one step.

This is what torch's ``DistributedDataParallel`` records in its first iteration and rebuilds its
buckets from (``rebuild_buckets``), read the same way: a hook after each parameter's gradient is
accumulated, as the C++ reducer's hooks on the grad accumulators fire. It is the truth that
:func:`hybrid.jax.gradient_ready_order` through a :class:`hybrid.core.ParamPairing` infers from
JAX's backward and the mapping's rules; where the torch half is at hand (the parity harness, the
plan inspector), plan from this (:meth:`hybrid.core.ParamPairing.with_torch_ready`).
"""

from __future__ import annotations

import torch


def gradient_ready_order(module: torch.nn.Module, fn, *args, **kwargs) -> list[str]:
    """``module``'s parameter names in the order one backward of ``fn(module, *args, **kwargs)``
    accumulates their gradients.

    The step runs for real (forward and backward, no optimizer step); parameters, their ``.grad``
    and torch's global random state are as they were before it. Parameters the loss does not
    reach are left out, as DDP leaves unused parameters out of its observed order; a parameter
    tied to another (listed once by ``named_parameters()``) is named once, as DDP holds it once.

    Args:
      module: the torch module (not wrapped in DDP: DDP would hook the gradients itself).
      fn: the loss, ``fn(module, *args, **kwargs) -> scalar tensor``.
      *args, **kwargs: one step's inputs (a batch).

    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    >>> gradient_ready_order(net, lambda m, x: m(x).sum(), torch.ones(5, 3))  # a norm: weight, then bias
    ['2.bias', '2.weight', '1.weight', '1.bias', '0.bias', '0.weight']
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in named]
    order: list[str] = []
    handles = []
    try:
        for name, p in named:
            p.grad = None
            handles.append(p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name)))
        with torch.random.fork_rng(devices=[]):  # dropout in the step must not move the caller's stream
            loss = fn(module, *args, **kwargs)
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
                raise TypeError(f"gradient_ready_order: fn must return a scalar tensor, got {type(loss).__name__} "
                                f"{tuple(getattr(loss, 'shape', ()))}")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for (_, p), grad in zip(named, saved):
            p.grad = grad
    return order
