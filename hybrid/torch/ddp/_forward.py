"""How DistributedDataParallel.forward runs its module: the one seam torch.compile support plugs into.

Eagerly the wrapped module is simply called. ``hybrid.torch.dynamo`` (imported with
``hybrid.torch``) installs its own runner, which under ``torch.compile`` runs the module compiled in
pieces split at the bucket boundaries. The dependency points one way: dynamo/ knows DDP, DDP knows
only this seam.
"""

from __future__ import annotations


def _eager(ddp, inputs, kwargs):
    return ddp.module(*inputs, **kwargs)


# DDP.forward calls ``_forward.run_module(...)`` itself: a wrapper function here would be one more
# Python frame for torch.compile to convert in every first step.
run_module = _eager


def install(runner) -> None:
    """Make ``runner(ddp, inputs, kwargs)`` run every DDP's module from now on (once, at import)."""
    global run_module
    run_module = runner
