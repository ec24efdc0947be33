"""The torch side: reference copies (CPU, or CUDA without the library), the kernel launch for
CUDA tensors, the ``hybrid::`` custom ops, and the public ``gather`` / ``scatter``."""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import numpy as np

from hybrid.core import BucketPlan, canonical_dtype
from hybrid.kernels._build import launch, resolve_backend
from hybrid.kernels._copies import _check_cast, _members, gather_copies, scatter_copies


def _torch_compute_dtype(torch, src_dtype):
    return torch.float64 if src_dtype == torch.float64 else torch.float32


def _np_bytes(t) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a 1-D uint8 numpy view (no copy)."""
    import torch
    if t.requires_grad:
        t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2) or t.dim() == 0:
        t = t.reshape(-1).view(torch.uint8)  # numpy has no such dtype; the bytes are the same
    return t.numpy().reshape(-1).view(np.uint8)


# From this many elements a CPU copy goes through torch's ``copy_``, which splits it over torch's
# intra-op threads; below it, numpy's single-threaded memcpy wins on per-call overhead.
_THREADED_COPY_NUMEL = 1 << 18


def _plain_cpu(tensors, flat, scale) -> bool:
    """Whether a gather/scatter is a bitwise copy between contiguous CPU tensors.

    Those run tensor by tensor: large ones through torch's ``copy_`` (threaded), small ones as
    ``np.copyto`` on byte views of the same memory (numpy slicing costs a tenth of torch's per
    tensor). ``_foreach_copy_`` into views measured 0.4x of one contiguous copy, this 0.85x on the
    ~100M-parameter model of ``python -m hybrid bench pack`` (2 threads).
    """
    return (scale is None and flat.device.type == "cpu" and flat.is_contiguous()
            and all(t.dtype == flat.dtype and t.is_contiguous() for t in tensors))


def _torch_gather_reference(tensors, out, offsets, scale) -> None:
    import torch
    if _plain_cpu(tensors, out, scale):
        flat, size, end = _np_bytes(out), out.element_size(), 0
        for t, o in zip(tensors, offsets):
            if o > end:
                flat[end * size:o * size] = 0
            end = o + t.numel()
            if t.numel() >= _THREADED_COPY_NUMEL:
                out[o:end].copy_(t.detach().reshape(-1))
            else:
                np.copyto(flat[o * size:end * size], _np_bytes(t))
        flat[end * size:] = 0
        return
    end, views, srcs = 0, [], []
    for t, o in zip(tensors, offsets):
        if o > end:
            out[end:o].zero_()
        views.append(out[o:o + t.numel()])
        srcs.append(t.reshape(-1))
        end = o + t.numel()
    if out.numel() > end:
        out[end:].zero_()
    if scale is not None:
        # not in place: .to() returns the caller's own tensor when no cast is needed
        srcs = torch._foreach_mul([s.to(_torch_compute_dtype(torch, s.dtype)) for s in srcs], scale)
    if views:
        torch._foreach_copy_(views, srcs)


def _torch_scatter_reference(flat, outs, offsets, scale) -> None:
    import torch
    if _plain_cpu(outs, flat, scale):
        src, size = _np_bytes(flat), flat.element_size()
        for t, o in zip(outs, offsets):
            if t.numel() >= _THREADED_COPY_NUMEL:
                t.detach().view(-1).copy_(flat[o:o + t.numel()])
            else:
                np.copyto(_np_bytes(t), src[o * size:(o + t.numel()) * size])
        return
    views = [flat[o:o + t.numel()] for t, o in zip(outs, offsets)]
    if scale is not None:
        views = torch._foreach_mul([v.to(_torch_compute_dtype(torch, v.dtype)) for v in views], scale)
    if views:
        torch._foreach_copy_([t.view(-1) for t in outs], views)


# Copy lists already prepared, by bucket and addresses. A training loop hands the same gradient
# and bucket storage to the same bucket every step (torch's caching allocator gives freed blocks
# back at the same addresses), so the per-tensor Python work of building the list is done once;
# what remains per call is reading the addresses and one C call. The entry holds its bucket, so
# the bucket's id cannot be reused while the entry lives.
_PREPARED: collections.OrderedDict = collections.OrderedDict()
_PREPARED_MAX = 512


def _prepared(key, bucket, build):
    """The copy list ``build()`` returns, kept under ``key`` for ``bucket``; built afresh (and not
    kept) without a bucket, as through the custom op."""
    if bucket is None:
        return build()
    hit = _PREPARED.get(key)
    if hit is not None and hit[0] is bucket:
        _PREPARED.move_to_end(key)
        return hit[1]
    srcs, dsts, numels = build()
    arrays = (np.asarray(srcs, np.uint64), np.asarray(dsts, np.uint64), np.asarray(numels, np.int64))
    _PREPARED[key] = (bucket, arrays)
    if len(_PREPARED) > _PREPARED_MAX:
        _PREPARED.popitem(last=False)
    return arrays


def _torch_gather_cuda(tensors, out, offsets, scale, bucket=None) -> None:
    import torch
    tensors = [t.contiguous() for t in tensors]  # keeps the copies alive until the launch is queued
    src = canonical_dtype(tensors[0].dtype) if tensors else canonical_dtype(out.dtype)
    dst, size = canonical_dtype(out.dtype), out.element_size()
    ptrs = [t.data_ptr() for t in tensors]

    def build():
        return gather_copies(ptrs, [t.numel() for t in tensors], offsets, out.data_ptr(), out.numel(), size)

    copies = _prepared(("gather", id(bucket), out.data_ptr(), out.numel(), src, dst, *ptrs), bucket, build)
    launch(*copies, src, dst, size, scale, torch.cuda.current_stream(out.device).cuda_stream)


def _torch_scatter_cuda(flat, outs, offsets, scale, bucket=None) -> None:
    import torch
    src = canonical_dtype(flat.dtype)
    dst = canonical_dtype(outs[0].dtype) if outs else src
    size = flat.element_size()
    ptrs = [t.data_ptr() for t in outs]

    def build():
        return scatter_copies(flat.data_ptr(), size, offsets, ptrs, [t.numel() for t in outs])

    copies = _prepared(("scatter", id(bucket), flat.data_ptr(), src, dst, *ptrs), bucket, build)
    launch(*copies, src, dst, size, scale, torch.cuda.current_stream(flat.device).cuda_stream)


def _direct(torch) -> bool:
    """Whether a CUDA call may skip torch's custom-op dispatcher: always, except while
    ``torch.compile`` traces (the op is what it sees there). The dispatcher costs tens of
    microseconds a call, as much as the copy of a whole bucket on an H200."""
    return not torch.compiler.is_compiling()


@functools.cache
def _torch_ops():
    """Registers the torch custom ops once, on first use (so importing hybrid never imports torch)."""
    import torch

    # explicit schemas: this module's annotations are strings (from __future__ import annotations)
    @torch.library.custom_op("hybrid::gather_bucket_", mutates_args=("out",),
                             schema="(Tensor[] tensors, Tensor(a!) out, int[] offsets, float? scale) -> ()")
    def gather_bucket_(tensors: list[torch.Tensor], out: torch.Tensor, offsets: list[int],
                       scale: float | None) -> None:
        _torch_gather_reference(tensors, out, offsets, scale)

    @gather_bucket_.register_kernel("cuda")
    def _(tensors, out, offsets, scale):
        _torch_gather_cuda(tensors, out, offsets, scale)

    @gather_bucket_.register_fake
    def _(tensors, out, offsets, scale):
        return None

    @torch.library.custom_op("hybrid::gather_bucket", mutates_args=(),
                             schema="(Tensor[] tensors, int[] offsets, int length, float? scale, "
                                    "ScalarType out_dtype) -> Tensor")
    def gather_bucket(tensors: list[torch.Tensor], offsets: list[int], length: int, scale: float | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(length, dtype=out_dtype, device=tensors[0].device)
        gather_bucket_(tensors, out, offsets, scale)
        return out

    @gather_bucket.register_fake
    def _(tensors, offsets, length, scale, out_dtype):
        return tensors[0].new_empty(length, dtype=out_dtype)

    @torch.library.custom_op("hybrid::scatter_bucket_", mutates_args=("outs",),
                             schema="(Tensor flat, Tensor(a!)[] outs, int[] offsets, float? scale) -> ()")
    def scatter_bucket_(flat: torch.Tensor, outs: list[torch.Tensor], offsets: list[int],
                        scale: float | None) -> None:
        _torch_scatter_reference(flat, outs, offsets, scale)

    @scatter_bucket_.register_kernel("cuda")
    def _(flat, outs, offsets, scale):
        _torch_scatter_cuda(flat, outs, offsets, scale)

    @scatter_bucket_.register_fake
    def _(flat, outs, offsets, scale):
        return None

    return gather_bucket, gather_bucket_, scatter_bucket_


def gather(plan: BucketPlan, bucket_index: int, tensors: Sequence, out=None, *, scale: float | None = None,
           out_dtype=None, backend: str | None = None):
    """Copy a bucket's member tensors into one flat torch tensor laid out as ``plan`` says.

    Args:
      plan: the bucket plan.
      bucket_index: which bucket.
      tensors: one torch tensor per spec of the plan (indexed like ``plan.specs``); only the
        bucket's members are read.
      out: a 1-D tensor of at least the bucket's length to write into (default: a new one).
      scale: multiply by this on the way (e.g. ``1 / world_size``).
      out_dtype: the bucket's dtype if it differs from the members' (float32/float16/bfloat16).
      backend: ``"auto"``, ``"cuda"`` or ``"reference"``; default ``$HYBRID_KERNELS`` or auto.

    Returns:
      The flat tensor (``out`` when given); padding and gaps are zeros.

    >>> import torch
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> gather(plan, 0, [torch.ones(2), torch.full((1, 2), 3.0)], scale=0.5).tolist()
    [0.5, 0.5, 1.5, 1.5]
    """
    import torch
    members = _members(plan, bucket_index, tensors, "gather")
    bucket = plan.buckets[bucket_index]
    dtype = members[0].dtype if out_dtype is None else out_dtype
    if out is not None:
        if out.dim() != 1 or out.numel() < bucket.length or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous 1-D tensor of at least {bucket.length} elements, "
                             f"got shape {tuple(out.shape)}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        dtype = out.dtype
    _check_cast(bucket.dtype, canonical_dtype(dtype), scale)
    gather_bucket, gather_bucket_, _ = _torch_ops()
    on_cuda = members[0].device.type == "cuda"
    reference = resolve_backend(backend, on_cuda=on_cuda) == "reference"
    if reference or _direct(torch):
        if out is None:
            out = torch.empty(bucket.length, dtype=dtype, device=members[0].device)
        if reference:
            _torch_gather_reference(members, out, list(bucket.offsets), scale)
        else:
            _torch_gather_cuda(members, out, bucket.offsets, scale, bucket)
        return out
    if out is None:
        return gather_bucket(members, list(bucket.offsets), bucket.length, scale, dtype)
    gather_bucket_(members, out, list(bucket.offsets), scale)
    return out


def scatter(plan: BucketPlan, bucket_index: int, flat, tensors: Sequence | None = None, *,
            scale: float | None = None, out_dtype=None, backend: str | None = None) -> dict[int, object]:
    """Copy a flat torch bucket back into its member tensors: ``{spec_index: tensor}``.

    Args:
      plan, bucket_index: as for :func:`gather`.
      flat: the 1-D bucket tensor.
      tensors: one tensor per spec to write the members into (contiguous, the specs' shapes);
        default new tensors of dtype ``out_dtype`` (default ``flat.dtype``).
      scale, backend: as for :func:`gather`.

    >>> import torch
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> {k: v.tolist() for k, v in scatter(plan, 0, torch.arange(4.0)).items()}
    {0: [0.0, 1.0], 1: [[2.0, 3.0]]}
    """
    import torch
    bucket = plan.buckets[bucket_index] if 0 <= bucket_index < len(plan.buckets) else None
    if bucket is None:
        raise ValueError(f"bucket_index {bucket_index} out of range for {len(plan.buckets)} buckets")
    if flat.dim() != 1 or flat.numel() < bucket.length:
        raise ValueError(f"bucket {bucket_index} needs a 1-D tensor of at least {bucket.length} elements, "
                         f"got shape {tuple(flat.shape)}")
    if tensors is None:
        dtype = flat.dtype if out_dtype is None else out_dtype
        outs = [torch.empty(plan.specs[m].shape, dtype=dtype, device=flat.device) for m in bucket.members]
    else:
        outs = _members(plan, bucket_index, tensors, "scatter")
        for m, t in zip(bucket.members, outs):
            if not t.is_contiguous():
                raise ValueError(f"tensor {plan.specs[m].name!r} must be contiguous to be scattered into")
    _check_cast(canonical_dtype(flat.dtype), canonical_dtype(outs[0].dtype), scale)
    flat = flat.contiguous()
    _, _, scatter_bucket_ = _torch_ops()
    if resolve_backend(backend, on_cuda=flat.device.type == "cuda") == "reference":
        _torch_scatter_reference(flat, outs, list(bucket.offsets), scale)
    elif _direct(torch):
        _torch_scatter_cuda(flat, outs, bucket.offsets, scale, bucket)
    else:
        scatter_bucket_(flat, outs, list(bucket.offsets), scale)
    return dict(zip(bucket.members, outs))
