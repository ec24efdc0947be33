"""Fixtures of the kernel tests: the host emulation library and the CUDA library, each built once
per session (an nvcc build of the CUDA library is ~8 s: test_compile.py and test_gpu.py share one)."""

import ctypes
import shutil
import subprocess

import pytest

from hybrid import kernels


@pytest.fixture(scope="session")
def host_lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ on PATH: cannot build the host emulation of the kernels")
    try:
        path = kernels.build(tmp_path_factory.mktemp("host"), host=True)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"host emulation failed to compile: {e}")
    lib = ctypes.CDLL(str(path))
    lib.hybrid_batched_copy_host.restype = ctypes.c_int
    lib.hybrid_batched_copy_host.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_double, ctypes.c_int]
    return lib


@pytest.fixture(scope="session")
def cuda_library_path(tmp_path_factory):
    """The CUDA library (sm_80 and sm_90), built with nvcc once for every test that needs it."""
    return kernels.build(tmp_path_factory.mktemp("cuda"))
