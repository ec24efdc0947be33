"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) in
hybrid.torch.DistributedDataParallel, against torch's class in the same gloo processes, world
sizes 1, 2, 3 (issue 15). Sparse gradients are compared as sparse tensors: layout, coalesced
flag and indices exactly, values within the float32 tolerance."""

from __future__ import annotations

import copy
import doctest
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import _workers_sparse  # noqa: E402
from test_ddp import ATOL, RTOL, WORLD_SIZES, LazyWorlds, side_by_side_results as _results  # noqa: E402
from test_ddp_logging import assert_error_logged_like_torch  # noqa: E402
from test_ddp_logging import assert_like_torch as assert_logging_like_torch  # noqa: E402

from tests._procs import free_port  # noqa: E402
import hybrid.torch.ddp.reducer._sparse  # noqa: E402
from hybrid.torch import DistributedDataParallel  # noqa: E402

TRAINING = ["plain", "find_unused", "view", "view_find_unused", "static", "small_caps", "hook",
            "hook_view_static", "builtin_ALLREDUCE", "no_sync", "no_sync_find_unused", "metadata_hook"]
SPARSE = (0, 1)  # Tables' parameter indices of emb.weight and bag.weight


@pytest.fixture(scope="module")
def runs():
    return LazyWorlds(_workers_sparse.sparse_worker, _workers_sparse.CASES, "sparse")


def _outcomes(runs, world, case):
    return [(res[case]["torch"], res[case]["hybrid"]) for res in runs[world]]


def _same_grad(a, b):
    if a is None or b is None:
        assert a is None and b is None, (a, b)
        return
    assert a.layout == b.layout
    if a.is_sparse:
        assert a.is_coalesced() == b.is_coalesced()
        torch.testing.assert_close(a._indices(), b._indices(), rtol=0, atol=0)
        torch.testing.assert_close(a._values(), b._values(), rtol=RTOL, atol=ATOL)
    else:
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", TRAINING)
def test_sparse_and_dense_gradients_match_torch(runs, world, case):
    # Every step's gradients (the tables' as sparse COO tensors) and the final parameters after
    # SGD steps equal torch's; gradient_as_bucket_view and static_graph leave the sparse ones alone.
    for ref, ours in _results(runs, world, case):
        assert len(ours["grads"]) == len(ref["grads"]) >= 3
        for step_ref, step_ours in zip(ref["grads"], ours["grads"]):
            for i, (a, b) in enumerate(zip(step_ref, step_ours)):
                assert (b.layout == torch.sparse_coo) == (i in SPARSE), (i, b.layout)
                _same_grad(a, b)
        for a, b in zip(ref["params"], ours["params"]):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_agree_on_sparse_gradients(runs, world):
    # Different rows looked up on each rank: the all-reduced sparse gradient is the same everywhere.
    results = [ours for _, ours in _results(runs, world, "plain")]
    for other in results[1:]:
        for step0, step in zip(results[0]["grads"], other["grads"]):
            for a, b in zip(step0, step):
                _same_grad(a, b)
    rows = {tuple(res["grads"][0][0].coalesce().indices()[0].tolist()) for res in results}
    assert len(rows) == 1


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_comm_hook_sees_sparse_buckets_like_torch(runs, world):
    # A sparse parameter alone in its bucket, before and after the rebuild: the hook's buffer()
    # is the sparse gradient, gradients() is empty (torch's GradBucket), membership as torch's.
    for ref, ours in _results(runs, world, "hook"):
        assert ours["buckets"] == ref["buckets"]
        layouts = {(tuple(members), layout) for _, members, layout, _, _ in ours["buckets"]}
        assert ((0,), "torch.sparse_coo") in layouts and ((1,), "torch.sparse_coo") in layouts
        assert all(n == 0 for _, _, layout, n, _ in ours["buckets"] if layout == "torch.sparse_coo")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_join_shadows_the_sparse_all_reduce(runs, world):
    # Uneven inputs under ddp.join(): a joined rank all-reduces an empty sparse tensor in step
    # with the others' sparse all-reduce; every rank ends with torch's parameters.
    for ref, ours in _results(runs, world, "join"):
        for a, b in zip(ref["params"], ours["params"]):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


# torch's message first, then (ours) the parameter it is about.
ERRORS = {
    "unused_find_unused": ("RuntimeError", "Expected sparse gradient to be defined.", "emb.weight"),
    "unused_static_first": ("RuntimeError", "Expected sparse gradient to be defined.", "emb.weight"),
    "dense_into_sparse": ("RuntimeError", "Expected variable to have sparse gradient.", "emb.weight"),
    "sparse_into_dense": ("NotImplementedError", "Cannot access storage of SparseTensorImpl", "'table'"),
    "sparse_into_dense_fused": ("NotImplementedError", "Cannot access storage of SparseTensorImpl", "'table'"),
    "metadata_once": ("RuntimeError", "copy_() between dense and sparse Tensors is not implemented!", ""),
    "metadata_default_hook": ("RuntimeError", "expected values to be a dense tensor, but got values of layout Sparse", ""),
    "metadata_partial": ("RuntimeError", "Sparse metadata and gradient size mismatch", ""),
    "metadata_missing": ("RuntimeError", "param: bag.weight not found in sparse metadata", ""),
    "metadata_not_a_dict": ("TypeError", "_set_sparse_metadata(): incompatible function arguments.", ""),
    # The graph changed under static_graph: caught at the next forward, as for dense parameters.
    "unused_static": ("RuntimeError", "Expected to have finished reduction in the prior iteration", "emb.weight"),
}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(_workers_sparse.ERROR_LOGS))
def test_misuse_logged_like_torch(runs, world, case):
    # The errors torch's reducer logs (has_error, error, iteration), logged by ours; the others
    # (raised by ATen or pybind) logged by neither.
    for ref, ours in _results(runs, world, case):
        assert_error_logged_like_torch(ours, ref, case)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_misuse_raises_torchs_error(runs, world, case):
    kind, text, culprit = ERRORS[case]
    for ref, ours in _outcomes(runs, world, case):
        assert ref["error"][0] == ours["error"][0] == kind, (ref["error"], ours["error"])
        assert ref["error"][1].startswith(text), ref["error"]
        assert ours["error"][1].startswith(text) and culprit in ours["error"][1], ours["error"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_logging_data_counts_sparse_buckets_like_torch(runs, world):
    for ref, ours in _results(runs, world, "logging"):
        for when in ("before", "after"):
            assert_logging_like_torch(ours[when], ref[when], when)
        assert len(ours["before"]["bucket_sizes"].split(", ")) == 3  # dense, then a bucket per table


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch._dynamo.reset()
    dist.destroy_process_group()


def test_sparse_parameter_alone_in_its_bucket_without_a_flat_buffer(world_of_one):
    # A 4M-row table would cost 64 MiB of flat buffer per bucket: a sparse bucket holds none.
    ddp = DistributedDataParallel(_workers_sparse.Tables())
    plan = ddp.bucket_plan
    sparse = [b for b in plan.buckets if b.sparse]
    assert sorted(b.members for b in sparse) == [(0,), (1,)]
    assert all(ddp._reducer.buckets.flat[plan.buckets.index(b)].is_sparse for b in sparse)
    assert not any(b.sparse for b in plan.buckets if b.members[0] not in (0, 1))


def test_compiled_ddp_with_a_sparse_table_matches_eager_torch(world_of_one):
    # hybrid.torch.compile splits the graph around the tables' pieces (aot_autograd sees sparse
    # gradients); float32, one rank, the same math: the project's float32 tolerance.
    from hybrid.torch import compile as hybrid_compile
    from hybrid.torch.dynamo._compile import split_reports
    base = _workers_sparse._model(_workers_sparse.Tables, 0)
    model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = hybrid_compile(DistributedDataParallel(model), backend="aot_eager", split_cap_mb=0)
    ref = torch.nn.parallel.DistributedDataParallel(ref_model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref_model)]
    for step in range(3):
        x, y = _workers_sparse._data(0, step)
        for m, opt in zip((compiled, ref), opts):
            ((m(x) - y) ** 2).mean().backward()
        for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
            assert (p.grad.layout == torch.sparse_coo) == (i in SPARSE)
            _same_grad(q.grad, p.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert split_reports(compiled)[-1].num_pieces > 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_sparse_doctests():
    result = doctest.testmod(hybrid.torch.ddp.reducer._sparse)
    assert result.attempted > 0 and result.failed == 0
