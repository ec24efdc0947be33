"""The CUDA path's cache of copy lists (``hybrid.kernels._torch._prepared``), checked on the host.

The launch is replaced by a recorder and the stream lookup by a stub, so the Python side of the
CUDA path runs on CPU tensors: a repeated call with the same storage reuses the prepared list, and
any change of address (a tensor, the bucket buffer) or of bucket builds the list the plan says.
"""

import numpy as np
import pytest
import torch

from hybrid.core import TensorSpec, plan_buckets
from hybrid.kernels import _torch as kt
from hybrid.kernels._copies import gather_copies, scatter_copies


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(kt, "launch", lambda *args: calls.append(args))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
    monkeypatch.setattr(kt, "_PREPARED", type(kt._PREPARED)())
    return calls


def _plan():
    return plan_buckets([TensorSpec(f"p{i}", s, "float32") for i, s in enumerate([(3,), (2, 5), (7,)])],
                        alignment=4)


def _expected_gather(bucket, tensors, out):
    members = [tensors[m] for m in bucket.members]
    return gather_copies([t.data_ptr() for t in members], [t.numel() for t in members], bucket.offsets,
                         out.data_ptr(), out.numel(), out.element_size())


def _assert_lists(call, expected):
    for got, want in zip(call[:3], expected):
        np.testing.assert_array_equal(got, np.asarray(want, got.dtype))


def test_same_storage_reuses_the_list_and_new_storage_rebuilds_it(launches):
    plan = _plan()
    bucket = plan.buckets[0]
    tensors = [torch.randn(s.shape) for s in plan.specs]
    out = torch.empty(bucket.length)
    members = [tensors[m] for m in bucket.members]
    kt._torch_gather_cuda(members, out, bucket.offsets, None, bucket)
    kt._torch_gather_cuda(members, out, bucket.offsets, 0.5, bucket)
    assert launches[0][0] is launches[1][0]  # the prepared arrays, not rebuilt
    assert launches[1][6] == 0.5  # the scale is not part of the list: each call passes its own
    _assert_lists(launches[0], _expected_gather(bucket, tensors, out))

    tensors[bucket.members[1]] = torch.randn(plan.specs[bucket.members[1]].shape)  # new storage
    kt._torch_gather_cuda([tensors[m] for m in bucket.members], out, bucket.offsets, None, bucket)
    assert launches[2][0] is not launches[0][0]
    _assert_lists(launches[2], _expected_gather(bucket, tensors, out))

    other = torch.empty(bucket.length + 4)  # another bucket buffer: zero fill to its end
    kt._torch_gather_cuda([tensors[m] for m in bucket.members], other, bucket.offsets, None, bucket)
    _assert_lists(launches[3], _expected_gather(bucket, tensors, other))


def test_an_equal_bucket_of_another_plan_does_not_share_the_list(launches):
    plan, again = _plan(), _plan()
    assert plan == again and plan.buckets[0] is not again.buckets[0]
    tensors = [torch.randn(s.shape) for s in plan.specs]
    flat = torch.randn(plan.buckets[0].length)
    outs = [tensors[m] for m in plan.buckets[0].members]
    kt._torch_scatter_cuda(flat, outs, plan.buckets[0].offsets, None, plan.buckets[0])
    kt._torch_scatter_cuda(flat, outs, again.buckets[0].offsets, None, again.buckets[0])
    assert launches[0][0] is not launches[1][0]
    want = scatter_copies(flat.data_ptr(), 4, plan.buckets[0].offsets, [t.data_ptr() for t in outs],
                          [t.numel() for t in outs])
    _assert_lists(launches[1], want)


def test_the_cache_is_bounded(launches, monkeypatch):
    monkeypatch.setattr(kt, "_PREPARED_MAX", 3)
    plan = _plan()
    bucket = plan.buckets[0]
    tensors = [torch.randn(s.shape) for s in plan.specs]
    for _ in range(6):
        kt._torch_gather_cuda([tensors[m] for m in bucket.members], torch.empty(bucket.length), bucket.offsets,
                              None, bucket)
    assert len(kt._PREPARED) <= 3
