"""How DistributedDataParallel.forward runs its module: the one seam torch.compile support plugs into.

Eagerly the wrapped module is simply called. ``hybrid.torch.dynamo`` (imported with
``hybrid.torch``) installs its own runner, which under ``torch.compile`` runs the module compiled in
pieces split at the bucket boundaries. The dependency points one way: dynamo/ knows DDP, DDP knows
only this seam.
"""

from __future__ import annotations


def _eager(ddp, inputs, kwargs):
    return ddp.module(*inputs, **kwargs)


_runner = _eager


def run_module(ddp, inputs, kwargs):
    """Run ``ddp.module`` on the inputs through the installed runner."""
    return _runner(ddp, inputs, kwargs)


def install(runner) -> None:
    """Make ``runner(ddp, inputs, kwargs)`` run every DDP's module from now on (once, at import)."""
    global _runner
    _runner = runner
