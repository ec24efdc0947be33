"""The reducer's buckets as tensors: :class:`BucketBuffers`, one bucket plan's flat buffers and
each gradient's view into them, and every copy between gradients and buckets.

Which gradient sits in which bucket at which offset is the plan's decision (``hybrid.core``);
this part allocates what the plan describes and moves the values: into a bucket before its
reduction (scaled by 1/world size unless a comm hook scales), and back into ``.grad`` after it.
On CUDA the copies of a whole bucket are one kernel launch (:mod:`hybrid.kernels`); elsewhere
torch's foreach copies, as torch's reducer does.
"""

from __future__ import annotations

from collections.abc import Set

import torch

from hybrid import kernels
from hybrid.core import Bucket, BucketPlan
from hybrid.torch.ddp._logging import nbytes
from hybrid.torch.ddp._parts import GradBucket
from hybrid.torch.ddp.reducer._sparse import sparse_placeholder


def _bucket_copy_backend(device: torch.device) -> str:
    """``"cuda"`` when copies between gradients and buckets on ``device`` go through
    :mod:`hybrid.kernels` (CUDA tensors, library built, unless ``HYBRID_KERNELS=reference``),
    else ``"reference"``: torch's own (foreach) copies, as on CPU.

    >>> _bucket_copy_backend(torch.device("cpu"))
    'reference'
    """
    if device.type != "cuda":
        return "reference"
    return kernels.resolve_backend(None, on_cuda=True)


class BucketBuffers:
    """The buffers of one bucket plan over ``params`` (the reduced parameters, indexed as the
    plan's specs), on ``device``.

    Owns ``plan``; ``flat`` (per bucket: a dense bucket's flat buffer; a sparse bucket's
    gradient last launched; an in-place bucket's gradient itself during its iteration, an empty
    tensor between); ``views`` (per parameter: its gradient's view into its bucket, None for
    sparse and in-place members); ``is_last``; and the copy policy: ``kernel_copy`` (a bucket's
    copies are one :mod:`hybrid.kernels` launch) and ``fuse_at_hook`` (per parameter: its
    gradient hook copies and scales it, one pass over memory).

    Args:
      bucket_dtype: the buckets' dtype (mixed precision's reduce dtype), or None for the
        gradients' own; a cast rules out the kernel copies.
      grads_in_buckets: ``gradient_as_bucket_view``: ``.grad`` is its view into the bucket.
      batched_copy: ``batched_grad_copy``: every gradient is copied at its bucket's launch.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    >>> buckets = BucketBuffers(params, torch.device("cpu"), bucket_dtype=None, grads_in_buckets=False,
    ...                         batched_copy=False)
    >>> buckets.set_plan(plan_buckets([TensorSpec("w", (2, 3), "float32"), TensorSpec("b", (4,), "float32")]))
    >>> [tuple(f.shape) for f in buckets.flat], buckets.views[0].shape
    ([(10,)], torch.Size([2, 3]))
    >>> for p in params:
    ...     p.grad = torch.full_like(p, 4.0)
    >>> buckets.fill(0, inv_div=0.5, div_factor=2, iteration=1)   # into the bucket, averaged over 2 ranks
    >>> buckets.flat[0].tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    >>> buckets.write_back(0, frozenset())                      # what the all-reduce left, into .grad
    >>> params[1].grad.tolist()
    [2.0, 2.0, 2.0, 2.0]
    """

    # From this many elements on, scaling while copying in the hook (one pass over memory, torch's
    # mul_out) beats a batched copy and a multiply at launch; below it per-call overhead dominates.
    FUSED_SCALE_NUMEL = 1 << 16

    def __init__(self, params: list[torch.Tensor], device: torch.device, *, bucket_dtype: torch.dtype | None,
                 grads_in_buckets: bool, batched_copy: bool):
        self._params, self._device = params, device
        self._bucket_dtype = bucket_dtype
        self.grads_in_buckets = grads_in_buckets
        self._batched_copy = batched_copy
        self._comm_hook = False  # a comm hook reduces (and scales) the buckets
        self.plan: BucketPlan | None = None
        self.flat: list[torch.Tensor] = []
        self.views: list[torch.Tensor | None] = []
        self.is_last: list[bool] = []
        self.kernel_copy = False
        self.fuse_at_hook: list[bool] = []
        self._scaled_in: list[int] = []  # per parameter: the iteration in which its hook scaled it

    def set_plan(self, plan: BucketPlan) -> None:
        """Allocate ``plan``'s buckets (zeros) and views; with ``gradient_as_bucket_view`` an
        existing gradient moves into its bucket (torch's initialize_bucket_views)."""
        self.plan = plan
        self.flat, self.views = [], [None] * len(self._params)
        for bucket in plan.buckets:
            p0 = self._params[bucket.members[0]]
            if bucket.sparse:  # reduced as the sparse gradient itself: no flat buffer, no view
                self.flat.append(sparse_placeholder(p0))
                continue
            if bucket.in_place:  # reduced where its gradient lies: fill() points at it
                self.flat.append(torch.empty(0, dtype=self.dtype_of(p0), device=p0.device))
                continue
            buf = torch.zeros(bucket.length, dtype=self.dtype_of(p0), device=p0.device)
            self.flat.append(buf)
            for m, view in zip(bucket.members, self.views_of(bucket, buf)):
                self.views[m] = view
        if self.grads_in_buckets:
            for p, v in zip(self._params, self.views):
                if p.grad is not None and v is not None:
                    v.copy_(p.grad)
                    p.grad = v
        self.is_last = [b == len(plan.buckets) - 1 for b in range(len(plan.buckets))]
        self._scaled_in = [-1] * len(self._params)
        self.kernel_copy = _bucket_copy_backend(self._device) == "cuda" and self._bucket_dtype is None
        self._update_copy_policy()

    def dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of ``param``'s bucket."""
        return param.dtype if self._bucket_dtype is None else self._bucket_dtype

    def views_of(self, bucket: Bucket, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each member's gradient as a view into ``buf`` laid out as ``bucket`` says."""
        return [buf[o:o + n].view(self._params[m].shape)
                for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels)]

    def use_comm_hook(self) -> None:
        """A comm hook reduces the buckets from now on: it divides by the world size itself, and
        gets every gradient copied at launch."""
        self._comm_hook = True
        self._update_copy_policy()

    def _update_copy_policy(self) -> None:
        """Which gradients the hook copies (fused with the scale) rather than :meth:`fill`."""
        fuse = not (self._batched_copy or self.kernel_copy or self._comm_hook)
        self.fuse_at_hook = [fuse and v is not None and p.numel() >= self.FUSED_SCALE_NUMEL
                             for p, v in zip(self._params, self.views)]

    def copy_in_hook(self, index: int, grad: torch.Tensor | None, inv_div: float, iteration: int) -> None:
        """Gradient ``index`` into its bucket, times ``inv_div``, from its hook (``fuse_at_hook``);
        :meth:`fill` then skips it in this ``iteration``."""
        view = self.views[index]
        if grad is not None and grad.data_ptr() != view.data_ptr():
            torch.mul(grad, inv_div, out=view)
            self._scaled_in[index] = iteration

    def fill(self, b: int, *, inv_div: float, div_factor: int, iteration: int) -> None:
        """Bring bucket ``b``'s gradients into its buffer, divided by the world size when no comm
        hook runs (a hook divides itself), as torch does: x * (1/n) for copied gradients (mul_out),
        x / n for gradients already living in the bucket (``gradient_as_bucket_view``: div_)."""
        if self.plan.buckets[b].in_place:
            self._fill_in_place(b, inv_div)
            return
        members = self.plan.buckets[b].members
        params, views, scaled_in = self._params, self.views, self._scaled_in
        dst, src, in_place = [], [], []
        for m in members:
            if scaled_in[m] == iteration:
                continue  # copied and scaled in its hook
            grad, view = params[m].grad, views[m]
            if grad is None:
                view.zero_()  # an unused parameter contributes zeros; zero stays zero
            elif grad.data_ptr() == view.data_ptr():
                in_place.append(view)
            else:
                dst.append(view)
                src.append(grad)
        scale = not self._comm_hook
        if dst:
            if self.kernel_copy and len(dst) == len(members):
                # One launch for the whole bucket, the scale fused in (hybrid.kernels).
                kernels.gather(self.plan, b, [p.grad for p in params], out=self.flat[b],
                               scale=inv_div if scale else None, backend="cuda")
                return
            torch._foreach_copy_(dst, src)
            if scale:
                if len(dst) == len(members):
                    self.flat[b].mul_(inv_div)  # one op for a bucket of many small grads
                else:
                    torch._foreach_mul_(dst, inv_div)
        if in_place and scale:
            if len(in_place) == len(members):
                self.flat[b].div_(div_factor)
            else:
                torch._foreach_div_(in_place, div_factor)

    def _fill_in_place(self, b: int, inv_div: float) -> None:
        """An in-place bucket (``bucket_cap_mb="auto"``): its one gradient is the buffer, scaled
        where it lies as the copy path scales (x * (1/n), bit for bit). A gradient that is not one
        dense contiguous block (channels_last), or none at all (unused this iteration), is
        reduced through a flat tensor of its own and written back as a copied bucket is."""
        bucket = self.plan.buckets[b]
        (m,) = bucket.members
        param, grad = self._params[m], self._params[m].grad
        if grad is not None and grad.layout == torch.strided and grad.is_contiguous():
            buf, view = grad.view(-1), grad
        else:
            buf = torch.zeros(bucket.length, dtype=self.dtype_of(param), device=param.device)
            if grad is not None:
                buf.view(param.shape).copy_(grad)
            view = buf.view(param.shape)
        if not self._comm_hook:
            buf.mul_(inv_div)
        self.flat[b], self.views[m] = buf, view

    def param_bytes(self) -> tuple[list[int], list[list[int]]]:
        """The buckets: each one's parameter bytes and its members (torch's logger's view)."""
        members = self.plan.bucket_indices()
        return [sum(nbytes(self._params[m]) for m in ms) for ms in members], members

    def zero_bucket(self, b: int) -> torch.Tensor:
        """Zeros shaped as bucket ``b``'s buffer: what a joined rank reduces in its place."""
        bucket, buf = self.plan.buckets[b], self.flat[b]
        if bucket.in_place:
            return torch.zeros(bucket.length, dtype=buf.dtype, device=buf.device)
        return torch.zeros_like(buf)

    def grad_bucket(self, b: int, buf: torch.Tensor) -> GradBucket:
        """What a comm hook receives for bucket ``b`` with ``buf`` as its flat buffer (this
        bucket's own, or zeros when a joined rank shadows the others' backward)."""
        spec = self.plan.buckets[b]
        views = ([] if spec.sparse  # torch's sparse GradBucket has no per-parameter views
                 else [self.views[m] for m in spec.members] if buf is self.flat[b]
                 else self.views_of(spec, buf))
        return GradBucket(b, buf, views, [self._params[m] for m in spec.members], self.is_last[b])

    def take_result(self, b: int, value: torch.Tensor) -> None:
        """Dense bucket ``b``'s reduced values (a comm hook's, or the all-reduced buffer itself)
        into its buffer."""
        buf = self.flat[b]
        if value.data_ptr() != buf.data_ptr():
            buf.copy_(value.view(-1)[: buf.numel()])

    def write_back(self, b: int, skip: Set[int]) -> None:
        """Reduced bucket ``b`` into its parameters' ``.grad`` but those in ``skip`` (torch's
        copy_bucket_to_grad), in one call: a kernel launch on CUDA (hybrid.kernels), a foreach
        copy on CPU."""
        bucket = self.plan.buckets[b]
        if bucket.sparse:
            return  # its .grad was reduced in place
        params, views, members = self._params, self.views, bucket.members
        grads = [params[m].grad for m in members]
        if bucket.in_place and grads[0] is not None and grads[0].data_ptr() == views[members[0]].data_ptr():
            return  # reduced where it lies
        if (self.kernel_copy and not bucket.in_place and not skip.intersection(members)
                and all(g is not None and g.is_contiguous() for g in grads)):
            kernels.scatter(self.plan, b, self.flat[b], [p.grad for p in params], backend="cuda")
            return
        dst, src = [], []
        for m, g in zip(members, grads):
            if m in skip:
                continue
            if g is None:
                params[m].grad = views[m].clone()
            else:
                dst.append(g)
                src.append(views[m])
        if dst:
            torch._foreach_copy_(dst, src)

    def grads_to_views(self, keep: Set[int]) -> None:
        """``gradient_as_bucket_view``: every ``.grad`` but those in ``keep`` is its bucket view
        (a sparse gradient is reduced in place, never a view, as torch's)."""
        for i, (p, view) in enumerate(zip(self._params, self.views)):
            if view is not None and i not in keep and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                p.grad = view

    def release_in_place(self) -> None:
        """In-place buckets hold no gradient past their iteration (the next one brings its own)."""
        for b, bucket in enumerate(self.plan.buckets):
            if bucket.in_place:
                (m,) = bucket.members
                buf = self.flat[b]
                self.flat[b], self.views[m] = torch.empty(0, dtype=buf.dtype, device=buf.device), None
