"""hybrid.torch.compile / SplitBackend in one process: outputs and gradients equal the uncompiled
model (rtol 1.3e-6, float32), one backend compile per planned piece, and the odd graphs (graph
breaks, no parameters, a piece without outputs, higher-order ops, a cap below every parameter)."""

import copy
import doctest

import pytest
import torch
from torch import fx, nn

import hybrid.torch as ht
from hybrid.torch.dynamo import _compile

RTOL, ATOL = 1.3e-6, 1e-6


def _mlp(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


class _Counting:
    """The named backend, counting its compiles (one per piece)."""

    def __init__(self, name):
        self.inner, self.calls = torch._dynamo.lookup_backend(name), 0

    def __call__(self, gm, example_inputs, **kw):
        self.calls += 1
        return self.inner(gm, example_inputs, **kw)


def _check_against_uncompiled(model, compiled, x):
    ref = copy.deepcopy(model)
    out, want = compiled(x), ref(x)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_pieces_match_plan_and_uncompiled(backend):
    torch._dynamo.reset()
    model = _mlp(8)   # small: inductor compiles each piece
    counting = _Counting(backend)
    compiled = ht.compile(model, backend=counting, split_cap_mb=100 / 2**20)   # every linear fills a piece
    _check_against_uncompiled(model, compiled, torch.randn(5, 8))
    (report,) = ht.split_reports(compiled)
    assert report.reason is None and report.num_pieces == 3 == counting.calls
    assert [report.plan.specs[i].name for i in report.plan.members(0)] == ["4.weight", "4.bias"]


def test_cap_below_every_parameter_gives_a_piece_per_linear():
    torch._dynamo.reset()
    model = _mlp()
    compiled = ht.compile(model, backend="eager", split_cap_mb=0)
    _check_against_uncompiled(model, compiled, torch.randn(3, 8))
    assert ht.split_reports(compiled)[0].num_pieces == 3


def test_all_parameters_in_one_piece_compiles_whole():
    torch._dynamo.reset()
    model, counting = _mlp(), _Counting("aot_eager")
    compiled = ht.compile(model, backend=counting)   # DDP's defaults: 1 MiB first piece
    _check_against_uncompiled(model, compiled, torch.randn(3, 8))
    (report,) = ht.split_reports(compiled)
    assert counting.calls == 1 and "one piece" in report.reason


class _Break(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.b(torch.relu(self.a(x))))
        torch._dynamo.graph_break()
        return self.c(x)


def test_graph_break_each_graph_split_on_its_own():
    torch._dynamo.reset()
    model = _Break()
    compiled = ht.compile(model, backend="aot_eager", split_cap_mb=0)
    _check_against_uncompiled(model, compiled, torch.randn(3, 8))
    assert [r.num_pieces for r in ht.split_reports(compiled)] == [2, 1]


class _NoParams(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2


def test_graph_without_parameters_runs():
    torch._dynamo.reset()
    compiled = ht.compile(_NoParams(), backend="aot_eager", split_cap_mb=0)
    x = torch.randn(4, requires_grad=True)
    torch.testing.assert_close(compiled(x), torch.tanh(x) * 2, rtol=RTOL, atol=ATOL)
    assert "no parameter" in ht.split_reports(compiled)[0].reason


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False)
        return self.b(h)


def test_higher_order_op_is_compiled_whole_with_a_reason():
    torch._dynamo.reset()
    model = _Checkpointed()
    compiled = ht.compile(model, backend="aot_eager", split_cap_mb=0)
    _check_against_uncompiled(model, compiled, torch.randn(3, 8))
    (report,) = ht.split_reports(compiled)
    assert "higher-order op" in report.reason and report.num_pieces == 1


class _InPlaceOnly(nn.Module):
    """``w2`` is used only by an in-place op on an input: its piece would have no output."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4))

    def forward(self, x, y):
        y.add_(self.w2)
        return x @ self.w1


def test_piece_without_outputs_is_merged_and_reported():
    model = _InPlaceOnly()
    split = ht.SplitBackend("eager", params=list(model.named_parameters()), size_limits=(0,))
    plan, piece, _ = split.plan(fx.symbolic_trace(model))
    assert plan.num_pieces == 1 and plan.merged == (1,)
    assert [plan.specs[i].name for i in plan.members(0)] == ["w1", "w2"]


def test_torch_ddp_and_bad_backend_are_refused():
    with pytest.raises(TypeError, match="callable"):
        ht.SplitBackend(3, params=[], size_limits=(1,))
    with pytest.raises(ValueError, match="first split cap"):
        ht.compile(_mlp(), backend="eager", split_cap_mb=1, first_split_cap_mb=2)


def test_doctests():
    result = doctest.testmod(_compile)
    assert result.attempted > 0 and result.failed == 0



@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist
    from tests._procs import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch._dynamo.reset()
    dist.destroy_process_group()


def test_optimize_ddp_toggled_in_one_process_compiles_each_way_once(world_of_one):
    # A bare nn.Sequential: dynamo skips top-level torch.nn frames, so without a frame of ours to
    # enter through, optimize_ddp=False used to run it eagerly.
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(3, 8)
    ddp = ht.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=100 / 2**20)
    counting = _Counting("eager")
    compiled = torch.compile(ddp, backend=counting)
    compiled(x).sum().backward()
    assert counting.calls == 3 == ht.split_reports(ddp)[0].num_pieces
    with torch._dynamo.config.patch(optimize_ddp=False):
        out = compiled(x)
    assert counting.calls == 4 and len(ht.split_reports(ddp)) == 1   # one whole graph, no split
    torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)
    compiled(x).sum().backward()
    assert counting.calls == 4   # back on: the split graphs, cached


class _Mixed(nn.Module):
    """A parameter DDP ignores, a frozen one and BatchNorm's buffers: none counts toward a piece."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)
        self.ignored, self.frozen = nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(8), requires_grad=False)
        self._ddp_params_and_buffers_to_ignore = ["ignored"]

    def forward(self, x):
        return self.b(self.norm(torch.relu(self.a(x))) * self.ignored * self.frozen)


def test_ignored_frozen_parameters_and_buffers_do_not_count(world_of_one):
    torch._dynamo.reset()
    model, x = _Mixed(), torch.randn(5, 8)
    ddp = ht.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=100 / 2**20)
    compiled = torch.compile(ddp, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)
    out.sum().backward()
    (report,) = ht.split_reports(ddp)
    counted = [report.plan.specs[i].name for k in range(report.num_pieces) for i in report.plan.members(k)]
    assert sorted(counted) == sorted(["a.weight", "a.bias", "norm.weight", "norm.bias", "b.weight", "b.bias"])
    assert sum(report.plan.nbytes(k) for k in range(report.num_pieces)) == 4 * (64 + 8 + 8 + 8 + 32 + 4)
