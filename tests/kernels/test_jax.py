"""JAX side: jax_gather / jax_scatter (reference path on CPU) against core.pack with numpy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hybrid import kernels
from hybrid.core import TensorSpec, pack, plan_buckets

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float64": np.float32}


def reference(flat, dst, scale):
    if scale is not None:
        flat = flat.astype(np.float32) * np.float32(scale)
    return flat.astype(NP[dst])


CASES = [("float32", None, None), ("float32", "bfloat16", 0.125), ("float32", "float16", 1 / 3),
         ("bfloat16", "float32", 0.5), ("bfloat16", None, 1 / 3)]


@pytest.mark.parametrize("dtype,out_dtype,scale", CASES)
@pytest.mark.parametrize("jit", [False, True])
def test_gather_scatter_match_numpy(dtype, out_dtype, scale, jit):
    rng = np.random.default_rng(0)
    sizes = [(3,), (0,), (5, 7), (1,), (64, 3), (1000,)]
    specs = [TensorSpec(f"p{i}", s, dtype) for i, s in enumerate(sizes)]
    plan = plan_buckets(specs, bucket_cap_bytes=2048, first_bucket_cap_bytes=256, alignment=4)
    host = [(rng.standard_normal(s) * 37).astype(NP[dtype]) for s in sizes]
    arrays = [jnp.asarray(a) for a in host]
    dst = out_dtype or dtype
    for b in range(len(plan.buckets)):
        g = lambda xs: kernels.jax_gather(plan, b, xs, scale=scale, out_dtype=out_dtype)
        s = lambda f: kernels.jax_scatter(plan, b, f, scale=scale, out_dtype=dtype)
        if jit:
            g, s = jax.jit(g), jax.jit(s)
        flat = g(arrays)
        # bit for bit: one float32 multiply and one round to nearest even on both sides
        np.testing.assert_array_equal(np.asarray(flat), reference(pack(plan, b, host), dst, scale))
        back = s(flat)
        assert sorted(back) == sorted(plan.buckets[b].members)
        for m, a in back.items():
            o = plan.buckets[b].offsets[plan.buckets[b].members.index(m)]
            want = reference(np.asarray(flat)[o:o + a.size], dtype, scale).reshape(plan.specs[m].shape)
            np.testing.assert_array_equal(np.asarray(a), want)


def test_forced_cuda_fails_without_gpu():
    plan = plan_buckets([TensorSpec("a", (2,), "float32")])
    with pytest.raises(RuntimeError, match="cuda"):
        kernels.jax_gather(plan, 0, [jnp.ones(2)], backend="cuda")


def test_bad_cast():
    plan = plan_buckets([TensorSpec("a", (2,), "float32")])
    with pytest.raises(ValueError, match="int32"):
        kernels.jax_gather(plan, 0, [jnp.ones(2)], out_dtype="int32")
