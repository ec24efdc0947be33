"""torch's ``_DDPSink`` for ``find_unused_parameters=True``: every output tensor of the forward
passes through one autograd node, so an output the loss leaves out still reaches the backward,
with an undefined (``None``) gradient instead of none at all.

Why it matters: the parameters behind such an output are reachable from the outputs, so DDP
expects their gradients. Through the sink, their gradient hooks fire with ``.grad`` still
``None``; the reducer then counts them as locally unused (zeros in the bucket, ``.grad`` left
alone unless another rank used them). Without it their hooks never fire, the reduction never
finishes, and the next forward raises where torch's class trains on.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _Sink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, clone, *tensors):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        # Clones unless ddp._set_ddp_sink_clone(False), as torch's sink: a loss modified in place
        # would otherwise trip autograd's check on the Function's outputs.
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def through_sink(output, clone: bool = True):
    """``output`` rebuilt with every tensor that has a ``grad_fn`` passed through one sink node
    (torch's ``_post_forward``); tensors without one and non-tensors are returned as they are.

    >>> x = torch.ones(2, requires_grad=True)
    >>> out = through_sink({"loss": x * 2, "aux": (x + 1, "text")})
    >>> type(out["loss"].grad_fn).__name__, out["aux"][1]
    ('_SinkBackward', 'text')
    """
    leaves, spec = tree_flatten(output)
    routed = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not routed:
        return output
    passed = _Sink.apply(clone, *(leaves[i] for i in routed))
    for i, t in zip(routed, passed):
        leaves[i] = t
    return tree_unflatten(leaves, spec)
