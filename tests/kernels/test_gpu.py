"""On a GPU: the CUDA kernels against the reference path bit for bit, and both bindings end to end.

Skipped, with the reason, where there is no GPU (this project's machines) or no nvcc to build.
"""

import shutil

import numpy as np
import pytest
import torch

from hybrid import kernels
from hybrid.kernels import _build
from hybrid.core import TensorSpec, plan_buckets

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot build the kernels"),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64}


@pytest.fixture(scope="module", autouse=True)
def cuda_library(cuda_library_path):
    path = cuda_library_path  # built once per session (conftest.py), shared with test_compile.py
    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRID_KERNELS_LIB", str(path))
    _build._library.cache_clear()
    yield path
    mp.undo()
    _build._library.cache_clear()


LAYOUTS = [[(3,), (0,), (5, 7), (1,), (64, 3), (1000,)], [(1,)] * 3000, [(1_000_003,), (7,), (4_000_000,)]]
CASES = [("float32", None, None), ("float32", None, 0.25), ("float32", "bfloat16", 1 / 3),
         ("float32", "float16", None), ("bfloat16", "float32", 0.5), ("float16", None, 1 / 3),
         ("float64", None, 1 / 3), ("int64", None, None)]


@pytest.mark.parametrize("dtype,out_dtype,scale", CASES)
@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("alignment", [1, 8])
def test_kernels_match_reference_bitwise(dtype, out_dtype, scale, sizes, alignment):
    g = torch.Generator(device="cuda").manual_seed(0)
    specs = [TensorSpec(f"p{i}", s, dtype) for i, s in enumerate(sizes)]
    plan = plan_buckets(specs, alignment=alignment)
    if dtype == "int64":
        tensors = [torch.randint(-9, 9, s, generator=g, device="cuda") for s in sizes]
    else:
        tensors = [torch.randn(s, generator=g, device="cuda", dtype=torch.float64).mul(37).to(DTYPES[dtype])
                   for s in sizes]
    od = DTYPES.get(out_dtype)
    for b in range(len(plan.buckets)):
        got = kernels.gather(plan, b, tensors, scale=scale, out_dtype=od, backend="cuda")
        want = kernels.gather(plan, b, tensors, scale=scale, out_dtype=od, backend="reference")
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        back = kernels.scatter(plan, b, got, scale=scale, out_dtype=DTYPES[dtype], backend="cuda")
        ref = kernels.scatter(plan, b, got, scale=scale, out_dtype=DTYPES[dtype], backend="reference")
        for m in back:
            assert torch.equal(back[m].view(torch.uint8), ref[m].view(torch.uint8))


def test_auto_picks_kernels_and_op_runs_on_cuda():
    plan = plan_buckets([TensorSpec("a", (5,), "float32"), TensorSpec("b", (3,), "float32")])
    tensors = [torch.arange(5.0, device="cuda"), torch.ones(3, device="cuda")]
    assert kernels.available()
    flat = kernels.gather(plan, 0, tensors, scale=2.0)
    torch.cuda.synchronize()
    assert flat.device.type == "cuda"
    torch.testing.assert_close(flat.cpu(), kernels.gather(plan, 0, [t.cpu() for t in tensors], scale=2.0),
                               rtol=0, atol=0)


def test_jax_ffi_end_to_end():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("jax has no GPU backend here (the tests pin JAX_PLATFORMS=cpu unless overridden)")
    import jax.numpy as jnp
    plan = plan_buckets([TensorSpec(f"p{i}", (n,), "float32") for i, n in enumerate([3, 0, 1000, 7])],
                        alignment=4)
    arrays = [jnp.arange(n, dtype=jnp.float32) / 7 for n in [3, 0, 1000, 7]]
    for b in range(len(plan.buckets)):
        got = jax.jit(lambda xs: kernels.jax_gather(plan, b, xs, scale=0.5, out_dtype="bfloat16", backend="cuda"))(arrays)
        want = kernels.jax_gather(plan, b, arrays, scale=0.5, out_dtype="bfloat16", backend="reference")
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
        back = kernels.jax_scatter(plan, b, got, out_dtype="float32", backend="cuda")
        ref = kernels.jax_scatter(plan, b, got, out_dtype="float32", backend="reference")
        for m in back:
            np.testing.assert_array_equal(np.asarray(back[m]), np.asarray(ref[m]))


def test_repeated_calls_follow_new_contents_and_new_storage():
    """The second and later calls reuse the prepared copy list (same addresses): they must still
    copy the tensors' current values, and a tensor moved to new storage must be read there."""
    plan = plan_buckets([TensorSpec(f"p{i}", (n,), "float32") for i, n in enumerate([5, 1000, 3])])
    tensors = [torch.randn(s.shape, device="cuda") for s in plan.specs]
    out = torch.empty(plan.buckets[0].length, device="cuda")
    for step in range(3):
        if step == 2:
            tensors[1] = torch.randn(1000, device="cuda")  # new storage
        for t in tensors:
            t.add_(1.0)
        got = kernels.gather(plan, 0, tensors, out, scale=0.5, backend="cuda").clone()
        want = kernels.gather(plan, 0, tensors, scale=0.5, backend="reference")
        assert torch.equal(got, want)
        back = [torch.empty_like(t) for t in tensors]
        kernels.scatter(plan, 0, got, back, backend="cuda")
        bucket = plan.buckets[0]
        for m, offset in zip(bucket.members, bucket.offsets):
            assert torch.equal(back[m], got[offset:offset + tensors[m].numel()])
