"""torch's ``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``: parameters left out
of the buckets whose gradients are all-reduced, averaged, in one flat buffer when the gradient
of ``param_to_hook_all_reduce`` is computed.

As torch: the delayed parameters join ``parameters_to_ignore`` (so neither the bucket plan nor
the construction-time broadcast of the module sees them), are broadcast from rank 0 on their own
at construction, and get their ``.grad`` pointed at views of the flat buffer after every forward
so that autograd accumulates into it.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.autograd import Variable

from hybrid.torch.ddp._sync import BROADCAST_BUCKET_BYTES


class DelayedAllReduce:
    """The delayed parameters of one DDP, their flat gradient buffer and its all-reduce.

    Owns ``names`` and ``params`` (the delayed parameters, in the order given), the flat buffer
    and each parameter's view into it, and the process group the hook reduces over. The DDP
    calls :meth:`start` once at construction, :meth:`after_forward` after every forward, and
    :meth:`attach` when unpickled (the group and the hook do not travel with a copy).
    """

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], hook_param: torch.Tensor):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self._hook_param = hook_param
        self._group = None
        self._buffer: torch.Tensor | None = None  # made by start()
        self._views: list[torch.Tensor] = []

    def start(self, group, device_ids) -> None:
        """Flat gradient buffer and views, broadcast from rank 0, the hook (torch's order)."""
        self._group = group
        # torch's buffer: the default dtype, on the CPU unless device_ids names a device.
        device = torch.device("cpu") if device_ids is None else device_ids[0]
        self._buffer = torch.zeros(sum(p.numel() for p in self.params), device=device)
        # torch broadcasts these even with init_sync=False.
        dist._broadcast_coalesced(group, [p.detach() for p in self.params], BROADCAST_BUCKET_BYTES, 0)
        self._register_hook()
        offset = 0
        for p in self.params:
            self._views.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()

    def attach(self, group) -> None:
        """After unpickling: reduce over ``group``, hooked again on the copy's parameter."""
        self._group = group
        if self._buffer is not None:
            self._register_hook()  # tensor hooks do not travel with a copied parameter

    def __getstate__(self):
        return {**self.__dict__, "_group": None}  # a process group does not pickle

    def _register_hook(self) -> None:
        # After param_to_hook_all_reduce's gradient is accumulated. torch's is a tensor hook, which
        # runs before: when that parameter is itself delayed, its gradient lands in the buffer
        # while the all-reduce of the buffer is in flight (a race); here it is reduced with the rest.
        # Through a weak reference, as the reducer's hooks: a parameter holding this (and so its
        # process group) would keep it alive past the DDP's last reference.
        ref = weakref.ref(self)

        def hook(param):
            del param
            delayed = ref()
            if delayed is not None:
                delayed._all_reduce()
        self._hook_param.register_post_accumulate_grad_hook(hook)

    def _all_reduce(self) -> None:
        buf = self._buffer
        buf.div_(dist.get_world_size(self._group))
        work = dist.all_reduce(buf, group=self._group, async_op=True)
        # torch never waits for this all-reduce, so an optimizer step may read the delayed
        # gradients before it lands; ours waits for it when the backward ends.
        Variable._execution_engine.queue_callback(work.wait)

    def after_forward(self) -> None:
        """After each forward: a delayed parameter without a gradient gets its buffer view (zero)."""
        if self._buffer is None:
            return
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self._views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self._buffer.zero_()
