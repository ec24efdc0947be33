"""Hypothesis strategies for TensorSpec lists."""

import functools

from hypothesis import strategies as st

from hybrid.core import TensorSpec

TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
                "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                "uint16", "uint32", "uint64"]
DEVICES = ["cpu", "meta"]  # the two devices a CPU-only torch can hold tensors on


@st.composite
def spec_lists(draw, *, min_size=1, max_size=40, max_numel=300, keys=None, sparse=True):
    """Lists of uniquely named specs over a drawn set of (dtype, device) keys."""
    if keys is None:
        keys = draw(st.lists(st.tuples(st.sampled_from(TORCH_DTYPES), st.sampled_from(DEVICES)),
                             min_size=1, max_size=16))
    n = draw(st.integers(min_size, max_size))
    specs = []
    for i in range(n):
        dtype, device = draw(st.sampled_from(keys))
        shape = draw(_shapes(max_numel))
        is_sparse = sparse and draw(st.integers(0, 9)) == 0
        specs.append(TensorSpec(f"t{i}", tuple(shape), dtype, device, is_sparse))
    return specs


@functools.cache
def _shapes(max_numel):
    """Shapes of at most ``max_numel`` elements: one strategy object per bound, drawn from again and
    again (a new ``.filter(lambda ...)`` per draw made hypothesis parse and compile the lambda's
    source each time, most of these tests' time)."""
    return st.lists(st.integers(0, 12), min_size=0, max_size=3).filter(lambda s: _prod(s) <= max_numel)


def _prod(shape):
    out = 1
    for d in shape:
        out *= d
    return out
