"""What a loaded run carries into its saves until it has something newer: the rebuilt DDP bucket
plan its checkpoint recorded (``run_state["ddp_buckets"]``, what ``load(..., restore_buckets=True)``
restores and ``torch_ready_order`` reads).

A fresh DDP reduces its first step in one bucket per dtype and rebuilds at its second, so a save
before that has no rebuilt plan of its own: without the carried record a load followed by a save
would drop it, and the files would differ from the ones loaded (docs/moving-runs.md: within one
framework a load followed by a save gives back the same bytes), and a later
``restore_buckets=True`` from them would find nothing to restore. The record goes with the module
object the load was given (held weakly: it goes when the module does), word for word, until that
DDP takes a plan of its own (its rebuild) or another load replaces it.
"""

from __future__ import annotations

import weakref

from torch import nn

from hybrid.checkpoint._manifest import DDP_PLAN_KEY
from hybrid.core import BucketPlan

# module -> (the checkpoint's record, the plan the module's DDP reduced in right after the load)
_CARRIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def carry_ddp_buckets(ckpt, module: nn.Module, specs, *, restored: bool) -> None:
    """After a load of ``ckpt`` into ``module`` (whose parameters have ``specs``): carry the
    checkpoint's DDP record into ``module``'s saves, or forget an older one if it has none.

    A hybrid DDP that had rebuilt before the load (and was not given the saved plan by
    ``restored``) keeps recording its own plan: that is the one it reduces in. A record over other
    tensors (another model's) is not carried.
    """
    from hybrid.torch import DistributedDataParallel
    _CARRIED.pop(module, None)
    record = ckpt.manifest.run_state.get(DDP_PLAN_KEY)
    is_ddp = isinstance(module, DistributedDataParallel)
    if record is None or (is_ddp and module._has_rebuilt and not restored):
        return
    described = lambda specs: [(s.name, tuple(s.shape), s.dtype) for s in specs]  # noqa: E731
    if described(BucketPlan.from_json(record["plan"]).specs) != described(specs):
        return
    _CARRIED[module] = (record, module.bucket_plan if is_ddp else None)


def carried_ddp_buckets(module: nn.Module) -> dict | None:
    """The record a load gave ``module`` to carry, while it has nothing newer: a hybrid DDP until
    it reduces in another plan than the one it had right after the load (its rebuild); any other
    module (a plain one, torch's DDP) until the next load."""
    from hybrid.torch import DistributedDataParallel
    record, plan = _CARRIED.get(module, (None, None))
    if record is not None and isinstance(module, DistributedDataParallel) and module.bucket_plan is not plan:
        return None
    return record
