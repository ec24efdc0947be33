"""Buffer synchronization of hybrid's DDP: torch's default broadcast from one rank, or a buffer
comm hook (``_register_buffer_comm_hook``) run before or after the forward instead.

torch's rules, kept: the buffers are read anew from the module at every sync (a module may
reassign them); a hook replaces the broadcast entirely; futures a hook returns are waited for at
the end of the next synchronizing backward.
"""

from __future__ import annotations

import torch
from torch.nn.parallel.distributed import _BufferCommHook, _BufferCommHookLocation

from hybrid.torch.ddp._sync import BROADCAST_BUCKET_BYTES


class BufferSync:
    """Mixed into :class:`hybrid.torch.DistributedDataParallel` ahead of ``Reducer``, whose
    ``_finalize`` it extends."""

    # Futures returned by a buffer hook, waited for when the backward's reduction finishes
    # (torch's Reducer::install_futures); a list once a hook returned some.
    _installed_futures: tuple | list = ()

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=_BufferCommHookLocation.POST_FORWARD):
        """Run ``hook(state, named_buffers)`` on the module's buffers (a dict of name to tensor)
        instead of broadcasting them from rank 0, before or after the forward
        (``torch.nn.parallel.distributed._BufferCommHookLocation``). The hook may return a list of
        futures: they are waited for at the end of the backward."""
        if not callable(hook):
            raise AssertionError(f"hook must be callable, got {type(hook).__name__}")
        self.buffer_hook = _BufferCommHook(buffer_comm_hook=hook, buffer_comm_hook_state=state,
                                           buffer_comm_hook_location=comm_hook_location)

    def _buffer_hook_at(self, location) -> bool:
        hook = self.__dict__.get("buffer_hook")
        return hook is not None and hook.buffer_comm_hook_location == location

    def _check_sync_bufs_pre_fwd(self) -> bool:
        """Whether this forward syncs the buffers before running the module (torch's rule)."""
        return self.will_sync_module_buffers() and (
            self.__dict__.get("buffer_hook") is None or self._buffer_hook_at(_BufferCommHookLocation.PRE_FORWARD))

    def _check_sync_bufs_post_fwd(self) -> bool:
        """Whether this forward runs a POST_FORWARD buffer hook after the module (torch's rule)."""
        return self.will_sync_module_buffers() and self._buffer_hook_at(_BufferCommHookLocation.POST_FORWARD)

    def _assign_modules_buffers(self) -> None:
        """The buffers as the module holds them now, less the ignored ones (torch re-reads them at
        every sync: a module may have replaced a buffer tensor since construction)."""
        named = {n: b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore}
        self.named_module_buffers = named
        self._buffers_to_sync = list(named.values())

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """torch's name for the buffers DDP syncs."""
        return self._buffers_to_sync

    def _sync_buffers(self, rank_cond: bool = True):
        self._assign_modules_buffers()
        hook = self.__dict__.get("buffer_hook")
        # torch's: the sync does not count as an in-place change of the buffers for autograd (an
        # eval-mode BatchNorm saved its running stats for backward, and a hook may change them).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(self._buffers_to_sync)):
            # Under Join, rank 0 may have joined with stale buffers: the highest active rank broadcasts
            # (a hook takes part in that collective too, and ignores its result, as torch's).
            src = self._ranks.find_common_rank(rank_cond) if self._join_config.enable else 0
            if hook is None:
                if self._ranks.world > 1:
                    self._ranks.broadcast([b.detach() for b in self._buffers_to_sync], src,
                                          f"DistributedDataParallel forward: the broadcast of rank {src}'s buffers")
                return
            futs = hook.buffer_comm_hook(hook.buffer_comm_hook_state, self.named_module_buffers)
        if futs is not None:
            self._install_post_backward_futures(futs)

    def _install_post_backward_futures(self, futs) -> None:
        if not isinstance(futs, (list, tuple)) or not all(isinstance(f, torch._C.Future) for f in futs):
            raise TypeError("a buffer comm hook must return None or a list of torch.futures.Future, got "
                            f"{type(futs).__name__}")
        self._installed_futures = [*self._installed_futures, *futs]

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank=0):
        """torch's default buffer sync, for buffer hooks that call it: ``bufs`` (default: the
        module's buffers) broadcast from ``authoritative_rank``."""
        bufs = self._buffers_to_sync if bufs is None else bufs
        torch.distributed._broadcast_coalesced(self.process_group, bufs, bucket_size or BROADCAST_BUCKET_BYTES,
                                               authoritative_rank)

    def _finalize(self) -> None:
        super()._finalize()
        if self._installed_futures and not self._expect_hooks:  # the reduction has finished
            futs, self._installed_futures = self._installed_futures, []
            torch.futures.wait_all(futs)
