"""Buffer synchronization of hybrid's DDP: torch's default broadcast from one rank, or a buffer
comm hook (``_register_buffer_comm_hook``) run before or after the forward instead.

torch's rules, kept: the buffers are read anew from the module at every sync (a module may
reassign them); a hook replaces the broadcast entirely; futures a hook returns are waited for at
the end of the next synchronizing backward (the DDP hands them to its reducer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel.distributed import _BufferCommHook, _BufferCommHookLocation


class BufferSync:
    """The buffers of ``module`` that one DDP syncs (those not named in ``ignore``), and how.

    Owns ``named`` (name to buffer, as the module holds them at the last sync: torch's
    ``named_module_buffers``), ``buffers`` (their tensors: torch's ``modules_buffers``) and
    ``hook`` (the registered :class:`torch.nn.parallel.distributed._BufferCommHook`, or None).
    Whether a forward syncs at all is the DDP's rule (``will_sync_module_buffers``); this part
    says before or after the module runs, and does it.
    """

    def __init__(self, module: nn.Module, ignore: set[str]):
        self._module, self._ignore = module, ignore
        self.hook: _BufferCommHook | None = None
        self.refresh()

    def refresh(self) -> None:
        """The buffers as the module holds them now, less the ignored ones (torch re-reads them at
        every sync: a module may have replaced a buffer tensor since construction)."""
        self.named = {n: b for n, b in self._module.named_buffers() if n not in self._ignore}
        self.buffers = list(self.named.values())

    def register_hook(self, state, hook, location) -> None:
        """``hook(state, named_buffers)`` instead of the broadcast, at ``location`` (torch's
        ``_BufferCommHookLocation``)."""
        if not callable(hook):
            raise AssertionError(f"hook must be callable, got {type(hook).__name__}")
        self.hook = _BufferCommHook(buffer_comm_hook=hook, buffer_comm_hook_state=state,
                                    buffer_comm_hook_location=location)

    def syncs_before_forward(self) -> bool:
        """Whether a sync runs before the module: the broadcast, or a PRE_FORWARD hook."""
        return self.hook is None or self.hook.buffer_comm_hook_location == _BufferCommHookLocation.PRE_FORWARD

    def syncs_after_forward(self) -> bool:
        """Whether a sync runs after the module: a POST_FORWARD hook."""
        return self.hook is not None and self.hook.buffer_comm_hook_location == _BufferCommHookLocation.POST_FORWARD

    def sync(self, ranks, *, rank_cond: bool, join_enabled: bool) -> list | None:
        """Sync the buffers over ``ranks`` (a :class:`~hybrid.torch.ddp._sync.RankAgreement`): the
        hook's futures, to be waited for when the next backward's reduction finishes, or None."""
        self.refresh()
        # torch's: the sync does not count as an in-place change of the buffers for autograd (an
        # eval-mode BatchNorm saved its running stats for backward, and a hook may change them).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(self.buffers)):
            # Under Join, rank 0 may have joined with stale buffers: the highest active rank broadcasts
            # (a hook takes part in that collective too, and ignores its result, as torch's).
            src = ranks.find_common_rank(rank_cond) if join_enabled else 0
            if self.hook is None:
                if ranks.world > 1:
                    ranks.broadcast([b.detach() for b in self.buffers], src,
                                    f"DistributedDataParallel forward: the broadcast of rank {src}'s buffers")
                return None
            futs = self.hook.buffer_comm_hook(self.hook.buffer_comm_hook_state, self.named)
        if futs is None:
            return None
        if not isinstance(futs, (list, tuple)) or not all(isinstance(f, torch._C.Future) for f in futs):
            raise TypeError("a buffer comm hook must return None or a list of torch.futures.Future, got "
                            f"{type(futs).__name__}")
        return list(futs)
