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
after construction raises torch's "can only be called once"): the DDP registers
:func:`_allreduce_and_upcast_hook` with a weak reference to its :class:`MixedPrecision` part as
the hook's state. Where torch 2.13 fails on a
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
    mixed = state()
    fut = dist.all_reduce(bucket.buffer(), group=mixed.group, async_op=True).get_future()
    if mixed.owns(bucket):  # not a joined rank's zero bucket: a real backward
        mixed.restore_bucket(bucket.parameters())
    n = mixed.group.size()  # torch divides by the group's size, not Join's divisor
    return fut.then(lambda f: f.value()[0].div_(n))


class MixedPrecision:
    """Mixed precision for one DDP: ``config`` is torch's ``_MixedPrecision`` (or any object with
    its fields ``param_dtype``, ``reduce_dtype``, ``buffer_dtype``), checked here.

    Owns ``config``; ``bucket_dtype`` (the dtype the buckets are laid out and reduced in:
    ``reduce_dtype``, else ``param_dtype``); after :meth:`setup`, the parameters it casts for
    each forward (every one not ignored; the frozen ones apart, restored after the backward),
    the process group its hook reduces over, and the reducer's buckets (to tell a real bucket
    from the zeros a joined rank reduces). The DDP calls :meth:`setup` once its reducer exists,
    :meth:`pre_forward` / :meth:`post_forward` around the module, and registers the hook.
    """

    def __init__(self, config, *, find_unused_parameters: bool):
        _check_config(config)
        if find_unused_parameters:
            raise NotImplementedError(
                "hybrid.torch.DistributedDataParallel does not support mixed_precision with "
                "find_unused_parameters=True: torch 2.13's DistributedDataParallel fails on it too (its "
                "unused-parameter search misses the low-precision copies, and its mixed-precision hook "
                "raises AttributeError on the missing .grad); make every parameter take part in the loss "
                "and pass find_unused_parameters=False")
        self.config = config
        # Gradients are reduced in reduce_dtype, else in param_dtype (torch's rule): the buckets
        # are laid out, and their byte caps counted, in that dtype.
        self.bucket_dtype: torch.dtype = config.reduce_dtype or config.param_dtype
        self.group = None
        self._buckets = None
        self._names, self._index_of = [], {}
        self._params: list[torch.Tensor] = []
        self._frozen: list[torch.Tensor] = []
        self._callback_queued = False

    @property
    def layout_setting(self) -> tuple:
        """The config as ranks compare it (``_layout_settings["mixed_precision"]``)."""
        return tuple(None if getattr(self.config, f) is None else canonical_dtype(getattr(self.config, f))
                     for f in _FIELDS)

    def bucket_specs(self, specs_: list) -> list:
        """``specs_`` in the reduce dtype: what the bucket plan is built from."""
        dtype = canonical_dtype(self.bucket_dtype)
        return [dataclasses.replace(s, dtype=dtype) for s in specs_]

    def setup(self, module, *, group, buckets, names: list[str], index_of: dict[int, int]) -> None:
        """torch's ``_setup_mixed_precision_params`` and ``_cast_buffers``, once the reducer's
        ``buckets`` exist; the DDP then registers :func:`_allreduce_and_upcast_hook`."""
        self.group, self._buckets, self._names, self._index_of = group, buckets, names, index_of
        param_dtype = self.config.param_dtype
        self._params = [p for p in module.parameters() if not _ignored(p)]
        self._frozen = [p for p in self._params if not p.requires_grad]
        for p in self._params:
            if not hasattr(p, "_mp_param"):
                p._mp_param = torch.zeros_like(p, device=p.device, dtype=param_dtype, requires_grad=p.requires_grad)
                _free_storage(p._mp_param)
                p._fp_param = p.data
        for b in module.buffers():
            if not _ignored(b):
                # Every buffer, integer ones too (BatchNorm's num_batches_tracked): torch's cast.
                b.data = b.to(dtype=self.config.buffer_dtype)

    def owns(self, bucket) -> bool:
        """Whether ``bucket`` (a comm hook's GradBucket) holds this DDP's own buffer."""
        return bucket.buffer() is self._buckets.flat[bucket.index()]

    def refuse_pickling(self) -> None:
        """Raise: a DDP with mixed precision does not pickle (its hook state is a weak reference)."""
        raise TypeError(
            "cannot pickle a DistributedDataParallel with mixed_precision (torch 2.13 cannot either: "
            "TypeError: cannot pickle 'weakref.ReferenceType' object); save ddp.module's state_dict "
            "instead (parameters in full precision)")

    # ---- forward and backward ----------------------------------------------------------------

    def pre_forward(self, inputs, kwargs, *, sync: bool):
        """Inputs to param_dtype, parameters onto fresh low-precision copies (torch's
        ``_cast_forward_inputs`` and ``_root_copy_hook``). ``sync``: the DDP's
        ``require_backward_grad_sync``."""
        param_dtype = self.config.param_dtype
        if torch.is_grad_enabled() and not sync:
            raise RuntimeError(
                "hybrid.torch.DistributedDataParallel does not support no_sync() with mixed_precision: "
                "torch 2.13's DistributedDataParallel fails on it too (the next synchronizing backward "
                "raises 'Expected to mark a variable ready only once'); run a synchronizing backward "
                "every step, or accumulate the losses of several micro-batches before one backward")
        inputs, kwargs = _cast_forward_inputs(param_dtype, *inputs, **kwargs)
        with torch.no_grad():
            for p in self._params:
                _alloc_storage(p._mp_param, p.size())
                p._mp_param.copy_(p.data)
                # An accumulated gradient must match the parameter's dtype during backward.
                if p.grad is not None:
                    p.grad.data = p.grad.to(param_dtype)
                p.data = p._mp_param
        return inputs, kwargs

    def post_forward(self) -> None:
        # No backward follows a forward under no_grad: back to full precision now. (torch 2.13
        # fails on such a forward: AttributeError in its _module_wait_for_copy_hook.)
        if not torch.is_grad_enabled():
            self._restore(self._params)

    def restore_bucket(self, params) -> None:
        """A reduced bucket's parameters back to full precision, their gradients upcast (the
        reduced values are written into them at the end of the backward)."""
        for p in params:
            if p.grad is None:
                # torch 2.13 fails here too (AttributeError: 'NoneType' object has no attribute 'to').
                raise RuntimeError(
                    f"DistributedDataParallel with mixed_precision: parameter "
                    f"{self._names[self._index_of[id(p)]]} received no gradient in this backward; "
                    "mixed precision needs every reduced parameter to take part in the loss")
        self._restore(params)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        # torch's wait_for_stream_cb: parameters that do not require grad were cast for the
        # forward too but belong to no bucket; they point back at full precision (storage kept).
        for p in self._frozen:
            p.data = p._fp_param
        self._callback_queued = False

    @staticmethod
    def _restore(params) -> None:
        with torch.no_grad():
            for p in params:
                p.data = p._fp_param
                _free_storage(p._mp_param)
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad.data = p.grad.to(p.dtype)
