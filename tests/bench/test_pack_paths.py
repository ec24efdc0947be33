"""bench pack's copy paths, run on CPU tensors (where ``cuda-op`` runs the ops' CPU kernels): every
path packs the plan's layout and unpacks it back, so the GPU rows time the same work."""

import pytest
import torch

from hybrid.bench.pack._command import _copy_paths
from hybrid.core import TensorSpec, pack, plan_buckets


@pytest.mark.parametrize("backend", ["reference", "cuda-op"])
def test_paths_pack_the_plan_and_unpack_it(backend):
    plan = plan_buckets([TensorSpec(f"p{i}", s, "float32") for i, s in enumerate([(3,), (2, 5), (7,)])],
                        alignment=4, bucket_cap_bytes=48)
    grads = [torch.randn(s.shape) for s in plan.specs]
    want = [pack(plan, b, [g.numpy() for g in grads]) for b in range(len(plan.buckets))]
    flats = [torch.full((b.length,), float("nan")) for b in plan.buckets]
    gather_all, scatter_all = _copy_paths(plan, grads, flats, backend)
    gather_all()
    for f, w in zip(flats, want):
        assert torch.equal(f, torch.from_numpy(w))
    originals = [g.clone() for g in grads]
    for g in grads:
        g.zero_()
    scatter_all()
    for g, o in zip(grads, originals):
        assert torch.equal(g, o)
