"""Batched copy kernels: many tensors into one flat bucket (gather) and back (scatter).

One CUDA launch per launch table instead of one per tensor, with an optional fused scale (e.g.
``1 / world_size``) and dtype cast (float32 <-> bfloat16, float16). The CUDA library is built
from ``kernels/`` by ``python -m hybrid.kernels build`` (or ``make -C kernels``); without it, or
for CPU tensors, the same copies run through the reference path (torch ``_foreach_copy_`` into
views of the bucket, ``jnp.concatenate`` for JAX).

Which path runs: the ``backend`` argument, else the ``HYBRID_KERNELS`` environment variable
(``auto`` | ``cuda`` | ``reference``), else ``auto`` (the kernels for CUDA tensors when the library
is built, the reference path otherwise). ``cuda`` fails loudly when the kernels cannot run.

Cast and scale semantics, identical on both paths: ``y = dst(float32(x) * float32(scale))`` for
float32/float16/bfloat16 (round to nearest even); float64 is scaled in float64 and not cast.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hybrid.core import BucketPlan, canonical_dtype

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
BUILD_DIR = KERNELS_DIR / "build"
LIBRARY_NAME = "libhybrid_kernels.so"
GENCODE = ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90")
BACKENDS = ("auto", "cuda", "reference")

# dtype codes of the C ABI (kernels/batched_copy.cuh); anything else is copied as raw bytes
_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4}
_FLOATS = ("float32", "float16", "bfloat16")


# ---- build and load ---------------------------------------------------------------------------

def build(build_dir: str | os.PathLike | None = None, *, host: bool = False) -> Path:
    """Compile the kernels into ``build_dir`` (default ``kernels/build``); returns the library path.

    ``host=True`` builds the host emulation (same launch tables and per-block body, run by a host
    loop) with the C++ compiler instead, which the tests drive against numpy. No GPU is needed.

    >>> build(host=True).name  # doctest: +SKIP
    'host_emulation.so'
    """
    out = Path(build_dir) if build_dir is not None else BUILD_DIR
    out.mkdir(parents=True, exist_ok=True)
    if host:
        cxx = os.environ.get("CXX", "g++")
        target = out / "host_emulation.so"
        cmd = [cxx, "-std=c++17", "-O2", "-Wall", "-shared", "-fPIC",
               str(KERNELS_DIR / "host_emulation.cc"), "-o", str(target)]
    else:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise RuntimeError("nvcc not found on PATH: cannot build the CUDA kernels")
        import jax.ffi  # only for the XLA FFI headers
        target = out / LIBRARY_NAME
        cmd = [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC,-Wno-return-type",
               "-diag-suppress", "940,2473", *GENCODE, "-I", jax.ffi.include_dir(),
               str(KERNELS_DIR / "batched_copy.cu"), "-o", str(target)]
    subprocess.run(cmd, check=True)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = Path(os.environ.get("HYBRID_KERNELS_LIB", BUILD_DIR / LIBRARY_NAME))
    if not path.exists():
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # e.g. no CUDA runtime on this machine
        return None
    lib.hybrid_batched_copy.restype = ctypes.c_int
    lib.hybrid_batched_copy.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_double, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether the CUDA kernels can run here: the library is built and loads, and torch sees a GPU.

    >>> isinstance(available(), bool)
    True
    """
    if _library() is None:
        return False
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def resolve_backend(backend: str | None, *, on_cuda: bool) -> str:
    """Which copy path a call takes: ``"cuda"`` (the kernels) or ``"reference"``.

    ``backend`` is ``"auto"``, ``"cuda"``, ``"reference"`` or None (``$HYBRID_KERNELS``, else
    ``"auto"``); ``on_cuda`` says whether the tensors live on a CUDA device. ``auto`` picks the
    kernels when they can run; a forced ``cuda`` that cannot run raises ``RuntimeError`` saying why.

    >>> resolve_backend("auto", on_cuda=False)
    'reference'
    >>> resolve_backend("reference", on_cuda=True)
    'reference'
    """
    chosen = backend if backend is not None else os.environ.get("HYBRID_KERNELS", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {chosen!r}")
    if chosen == "reference":
        return "reference"
    ok = on_cuda and _library() is not None
    if chosen == "cuda" and not ok:
        raise RuntimeError("backend 'cuda' forced but the kernels cannot run: "
                           + ("the tensors are not on a CUDA device" if not on_cuda else
                              f"no library at {BUILD_DIR / LIBRARY_NAME} (run python -m hybrid.kernels build)"))
    return "cuda" if ok else "reference"


def _check_cast(src: str, dst: str, scale: float | None) -> None:
    if src == dst and scale is None:
        return
    if src == dst == "float64" or (src in _FLOATS and dst in _FLOATS):
        return
    raise ValueError(f"batched copy casts and scales only float32/float16/bfloat16 (and scales "
                     f"float64 in place), got {src} -> {dst}" + ("" if scale is None else f" scale={scale}"))


def _launch(srcs: Sequence[int], dsts: Sequence[int], numels: Sequence[int], src: str, dst: str,
            raw_itemsize: int, scale: float | None, stream: int) -> int:
    lib = _library()
    s, d, n = (np.asarray(srcs, np.uint64), np.asarray(dsts, np.uint64), np.asarray(numels, np.int64))
    rc = lib.hybrid_batched_copy(len(n), s.ctypes.data, d.ctypes.data, n.ctypes.data,
                                 _CODES.get(src, 0), _CODES.get(dst, 0), raw_itemsize,
                                 int(scale is not None), 1.0 if scale is None else float(scale), stream)
    if rc < 0:
        raise RuntimeError(f"hybrid_batched_copy failed with code {rc}")
    return rc


# ---- torch ------------------------------------------------------------------------------------

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


def gather_copies(src_ptrs: Sequence[int], numels: Sequence[int], offsets: Sequence[int], out_ptr: int,
                  length: int, out_itemsize: int) -> tuple[list[int], list[int], list[int]]:
    """The (src, dst, numel) copy list of a gather; src 0 means "write zeros" (gaps, padding)."""
    srcs, dsts, ns, end = [], [], [], 0
    for p, n, o in zip(src_ptrs, numels, offsets):
        if o > end:
            srcs.append(0), dsts.append(out_ptr + end * out_itemsize), ns.append(o - end)
        srcs.append(p), dsts.append(out_ptr + o * out_itemsize), ns.append(n)
        end = o + n
    if length > end:
        srcs.append(0), dsts.append(out_ptr + end * out_itemsize), ns.append(length - end)
    return srcs, dsts, ns


def scatter_copies(flat_ptr: int, flat_itemsize: int, offsets: Sequence[int], dst_ptrs: Sequence[int],
                   numels: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """The (src, dst, numel) copy list of a scatter."""
    return [flat_ptr + o * flat_itemsize for o in offsets], list(dst_ptrs), list(numels)


def _torch_gather_cuda(tensors, out, offsets, scale) -> None:
    import torch
    tensors = [t.contiguous() for t in tensors]  # keeps the copies alive until the launch is queued
    src = canonical_dtype(tensors[0].dtype) if tensors else canonical_dtype(out.dtype)
    copies = gather_copies([t.data_ptr() for t in tensors], [t.numel() for t in tensors], offsets,
                           out.data_ptr(), out.numel(), out.element_size())
    _launch(*copies, src, canonical_dtype(out.dtype), out.element_size(), scale,
            torch.cuda.current_stream(out.device).cuda_stream)


def _torch_scatter_cuda(flat, outs, offsets, scale) -> None:
    import torch
    dst = canonical_dtype(outs[0].dtype) if outs else canonical_dtype(flat.dtype)
    copies = scatter_copies(flat.data_ptr(), flat.element_size(), offsets, [t.data_ptr() for t in outs],
                            [t.numel() for t in outs])
    _launch(*copies, canonical_dtype(flat.dtype), dst, flat.element_size(), scale,
            torch.cuda.current_stream(flat.device).cuda_stream)


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


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    return canonical_dtype(dtype)


def _members(plan: BucketPlan, bucket_index: int, tensors: Sequence, what: str) -> list:
    if not 0 <= bucket_index < len(plan.buckets):
        raise ValueError(f"bucket_index {bucket_index} out of range for {len(plan.buckets)} buckets")
    if len(tensors) != len(plan.specs):
        raise ValueError(f"{what} needs one tensor per spec ({len(plan.specs)}), got {len(tensors)}")
    bucket = plan.buckets[bucket_index]
    out = []
    for m in bucket.members:
        spec, t = plan.specs[m], tensors[m]
        if tuple(t.shape) != spec.shape or _dtype_name(t.dtype) != spec.dtype:
            raise ValueError(f"tensor {spec.name!r}: expected {spec.dtype}{list(spec.shape)}, "
                             f"got {_dtype_name(t.dtype)}{list(t.shape)}")
        out.append(t)
    return out


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
    if resolve_backend(backend, on_cuda=on_cuda) == "reference":
        if out is None:
            out = torch.empty(bucket.length, dtype=dtype, device=members[0].device)
        _torch_gather_reference(members, out, list(bucket.offsets), scale)
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
    else:
        scatter_bucket_(flat, outs, list(bucket.offsets), scale)
    return dict(zip(bucket.members, outs))


# ---- JAX --------------------------------------------------------------------------------------

@functools.cache
def _register_ffi() -> None:
    import jax
    lib = _library()
    jax.ffi.register_ffi_target("hybrid_gather", jax.ffi.pycapsule(lib.HybridGather), platform="CUDA")
    jax.ffi.register_ffi_target("hybrid_scatter", jax.ffi.pycapsule(lib.HybridScatter), platform="CUDA")


def resolve_jax_backend(backend: str | None) -> str:
    """:func:`resolve_backend` for JAX arrays: on CUDA when JAX's default backend is a GPU.

    >>> resolve_jax_backend("reference")
    'reference'
    """
    import jax
    return resolve_backend(backend, on_cuda=jax.default_backend() == "gpu")


def _jax_scaled(x, dtype, scale):
    import jax.numpy as jnp
    if scale is None:
        return x.astype(dtype)
    compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return (x.astype(compute) * jnp.asarray(scale, compute)).astype(dtype)


def jax_gather(plan: BucketPlan, bucket_index: int, arrays: Sequence, *, scale: float | None = None,
               out_dtype=None, backend: str | None = None):
    """:func:`gather` for JAX arrays (usable under ``jit``): the XLA FFI kernel on GPU, else
    ``jnp.concatenate``.

    >>> import jax.numpy as jnp
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> jax_gather(plan, 0, [jnp.ones(2), jnp.full((1, 2), 3.0)], out_dtype="bfloat16").tolist()
    [1.0, 1.0, 3.0, 3.0]
    """
    import jax
    import jax.numpy as jnp
    members = _members(plan, bucket_index, arrays, "jax_gather")
    bucket = plan.buckets[bucket_index]
    dtype = jnp.dtype(members[0].dtype if out_dtype is None else out_dtype)
    _check_cast(bucket.dtype, canonical_dtype(dtype), scale)
    if resolve_jax_backend(backend) == "cuda":
        _register_ffi()
        call = jax.ffi.ffi_call("hybrid_gather", jax.ShapeDtypeStruct((bucket.length,), dtype))
        return call(*members, offsets=np.asarray(bucket.offsets, np.int64),
                    scale=np.float64(1.0 if scale is None else scale), has_scale=np.int32(scale is not None))
    parts, end = [], 0
    for a, o in zip(members, bucket.offsets):
        if o > end:
            parts.append(jnp.zeros(o - end, dtype))
        parts.append(_jax_scaled(a.reshape(-1), dtype, scale))
        end = o + a.size
    if bucket.length > end:
        parts.append(jnp.zeros(bucket.length - end, dtype))
    return jnp.concatenate(parts)


def jax_scatter(plan: BucketPlan, bucket_index: int, flat, *, scale: float | None = None, out_dtype=None,
                backend: str | None = None) -> dict[int, object]:
    """:func:`scatter` for JAX arrays: ``{spec_index: array}`` of the specs' shapes.

    >>> import jax.numpy as jnp
    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("a", (2,), "float32"), TensorSpec("b", (1, 2), "float32")])
    >>> {k: v.tolist() for k, v in jax_scatter(plan, 0, jnp.arange(4.0), scale=2.0).items()}
    {0: [0.0, 2.0], 1: [[4.0, 6.0]]}
    """
    import jax
    import jax.numpy as jnp
    if not 0 <= bucket_index < len(plan.buckets):
        raise ValueError(f"bucket_index {bucket_index} out of range for {len(plan.buckets)} buckets")
    bucket = plan.buckets[bucket_index]
    if flat.ndim != 1 or flat.shape[0] < bucket.length:
        raise ValueError(f"bucket {bucket_index} needs a 1-D array of at least {bucket.length} elements, "
                         f"got shape {tuple(flat.shape)}")
    dtype = jnp.dtype(flat.dtype if out_dtype is None else out_dtype)
    _check_cast(canonical_dtype(flat.dtype), canonical_dtype(dtype), scale)
    shapes = [plan.specs[m].shape for m in bucket.members]
    if resolve_jax_backend(backend) == "cuda":
        _register_ffi()
        call = jax.ffi.ffi_call("hybrid_scatter", [jax.ShapeDtypeStruct(s, dtype) for s in shapes])
        outs = call(flat, offsets=np.asarray(bucket.offsets, np.int64),
                    scale=np.float64(1.0 if scale is None else scale), has_scale=np.int32(scale is not None))
        return dict(zip(bucket.members, outs))
    return {m: _jax_scaled(flat[o:o + n], dtype, scale).reshape(s)
            for m, o, n, s in zip(bucket.members, bucket.offsets, bucket.numels, shapes)}


def _main(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m hybrid.kernels")
    parser.add_argument("command", choices=("build",))
    parser.add_argument("--build-dir", default=None, help=f"default {BUILD_DIR}")
    parser.add_argument("--host", action="store_true", help="build the host emulation instead")
    args = parser.parse_args(argv)
    print(build(args.build_dir, host=args.host))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
