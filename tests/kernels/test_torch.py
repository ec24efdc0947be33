"""torch side: gather/scatter (reference path on CPU) against core.pack, and the custom ops' opcheck."""

import pytest
import torch

from hybrid import kernels
from hybrid.kernels import _torch as kernels_torch
from hybrid.core import TensorSpec, pack, plan_buckets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64}


def make(seed, sizes, dtype, alignment=1):
    g = torch.Generator().manual_seed(seed)
    specs = [TensorSpec(f"p{i}", s, dtype) for i, s in enumerate(sizes)]
    plan = plan_buckets(specs, bucket_cap_bytes=4096, first_bucket_cap_bytes=256, alignment=alignment)
    if dtype == "int64":
        tensors = [torch.randint(-1000, 1000, s, generator=g) for s in sizes]
    else:
        tensors = [(torch.randn(s, generator=g, dtype=torch.float64) * 37).to(DTYPES[dtype]) for s in sizes]
    return plan, tensors


def reference(flat, dst, scale):
    """The kernels' semantics composed from plain torch ops: one float32 multiply, one rounding."""
    if scale is not None:
        flat = flat.to(torch.float64 if flat.dtype == torch.float64 else torch.float32) * scale
    return flat.to(DTYPES[dst])


SIZES = [[(3,), (0,), (), (5, 7), (1,), (64, 3), (1000,), (2, 2, 3)], [(1,)] * 150, [(0,), (0,)] + [(300, 5)] * 4]
CASES = [("float32", None, None), ("float32", None, 0.25), ("float32", "bfloat16", 1 / 3),
         ("float32", "float16", None), ("bfloat16", "float32", 0.5), ("bfloat16", None, 1 / 3),
         ("float64", None, 1 / 3), ("int64", None, None)]


@pytest.mark.parametrize("dtype,out_dtype,scale", CASES)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("alignment", [1, 8])
def test_gather_scatter_match_core_pack(dtype, out_dtype, scale, sizes, alignment):
    plan, tensors = make(len(sizes), sizes, dtype, alignment)
    dst = out_dtype or dtype
    for b in range(len(plan.buckets)):
        # bit for bit: same ops, same single rounding as the oracle
        flat = kernels.gather(plan, b, tensors, scale=scale, out_dtype=DTYPES.get(out_dtype))
        torch.testing.assert_close(flat, reference(pack(plan, b, tensors), dst, scale), rtol=0, atol=0)
        back = kernels.scatter(plan, b, flat, scale=None if scale is None else 1 / scale, out_dtype=DTYPES[dtype])
        assert sorted(back) == sorted(plan.buckets[b].members)
        for m, t in back.items():
            o = plan.buckets[b].offsets[plan.buckets[b].members.index(m)]
            want = reference(flat[o:o + t.numel()], dtype, None if scale is None else 1 / scale)
            torch.testing.assert_close(t, want.view(plan.specs[m].shape), rtol=0, atol=0)


def test_gather_into_out_and_scatter_into_tensors():
    plan, tensors = make(0, [(4,), (3, 3), (5,)], "float32")
    out = torch.full((plan.buckets[0].length + 3,), 9.0)
    assert kernels.gather(plan, 0, tensors, out) is out
    n = plan.buckets[0].length
    torch.testing.assert_close(out[:n], pack(plan, 0, tensors), rtol=0, atol=0)
    targets = [torch.empty_like(t) for t in tensors]
    got = kernels.scatter(plan, 0, out * 2, targets)
    for m, t in got.items():
        assert t is targets[m]
        torch.testing.assert_close(t, tensors[m] * 2, rtol=0, atol=0)


def test_gather_leaves_inputs_alone():
    plan, tensors = make(1, [(8,), (8,)], "float32")
    before = [t.clone() for t in tensors]
    kernels.gather(plan, 0, tensors, scale=0.5)
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, b, rtol=0, atol=0)


@pytest.mark.parametrize("call,error", [
    (lambda p, t: kernels.gather(p, 0, t[:1]), ValueError),
    (lambda p, t: kernels.gather(p, 5, t), ValueError),
    (lambda p, t: kernels.gather(p, 0, t, out_dtype=torch.int32), ValueError),
    (lambda p, t: kernels.gather(p, 0, t, out=torch.empty(2)), ValueError),
    (lambda p, t: kernels.gather(p, 0, [x.double() for x in t]), ValueError),
    (lambda p, t: kernels.gather(p, 0, t, backend="fast"), ValueError),
    (lambda p, t: kernels.gather(p, 0, t, backend="cuda"), RuntimeError),  # CPU tensors
    (lambda p, t: kernels.scatter(p, 0, torch.zeros(3)), ValueError),
    (lambda p, t: kernels.scatter(p, 0, torch.zeros(24), [x.t() for x in t]), ValueError),
])
def test_bad_input(call, error):
    plan, tensors = make(2, [(3, 4), (4, 3)], "float32")
    with pytest.raises(error):
        call(plan, tensors)


def test_env_var_forces_backend(monkeypatch):
    plan, tensors = make(3, [(3,)], "float32")
    monkeypatch.setenv("HYBRID_KERNELS", "cuda")
    with pytest.raises(RuntimeError, match="cuda"):
        kernels.gather(plan, 0, tensors)
    monkeypatch.setenv("HYBRID_KERNELS", "reference")
    torch.testing.assert_close(kernels.gather(plan, 0, tensors), tensors[0], rtol=0, atol=0)
    monkeypatch.setenv("HYBRID_KERNELS", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        kernels.gather(plan, 0, tensors)


def _opcheck_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(dtype) for s in [(3,), (2, 4), (5,)]]
    return tensors, [0, 4, 12], 20


@pytest.mark.parametrize("dtype,out_dtype,scale", [(torch.float32, torch.float32, None),
                                                    (torch.float32, torch.bfloat16, 0.5),
                                                    (torch.bfloat16, torch.float32, None)])
def test_opcheck(dtype, out_dtype, scale):
    gather_bucket, gather_bucket_, scatter_bucket_ = kernels_torch._torch_ops()
    tensors, offsets, length = _opcheck_inputs(dtype)
    torch.library.opcheck(gather_bucket, (tensors, offsets, length, scale, out_dtype))
    torch.library.opcheck(gather_bucket_, (tensors, torch.empty(length, dtype=out_dtype), offsets, scale))
    outs = [torch.empty_like(t, dtype=dtype) for t in tensors]
    torch.library.opcheck(scatter_bucket_, (torch.randn(length).to(out_dtype), outs, offsets, scale))


def test_gather_op_under_torch_compile():
    gather_bucket, _, _ = kernels_torch._torch_ops()
    tensors, offsets, length = _opcheck_inputs(torch.float32)
    compiled = torch.compile(lambda ts: gather_bucket(ts, offsets, length, 2.0, torch.float32), backend="eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(tensors), gather_bucket(tensors, offsets, length, 2.0, torch.float32),
                               rtol=0, atol=0)


@pytest.mark.parametrize("threaded_from", [0, 16, 1 << 30])
@pytest.mark.parametrize("alignment", [1, 8])
def test_plain_cpu_copies_match_core_pack_on_both_sides_of_the_threading_cut(monkeypatch, threaded_from, alignment):
    # Large tensors copy through torch (threaded), small ones through numpy: with the cut moved,
    # every member takes one branch or the other, gaps and padding still zeros, bit for bit.
    monkeypatch.setattr(kernels_torch, "_THREADED_COPY_NUMEL", threaded_from)
    plan, tensors = make(7, [(3,), (40,), (0,), (5, 7), (17,), (2, 33)], "float32", alignment)
    for b in range(len(plan.buckets)):
        out = torch.full((plan.buckets[b].length,), float("nan"))
        kernels.gather(plan, b, tensors, out, backend="reference")
        torch.testing.assert_close(out, pack(plan, b, tensors), rtol=0, atol=0)
        dests = [torch.full_like(t, float("nan")) for t in tensors]
        kernels.scatter(plan, b, out, dests, backend="reference")
        for m in plan.buckets[b].members:
            assert torch.equal(dests[m], tensors[m]), plan.specs[m].name
