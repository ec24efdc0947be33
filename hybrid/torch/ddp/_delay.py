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
    """Mixed into :class:`hybrid.torch.DistributedDataParallel`."""

    _delay_grad_buffer: torch.Tensor | None = None
    _delay_all_reduce_all_params = False

    def _init_delayed(self, delay_all_reduce_named_params, param_to_hook_all_reduce) -> None:
        """The delayed parameters, before the reduced ones are chosen (``parameters_to_ignore``)."""
        self._delay_all_reduce_params = []
        self._delay_grad_views = []
        # object.__setattr__: nn.Module would register a Parameter attribute as the DDP's own.
        object.__setattr__(self, "_param_to_hook_all_reduce", param_to_hook_all_reduce)
        for name, param in delay_all_reduce_named_params or ():
            self.parameters_to_ignore.add(name)
            self._delay_all_reduce_params.append(param)

    def _register_delay_all_reduce_hook(self, device_ids, all_delayed: bool) -> None:
        """Flat gradient buffer and views, broadcast from rank 0, the hook (torch's order)."""
        params = self._delay_all_reduce_params
        # torch's buffer: the default dtype, on the CPU unless device_ids names a device.
        device = torch.device("cpu") if device_ids is None else device_ids[0]
        self._delay_grad_buffer = torch.zeros(sum(p.numel() for p in params), device=device)
        # torch broadcasts these even with init_sync=False.
        dist._broadcast_coalesced(self.process_group, [p.detach() for p in params], BROADCAST_BUCKET_BYTES, 0)
        self._register_delayed_hook()
        offset = 0
        for p in params:
            self._delay_grad_views.append(self._delay_grad_buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._delay_all_reduce_all_params = all_delayed

    def _register_delayed_hook(self) -> None:
        # After param_to_hook_all_reduce's gradient is accumulated. torch's is a tensor hook, which
        # runs before: when that parameter is itself delayed, its gradient lands in the buffer
        # while the all-reduce of the buffer is in flight (a race); here it is reduced with the rest.
        # Through a weak reference, as the reducer's hooks (_reducer.py): a parameter holding the
        # DDP would keep it, and its process group, alive past its last reference.
        ddp_ref = weakref.ref(self)

        def hook(param):
            ddp = ddp_ref()
            if ddp is not None:
                ddp._delayed_all_reduce_hook(param)
        self._param_to_hook_all_reduce.register_post_accumulate_grad_hook(hook)

    def _delayed_all_reduce_hook(self, param) -> None:
        del param
        buf = self._delay_grad_buffer
        buf.div_(dist.get_world_size(self.process_group))
        work = dist.all_reduce(buf, group=self.process_group, async_op=True)
        # torch never waits for this all-reduce, so an optimizer step may read the delayed
        # gradients before it lands; ours waits for it when the backward ends.
        Variable._execution_engine.queue_callback(work.wait)

    def _clear_grad_buffer(self) -> None:
        """After each forward: a delayed parameter without a gradient gets its buffer view (zero)."""
        if self._delay_grad_buffer is None:
            return
        params = self._delay_all_reduce_params
        all_none = all(p.grad is None for p in params)
        for p, view in zip(params, self._delay_grad_views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self._delay_grad_buffer.zero_()
