"""Build, load and launch the CUDA library: paths, ``build()``, the lazily loaded C ABI, and the
backend choice every call makes."""

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

from hybrid.kernels._copies import CODES

KERNELS_DIR = Path(__file__).resolve().parent.parent.parent / "kernels"
BUILD_DIR = KERNELS_DIR / "build"
LIBRARY_NAME = "libhybrid_kernels.so"
GENCODE = ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90")
# device-code flags shared by the library build and the resource inspection (same code, same registers)
NVCC_FLAGS = ("-std=c++17", "-O3", "-diag-suppress", "940,2473")
BACKENDS = ("auto", "cuda", "reference")


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
        cmd = [nvcc, *NVCC_FLAGS, "-shared", "-Xcompiler", "-fPIC,-Wno-return-type", *GENCODE,
               "-I", jax.ffi.include_dir(),
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


def launch(srcs: Sequence[int], dsts: Sequence[int], numels: Sequence[int], src: str, dst: str,
            raw_itemsize: int, scale: float | None, stream: int) -> int:
    lib = _library()
    s, d, n = (np.asarray(srcs, np.uint64), np.asarray(dsts, np.uint64), np.asarray(numels, np.int64))
    rc = lib.hybrid_batched_copy(len(n), s.ctypes.data, d.ctypes.data, n.ctypes.data,
                                 CODES.get(src, 0), CODES.get(dst, 0), raw_itemsize,
                                 int(scale is not None), 1.0 if scale is None else float(scale), stream)
    if rc < 0:
        raise RuntimeError(f"hybrid_batched_copy failed with code {rc}")
    return rc
