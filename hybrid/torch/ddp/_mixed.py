"""Mixed precision for hybrid's DDP: torch's ``mixed_precision=_MixedPrecision(...)``.

As torch 2.13's ``DistributedDataParallel`` does it: each parameter keeps its full-precision
tensor (``p._fp_param``, what the optimizer steps) and gets a low-precision copy
(``p._mp_param``, storage freed outside forward/backward). A forward casts floating inputs to
``param_dtype`` and points every parameter's ``.data`` at a fresh low-precision copy; the backward
accumulates gradients in ``param_dtype``; each bucket, laid out in the reduce dtype, is summed
across ranks in that dtype and divided by the group's size; then the parameters point back at
their full-precision tensors and ``.grad`` ends up in the parameter's own dtype (float32) holding
the reduced value. Buffers are cast to ``buffer_dtype`` once, at construction.

torch implements this with a comm hook over its C++ reducer; so do we (``register_comm_hook``
after construction raises torch's "can only be called once"). Where torch 2.13 fails on a
combination, we raise a clear error instead (find_unused_parameters, no_sync, a parameter
without gradient, param_dtype=None, pickling); where torch returns wrong values (the gradients of
the iterations before its buckets are rebuilt) we return the right ones.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch.distributed.utils import _alloc_storage, _cast_forward_inputs, _free_storage

from hybrid.core import canonical_dtype
from hybrid.torch.ddp._parts import specs

_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def _ignored(t: torch.Tensor) -> bool:
    # torch marks what _set_params_and_buffers_to_ignore_for_model names with _ddp_ignored.
    return bool(getattr(t, "_ddp_ignored", False))


def _check_config(mp) -> None:
    """torch's ``_MixedPrecision`` or any object with its three fields, each a floating dtype or None."""
    missing = [f for f in _FIELDS if not hasattr(mp, f)]
    if missing:
        raise TypeError(f"mixed_precision must be a torch.nn.parallel.distributed._MixedPrecision (fields "
                        f"param_dtype, reduce_dtype, buffer_dtype); got {type(mp).__name__} without {missing}")
    for f in _FIELDS:
        dtype = getattr(mp, f)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"mixed_precision.{f} must be a floating torch.dtype or None, got {dtype!r}")
    if mp.param_dtype is None:
        # torch 2.13 accepts it, then fails in its reducer ("Expected Byte, got Float").
        raise ValueError(f"mixed_precision.param_dtype is None in {mp!r}: DDP mixed precision needs a "
                         "param_dtype (torch 2.13's DistributedDataParallel fails without one too); set "
                         "param_dtype, or pass mixed_precision=None")


def _allreduce_and_upcast_hook(state: weakref.ref, bucket) -> torch.futures.Future:
    """torch's ``_reducer_allreduce_and_upcast_hook``: sum the bucket (already in the reduce dtype)
    across ranks, divide by the group's size in that dtype; the bucket's parameters go back to
    full precision and their local gradients are upcast, ready for the reduced values."""
    ddp = state()
    buf = bucket.buffer()
    fut = dist.all_reduce(buf, group=ddp.process_group, async_op=True).get_future()
    if buf is ddp._buckets.flat[bucket.index()]:  # not a joined rank's zero bucket: a real backward
        ddp._mp_restore_bucket(bucket.parameters())
    n = ddp.process_group.size()  # torch divides by the group's size, not Join's divisor
    return fut.then(lambda f: f.value()[0].div_(n))


class MixedPrecision:
    """Mixed into :class:`hybrid.torch.DistributedDataParallel`, which owns the attributes used."""

    mixed_precision = None
    _mp_bucket_dtype: torch.dtype | None = None

    def _init_mixed_precision(self, mixed_precision) -> None:
        """Validate the config and fix the buckets' dtype before the reducer plans them."""
        self.mixed_precision = mixed_precision
        # Ranks compare these settings key by key: the key is there with or without a config.
        self._layout_settings["mixed_precision"] = None
        if mixed_precision is None:
            return
        _check_config(mixed_precision)
        if self.find_unused_parameters:
            raise NotImplementedError(
                "hybrid.torch.DistributedDataParallel does not support mixed_precision with "
                "find_unused_parameters=True: torch 2.13's DistributedDataParallel fails on it too (its "
                "unused-parameter search misses the low-precision copies, and its mixed-precision hook "
                "raises AttributeError on the missing .grad); make every parameter take part in the loss "
                "and pass find_unused_parameters=False")
        # Gradients are reduced in reduce_dtype, else in param_dtype (torch's rule): the buckets
        # are laid out, and their byte caps counted, in that dtype.
        self._mp_bucket_dtype = mixed_precision.reduce_dtype or mixed_precision.param_dtype
        self._layout_settings["mixed_precision"] = tuple(
            None if getattr(mixed_precision, f) is None else canonical_dtype(getattr(mixed_precision, f))
            for f in _FIELDS)

    def _setup_mixed_precision(self) -> None:
        """torch's ``_setup_mixed_precision_params`` and ``_cast_buffers``, then the reducing hook."""
        mp = self.mixed_precision
        if mp is None:
            return
        self._mp_params = [p for p in self.module.parameters() if not _ignored(p)]
        self._mp_frozen = [p for p in self._mp_params if not p.requires_grad]
        self._mp_callback_queued = False
        for p in self._mp_params:
            if not hasattr(p, "_mp_param"):
                p._mp_param = torch.zeros_like(p, device=p.device, dtype=mp.param_dtype,
                                               requires_grad=p.requires_grad)
                _free_storage(p._mp_param)
                p._fp_param = p.data
        for b in self.module.buffers():
            if not _ignored(b):
                # Every buffer, integer ones too (BatchNorm's num_batches_tracked): torch's cast.
                b.data = b.to(dtype=mp.buffer_dtype)
        self.register_comm_hook(weakref.ref(self), _allreduce_and_upcast_hook)

    # ---- what the reducer and _set_plan ask --------------------------------------------------

    def _bucket_specs(self):
        """The specs the bucket plan is built from: in the reduce dtype under mixed precision."""
        out = specs(self.module, self.parameters_to_ignore)
        if self._mp_bucket_dtype is None:
            return out
        dtype = canonical_dtype(self._mp_bucket_dtype)
        return [dataclasses.replace(s, dtype=dtype) for s in out]

    def _bucket_dtype(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype if self._mp_bucket_dtype is None else self._mp_bucket_dtype

    @property
    def _grads_in_buckets(self) -> bool:
        """gradient_as_bucket_view's aliasing: a full-precision ``.grad`` cannot view a bucket in
        another dtype, so under mixed precision ``.grad`` is its own tensor (in torch too, the
        upcast gives it its own storage; only memory differs)."""
        return self.gradient_as_bucket_view and self.mixed_precision is None

    # ---- forward and backward ----------------------------------------------------------------

    def _mp_pre_forward(self, inputs, kwargs):
        """Inputs to param_dtype, parameters onto fresh low-precision copies (torch's
        ``_cast_forward_inputs`` and ``_root_copy_hook``)."""
        mp = self.mixed_precision
        if torch.is_grad_enabled() and not self.require_backward_grad_sync:
            raise RuntimeError(
                "hybrid.torch.DistributedDataParallel does not support no_sync() with mixed_precision: "
                "torch 2.13's DistributedDataParallel fails on it too (the next synchronizing backward "
                "raises 'Expected to mark a variable ready only once'); run a synchronizing backward "
                "every step, or accumulate the losses of several micro-batches before one backward")
        inputs, kwargs = _cast_forward_inputs(mp.param_dtype, *inputs, **kwargs)
        with torch.no_grad():
            for p in self._mp_params:
                _alloc_storage(p._mp_param, p.size())
                p._mp_param.copy_(p.data)
                # An accumulated gradient must match the parameter's dtype during backward.
                if p.grad is not None:
                    p.grad.data = p.grad.to(mp.param_dtype)
                p.data = p._mp_param
        return inputs, kwargs

    def _mp_post_forward(self) -> None:
        # No backward follows a forward under no_grad: back to full precision now. (torch 2.13
        # fails on such a forward: AttributeError in its _module_wait_for_copy_hook.)
        if not torch.is_grad_enabled():
            self._mp_restore(self._mp_params)

    def _mp_restore_bucket(self, params) -> None:
        """A reduced bucket's parameters back to full precision, their gradients upcast (the
        reduced values are written into them at the end of the backward)."""
        for p in params:
            if p.grad is None:
                # torch 2.13 fails here too (AttributeError: 'NoneType' object has no attribute 'to').
                raise RuntimeError(
                    f"DistributedDataParallel with mixed_precision: parameter "
                    f"{self._names[self._index_of[id(p)]]} received no gradient in this backward; "
                    "mixed precision needs every reduced parameter to take part in the loss")
        self._mp_restore(params)
        if not self._mp_callback_queued:
            self._mp_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._mp_after_backward)

    def _mp_after_backward(self) -> None:
        # torch's wait_for_stream_cb: parameters that do not require grad were cast for the
        # forward too but belong to no bucket; they point back at full precision (storage kept).
        for p in self._mp_frozen:
            p.data = p._fp_param
        self._mp_callback_queued = False

    @staticmethod
    def _mp_restore(params) -> None:
        with torch.no_grad():
            for p in params:
                p.data = p._fp_param
                _free_storage(p._mp_param)
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad.data = p.grad.to(p.dtype)

    # ---- pickling ----------------------------------------------------------------------------

    def __getstate__(self):
        if self.mixed_precision is not None:
            raise TypeError(
                "cannot pickle a DistributedDataParallel with mixed_precision (torch 2.13 cannot either: "
                "TypeError: cannot pickle 'weakref.ReferenceType' object); save ddp.module's state_dict "
                "instead (parameters in full precision)")
        return super().__getstate__()
