"""compute_bucket_assignment_by_size against torch's own as the oracle.

Exact equality: both are integer algorithms over the same inputs; any difference is a bug.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import TensorSpec, compute_bucket_assignment_by_size

from .strategies import spec_lists

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def torch_assignment(specs, limits, tensor_indices=None):
    tensors = [torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=s.device) for s in specs]
    expect_sparse = [False] * len(specs)
    for i, s in enumerate(specs):  # torch looks the flag up by recorded index
        expect_sparse[tensor_indices[i] if tensor_indices else i] = s.sparse
    indices, limits_out = dist._compute_bucket_assignment_by_size(
        tensors, limits, expect_sparse, tensor_indices or [])
    return [list(b) for b in indices], list(limits_out)


@settings(max_examples=300, deadline=None)
@given(specs=spec_lists(), limits=st.lists(st.integers(0, 2000), min_size=1, max_size=4),
       data=st.data())
def test_matches_torch_on_random_inputs(specs, limits, data):
    indices = None
    if data.draw(st.booleans()):
        indices = data.draw(st.permutations(range(len(specs))))
    assert compute_bucket_assignment_by_size(specs, limits, indices) == torch_assignment(specs, limits, indices)


@settings(max_examples=50, deadline=None)
@given(specs=spec_lists(min_size=14, max_size=60, keys=None, sparse=False),
       data=st.data())
def test_matches_torch_with_many_keys_after_rehash(specs, data):
    # More than 13 distinct keys makes torch's unordered_map rehash: order must still match.
    indices = data.draw(st.permutations(range(len(specs))))
    assert compute_bucket_assignment_by_size(specs, [64, 512], indices) == torch_assignment(specs, [64, 512], indices)


def test_ddp_default_limits_on_a_real_model():
    model = torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(12)])
    specs = [TensorSpec(n, tuple(p.shape), "float32") for n, p in model.named_parameters()]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 << 20]
    expected = dist._compute_bucket_assignment_by_size(list(model.parameters()), limits)
    assert compute_bucket_assignment_by_size(specs, limits) == ([list(b) for b in expected[0]], list(expected[1]))


@pytest.mark.parametrize("specs, limits, match", [
    ([], [10], "at least one tensor"),
    ([TensorSpec("a", (3,), "float32")], [], "at least one limit"),
    ([TensorSpec("a", (3,), "float32")], [-1], "non-negative"),
])
def test_bad_input_raises(specs, limits, match):
    with pytest.raises(ValueError, match=match):
        compute_bucket_assignment_by_size(specs, limits)


def test_tensor_indices_length_mismatch():
    with pytest.raises(ValueError, match="tensor_indices has 1 entries for 2 tensors"):
        compute_bucket_assignment_by_size([TensorSpec("a", (1,), "float32"), TensorSpec("b", (1,), "float32")], [8], [0])
