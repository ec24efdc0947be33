"""The kernels' launch tables and per-block copy body, compiled for the host, against numpy.

kernels/host_emulation.cc runs exactly the table builder and ``hb_run_block`` that the CUDA
kernel runs (kernels/batched_copy.cuh), one emulated thread after another. Every comparison is
bit for bit: a copy is exact, and a cast or scale is one IEEE float32 multiply followed by one
round-to-nearest-even, which numpy and ml_dtypes do identically.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from hybrid import kernels
from hybrid.core import TensorSpec, pack, plan_buckets
from hybrid.kernels._tables import count_launches

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
      "float64": np.float64, "int64": np.int64, "int8": np.int8, "uint8": np.uint8, "int32": np.int32}
CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4}
MAX_SEGS = 128  # HB_MAX_SEGS in batched_copy.cuh
EMULATED_THREADS = 7  # odd, so that the grid-stride arithmetic is exercised off powers of two


def run(lib, copies, src, dst, itemsize, scale):
    srcs, dsts, numels = (np.asarray(c, t) for c, t in zip(copies, (np.uint64, np.uint64, np.int64)))
    return lib.hybrid_batched_copy_host(len(numels), srcs.ctypes.data, dsts.ctypes.data, numels.ctypes.data,
                                        CODES.get(src, 0), CODES.get(dst, 0), itemsize,
                                        int(scale is not None), 1.0 if scale is None else scale,
                                        EMULATED_THREADS)


def reference_cast(x, dst, scale):
    """numpy oracle of the kernels' cast and scale semantics."""
    if scale is None:
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(NP[dst])
    compute = np.float64 if x.dtype == np.float64 else np.float32
    with np.errstate(over="ignore"):  # float16 overflow to inf is part of the semantics
        return (x.astype(compute) * compute(scale)).astype(NP[dst])


def random_values(rng, n, dtype):
    if dtype in ("int64", "int8", "uint8", "int32"):
        info = np.iinfo(NP[dtype])
        return rng.integers(info.min, info.max, size=n, dtype=NP[dtype], endpoint=True)
    # wide dynamic range, so casts hit overflow, subnormals and ties
    x = rng.standard_normal(n) * np.exp2(rng.integers(-30, 20, size=n))
    with np.errstate(over="ignore"):  # some overflow to inf in float16, on purpose
        return x.astype(NP[dtype])


def misaligned(rng, n, dtype, shift):
    """An array of ``n`` elements whose address is ``shift`` elements past a 64-byte boundary."""
    size = np.dtype(NP[dtype]).itemsize
    raw = np.empty((n + shift) * size + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift * size
    a = raw[start:start + n * size].view(NP[dtype])
    a[...] = random_values(rng, n, dtype)
    return a


def random_layout(rng, num_tensors, max_numel):
    sizes = rng.integers(0, max_numel + 1, size=num_tensors)
    sizes[rng.random(num_tensors) < 0.15] = 0  # empty tensors
    sizes[rng.random(num_tensors) < 0.3] |= 1  # odd sizes make odd offsets
    return [int(n) for n in sizes]


# (src dtype, bucket dtype, scale)
CASTS = [
    ("float32", "float32", None), ("float32", "float32", 0.125), ("float32", "float32", 1 / 3),
    ("float32", "bfloat16", None), ("float32", "bfloat16", 1 / 3), ("float32", "float16", None),
    ("float32", "float16", 1 / 7), ("bfloat16", "float32", None), ("bfloat16", "float32", 0.25),
    ("float16", "float32", 1 / 3), ("bfloat16", "bfloat16", 1 / 3), ("float16", "float16", 0.5),
    ("bfloat16", "float16", None), ("float16", "bfloat16", None), ("float64", "float64", 1 / 3),
    ("float64", "float64", None), ("int64", "int64", None), ("int8", "int8", None),
]
# (seed, number of tensors, largest numel, alignment, element shift of the sources)
LAYOUTS = [
    (0, 1, 0, 1, 0), (1, 5, 10, 1, 1), (2, 40, 3000, 1, 3), (3, 7, 100_000, 4, 1),
    (4, 300, 50, 1, 0), (7, 260, 2000, 2, 5),
]
# 10^6-element tensors (several launches' worth of blocks), on a subset of the casts for speed
BIG_LAYOUTS = [(5, 3, 1_000_000, 1, 1), (6, 2, 1_000_000, 16, 0)]
BIG_CASES = [(c, l) for c in CASTS[:6] + CASTS[-3:] for l in BIG_LAYOUTS]


def make_plan(sizes, dtype, alignment):
    specs = [TensorSpec(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]
    # one bucket holding everything, so one call sees all layouts at once
    return plan_buckets(specs, bucket_cap_bytes=1 << 40, first_bucket_cap_bytes=1 << 40, alignment=alignment)


def expected_launches(copies, src, dst, itemsize, scale):
    """The launches hybrid.kernels._tables counts for this call (what the projection of
    ``bench pack --project`` uses): held equal to what the emulated table builder does."""
    srcs, _, numels = copies
    convert = src != dst or scale is not None
    return count_launches([n * itemsize for n in numels], convert_itemsize=itemsize if convert else None,
                          zero_fills=[p == 0 for p in srcs]).launches


@pytest.mark.parametrize("cast,layout", [(c, l) for c in CASTS for l in LAYOUTS] + BIG_CASES)
def test_gather_matches_numpy(host_lib, cast, layout):
    (src, dst, scale), (seed, num_tensors, max_numel, alignment, shift) = cast, layout
    rng = np.random.default_rng(seed)
    sizes = random_layout(rng, num_tensors, max_numel)
    plan = make_plan(sizes, src, alignment)
    bucket = plan.buckets[0]
    arrays = [misaligned(rng, n, src, shift) for n in sizes]
    want = reference_cast(pack(plan, 0, arrays), dst, scale)
    out = np.full(bucket.length, 7, NP[dst])  # garbage where zeros are due
    members = [arrays[m] for m in bucket.members]
    copies = kernels.gather_copies([a.ctypes.data for a in members], [a.size for a in members],
                                   bucket.offsets, out.ctypes.data, bucket.length, out.itemsize)
    launches = run(host_lib, copies, src, dst, out.itemsize, scale)
    assert launches == expected_launches(copies, src, dst, out.itemsize, scale)
    assert launches >= math.ceil(sum(1 for n in copies[2] if n) / MAX_SEGS)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("cast,layout", [(c, l) for c in CASTS for l in LAYOUTS] + BIG_CASES[:3])
def test_scatter_matches_numpy(host_lib, cast, layout):
    (src, dst, scale), (seed, num_tensors, max_numel, alignment, shift) = cast, layout
    rng = np.random.default_rng(seed + 100)
    sizes = random_layout(rng, num_tensors, max_numel)
    plan = make_plan(sizes, src, alignment)
    bucket = plan.buckets[0]
    flat = misaligned(rng, bucket.length, src, shift)
    outs = {m: np.full(plan.specs[m].numel, 7, NP[dst]) for m in bucket.members}
    copies = kernels.scatter_copies(flat.ctypes.data, flat.itemsize, bucket.offsets,
                                    [outs[m].ctypes.data for m in bucket.members],
                                    [plan.specs[m].numel for m in bucket.members])
    launches = run(host_lib, copies, src, dst, flat.itemsize, scale)
    assert launches == expected_launches(copies, src, dst, np.dtype(NP[dst]).itemsize, scale)
    assert launches >= math.ceil(sum(1 for n in copies[2] if n) / MAX_SEGS)
    for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels):
        np.testing.assert_array_equal(outs[m].view(np.uint8), reference_cast(flat[o:o + n], dst, scale).view(np.uint8))


@pytest.mark.parametrize("byte_shift", [0, 1, 2, 3, 4, 8, 12, 15])
@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 17, 16383, 16384, 16385, 100_003])
def test_raw_copy_every_alignment(host_lib, byte_shift, nbytes):
    """The vector width comes from pointer alignment (16/8/4/2/1 bytes); every head and tail case."""
    rng = np.random.default_rng(nbytes + byte_shift)
    src_raw = rng.integers(0, 256, nbytes + 64, dtype=np.uint8)
    dst_raw = np.zeros(nbytes + 64, np.uint8)
    s = (-src_raw.ctypes.data) % 16 + byte_shift
    d = (-dst_raw.ctypes.data) % 16 + (byte_shift * 3) % 16  # src and dst differently misaligned
    launches = run(host_lib, ([src_raw.ctypes.data + s], [dst_raw.ctypes.data + d], [nbytes]), "uint8",
                   "uint8", 1, None)
    assert launches == (1 if nbytes else 0)
    np.testing.assert_array_equal(dst_raw[d:d + nbytes], src_raw[s:s + nbytes])
    assert not dst_raw[:d].any() and not dst_raw[d + nbytes:].any()  # nothing written outside


def all_bits(dtype):
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(NP[dtype])


def f32_probe_values(rng):
    """float32 bit patterns covering every exponent, ties, subnormals, infinities."""
    bits = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000  # exact bf16 ties
    f16_ties = (np.arange(0x33000000, 0x47800000, 0x1000, dtype=np.uint32)) | 0x1000  # near f16 ties
    specials = np.array([0, 0x80000000, 0x7f800000, 0xff800000, 0x477fefff, 0x477ff000, 0x33000000,
                         0x33000001, 0x387fffff, 0x38800000, 0x00000001, 0x7f7fffff], np.uint32)
    x = np.concatenate([bits, ties, f16_ties, specials]).view(np.float32)
    return x[~np.isnan(x)]


@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
                                     ("float16", "float32"), ("bfloat16", "float16"), ("float16", "bfloat16")])
def test_casts_bit_exact(host_lib, src, dst):
    """Round to nearest even like ml_dtypes/numpy (and torch), over all 16-bit inputs."""
    x = f32_probe_values(np.random.default_rng(0)) if src == "float32" else all_bits(src)
    out = np.empty(x.size, NP[dst])
    run(host_lib, ([x.ctypes.data], [out.ctypes.data], [x.size]), src, dst, 0, None)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are expected results
        want = x.astype(np.float32).astype(NP[dst])
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32)), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint16 if out.itemsize == 2 else np.uint32),
                                  want[~nan].view(np.uint16 if out.itemsize == 2 else np.uint32))


@pytest.mark.parametrize("src,dst", [("float32", "int32"), ("int32", "float32"), ("float64", "float32"),
                                     ("float32", "float64")])
def test_unsupported_casts_refused(host_lib, src, dst):
    a, b = np.zeros(4, NP[src]), np.zeros(4, NP[dst])
    assert run(host_lib, ([a.ctypes.data], [b.ctypes.data], [4]), src, dst, 4, None) == -1
