"""The CUDA library compiles with nvcc for sm_80 and sm_90 and exports the C ABI and FFI handlers."""

import ctypes
import shutil
import struct
import subprocess

import pytest

from hybrid import kernels
from hybrid.kernels import _build, _jax

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile the CUDA kernels")


@pytest.fixture
def cuda_lib_path(cuda_library_path):
    return cuda_library_path  # built once per session (conftest.py)


def fatbin_cubin_archs(data: bytes) -> set[int]:
    """SM versions of the cubins in a library's embedded fatbinaries (cuobjdump is not installed
    here, so the fatbin headers are read directly: magic 0xBA55ED50, then entries whose kind 2 is
    an ELF cubin and whose arch sits 28 bytes into the entry header)."""
    magic, archs = struct.pack("<I", 0xBA55ED50), set()
    i = data.find(magic)
    while i != -1:
        _, header_size, fat_size = struct.unpack_from("<HHQ", data, i + 4)
        p, end = i + header_size, i + header_size + fat_size
        while p < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            if kind == 2:
                archs.add(struct.unpack_from("<I", data, p + 28)[0])
            p += entry_header + payload
        i = data.find(magic, end)
    return archs


@needs_nvcc
def test_builds_for_sm80_and_sm90(cuda_lib_path):
    assert fatbin_cubin_archs(cuda_lib_path.read_bytes()) == {80, 90}


@needs_nvcc
@pytest.mark.parametrize("symbol", ["hybrid_batched_copy", "HybridGather", "HybridScatter"])
def test_exports(cuda_lib_path, symbol):
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(cuda_lib_path)], capture_output=True, text=True,
                             check=True).stdout.split()
    assert symbol in symbols


@needs_nvcc
def test_loads_without_a_gpu(cuda_lib_path):
    # the CUDA runtime is linked statically: loading needs no GPU, only calling does
    lib = ctypes.CDLL(str(cuda_lib_path))
    assert lib.hybrid_batched_copy and lib.HybridGather


@needs_nvcc
@pytest.mark.parametrize("scale,out_dtype", [(None, None), (0.5, "bfloat16")])
def test_jax_ffi_targets_register_and_lower_for_cuda(cuda_lib_path, monkeypatch, scale, out_dtype):
    """Without a GPU the FFI call cannot run, but registration and cross-platform lowering can:
    the custom calls carry the attributes the handlers bind (offsets, scale, has_scale)."""
    import jax
    import jax.numpy as jnp
    from hybrid.core import TensorSpec, plan_buckets
    monkeypatch.setenv("HYBRID_KERNELS_LIB", str(cuda_lib_path))
    _build._library.cache_clear()
    monkeypatch.setattr(_jax, "resolve_jax_backend", lambda backend: "cuda")
    try:
        plan = plan_buckets([TensorSpec("a", (3,), "float32"), TensorSpec("b", (2, 2), "float32")], alignment=4)
        gather = jax.jit(lambda xs: kernels.jax_gather(plan, 0, xs, scale=scale, out_dtype=out_dtype))
        text = gather.trace([jnp.ones(3), jnp.ones((2, 2))]).lower(lowering_platforms=("cuda",)).as_text()
        call = next(line for line in text.splitlines() if "custom_call @hybrid_gather" in line)
        assert f"has_scale = {int(scale is not None)} : i32" in call
        assert "offsets = dense<[0, 4]> : tensor<2xi64>" in call
        assert call.endswith(f"-> tensor<8x{'bf16' if out_dtype else 'f32'}>")
        scatter = jax.jit(lambda f: kernels.jax_scatter(plan, 0, f, scale=scale))
        text = scatter.trace(jnp.ones(8)).lower(lowering_platforms=("cuda",)).as_text()
        call = next(line for line in text.splitlines() if "custom_call @hybrid_scatter" in line)
        assert call.endswith("-> (tensor<3xf32>, tensor<2x2xf32>)")
    finally:
        _build._library.cache_clear()
