"""ZeRO3 in one gloo process: docstring examples, input errors, what the parameters and their
``.grad`` hold between uses, the gathered() block, and a torch optimizer built on the wrong
tensors failing loudly."""

import copy
import doctest
import pathlib
import subprocess
import sys

import pytest
import torch

import hybrid.torch.zero._parts
import hybrid.torch.zero.zero3._init_whole
import hybrid.torch.zero.zero3._model
import hybrid.torch.zero.zero3._offload
import hybrid.torch.zero.zero3._optim
import hybrid.torch.zero.zero3._shards
from hybrid.torch import GradientInShards, ZeRO3, ZeRO3Optimizer
from hybrid.torch import ParameterInShards
from tests.torch_zero2.test_zero2_local import world_of_one  # noqa: F401 - a fixture: one gloo process


@pytest.mark.parametrize("module", [hybrid.torch.zero.zero3._model, hybrid.torch.zero.zero3._optim,
                                    hybrid.torch.zero.zero3._offload, hybrid.torch.zero.zero3._shards,
                                    hybrid.torch.zero._parts, hybrid.torch.zero.zero3._init_whole])
def test_module_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


_LIVE_CHECK = """
import doctest, torch
from hybrid.bench import _live
try:
    _live.install()
except RuntimeError as e:
    print(f"skip: {e}")  # no C++ compiler here
    raise SystemExit(0)
result = doctest.testmod(_live)
assert result.attempted > 0 and result.failed == 0, result
# Kernels that take scratch memory with raw_allocate (a conv's) need a DataPtr whose context is
# its address, as torch's own CPU allocator gives: the counting allocator must too.
before = _live.live_bytes()
y = torch.nn.Conv1d(3, 4, 3)(torch.randn(2, 3, 9, requires_grad=True))
y.sum().backward()
del y
assert _live.live_bytes() - before < 4096, _live.live_bytes() - before
print("ok")
"""


def test_live_bytes_doctests():
    """In a process of its own: the counting allocator, once installed, stays for the process's life,
    and this test's worker goes on to run other tests."""
    run = subprocess.run([sys.executable, "-c", _LIVE_CHECK], capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    if run.stdout.startswith("skip:"):
        pytest.skip(run.stdout)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("make, error, match", [
    (lambda: ZeRO3("model"), TypeError, "ZeRO3 wraps a torch.nn.Module, got str"),
    (lambda: ZeRO3(_mlp(), prefetch=-1), ValueError, r"prefetch must be an int >= 0 .*got -1"),
    (lambda: ZeRO3(_mlp(), prefetch=True), ValueError, "prefetch must be an int >= 0"),
    (lambda: ZeRO3(_mlp(), bucket_cap_mb=0), ValueError, "bucket_cap_mb must be > 0, got 0"),
    (lambda: ZeRO3(_mlp().requires_grad_(False)), ValueError, "no parameter that requires a gradient"),
    (lambda: ZeRO3(_mlp(), policy="fast"), ValueError, r"policy must be one of \('speed', 'memory'\), got 'fast'"),
    (lambda: ZeRO3(_mlp(), policy="memory", bucket_cap_mb=1), ValueError, "give it or bucket_cap_mb=, not both"),
    (lambda: ZeRO3Optimizer(_mlp(), torch.optim.SGD, lr=0.1), TypeError, "needs a hybrid.torch.ZeRO3 model, got Sequential"),
    (lambda: ZeRO3Optimizer(ZeRO3(_mlp()), "sgd"), TypeError, "optimizer_class must be a torch.optim.Optimizer subclass"),
])
def test_input_errors(world_of_one, make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_param_group_errors_name_the_culprit(world_of_one):
    model = ZeRO3(_mlp())
    w0, b0, w2, b2 = model.module.parameters()
    with pytest.raises(ValueError, match=r"parameters in no group: \['2.weight', '2.bias'\]"):
        ZeRO3Optimizer(model, torch.optim.SGD, param_groups=[{"params": [w0, b0]}], lr=0.1)
    with pytest.raises(ValueError, match=r"parameter '0.bias' appears in param_groups\[0\] and param_groups\[1\]"):
        ZeRO3Optimizer(model, torch.optim.SGD, param_groups=[{"params": [w0, b0]}, {"params": [b0, w2, b2]}], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(5,\) that is not a parameter of the ZeRO3 module"):
        ZeRO3Optimizer(model, torch.optim.SGD, param_groups=[{"params": [torch.nn.Parameter(torch.ones(5))]}], lr=0.1)


def test_parameters_are_sharded_stand_ins_between_uses(world_of_one):
    """Outside the forward and backward a parameter keeps its shape but holds one element; any
    read of its values raises naming it (instead of reading stale or freed memory); inside
    gathered() the module holds the whole values."""
    torch.manual_seed(0)
    plain = _mlp()
    model = ZeRO3(copy.deepcopy(plain))
    weight = model.module[0].weight
    assert isinstance(weight, ParameterInShards) and weight.shape == (4, 3) and weight.requires_grad
    assert repr(weight) == "ParameterInShards('0.weight', shape=(4, 3))"
    for read in (lambda: weight.sum(), lambda: weight.data, lambda: weight + 1, lambda: weight.detach(),
                 lambda: model.module.state_dict()):
        with pytest.raises(RuntimeError, match=r"parameter '0\.weight': .* is not available: it is sharded"):
            read()
    with model.gathered():
        assert torch.equal(model.module[0].weight, plain[0].weight)
    assert model.module[0].weight is weight  # the user's object again, once the block ends
    model(torch.ones(2, 3))
    assert model.module[0].weight is weight  # ... and after a forward


def test_a_forward_that_raises_leaves_the_model_usable(world_of_one):
    model = ZeRO3(_mlp())
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        model(torch.ones(2, 5))
    assert all(s == "free" for s in model._buckets.state)
    assert isinstance(model.module[0].weight, ParameterInShards)
    model(torch.ones(2, 3)).sum().backward()


def test_gathered_writeback(world_of_one):
    model = ZeRO3(_mlp())
    with model.gathered(writeback=True):
        with torch.no_grad():
            model.module[2].bias.fill_(3.0)
    assert model.state_dict()["module.2.bias"].tolist() == [3.0, 3.0]
    with model.gathered():  # without writeback, changes are dropped
        with torch.no_grad():
            model.module[2].bias.fill_(5.0)
    assert model.state_dict()["module.2.bias"].tolist() == [3.0, 3.0]


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.SGD])
def test_torch_optimizer_over_model_parameters_fails_loudly(world_of_one, optimizer_class):
    """FSDP2's habit, torch.optim.Adam(model.parameters()), meets the sharded stand-ins and their
    GradientInShards: an error naming the parameter and ZeRO3Optimizer, not a silent no-op."""
    model = ZeRO3(_mlp())
    opt = optimizer_class(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    assert isinstance(model.module[0].weight.grad, GradientInShards)
    with pytest.raises((RuntimeError, TypeError), match=r"parameter '0\.weight'.*hybrid\.torch\.ZeRO3Optimizer"):
        opt.step()


def test_state_dict_arguments(world_of_one):
    model = ZeRO3(_mlp())
    with pytest.raises(TypeError, match="takes only prefix="):
        model.state_dict(keep_vars=True)
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(model.state_dict(), assign=True)
    assert list(model.state_dict(prefix="x.")) == [f"x.module.{k}" for k in _mlp().state_dict()]


def test_memory_stats_count_slices_and_the_working_set(world_of_one):
    """A world of one holds every slice whole; the working set is the prefetch window and a
    gradient bucket."""
    model = ZeRO3(torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(4)]),
                  bucket_cap_mb=200 / 2**20)
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
    assert model.bucket_plan.num_buckets == 4  # a weight (256 bytes) per bucket
    model(torch.ones(2, 8)).sum().backward()
    stats = model.memory_stats()
    assert stats["param_slices"] == stats["grad_slices"] == 4 * 64 * 4
    # Two buckets gathered (one computing, one prefetched), then in the backward one gathered, one
    # prefetched and the gradient bucket of the one before: at most 3 buckets of 64 floats.
    assert stats["working_set"] == 3 * 64 * 4
    opt.step()
    opt.zero_grad()
    assert model.memory_stats()["grad_slices"] == 0


def test_a_backward_that_raises_leaves_the_model_usable(world_of_one):
    """An error inside the backward (here a user's hook) skips autograd's end-of-backward
    callback; the next forward starts clean, and the next backward reduces as usual."""
    model = ZeRO3(_mlp(), bucket_cap_mb=1e-4)
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
    out = model(torch.ones(2, 3))
    out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("a user's hook failed")))
    with pytest.raises(ValueError, match="a user's hook failed"):
        out.sum().backward()
    model(torch.ones(2, 3)).sum().backward()
    assert all(s == "free" for s in model._buckets.state)
    assert opt.grad_numel() == sum(model.shards.shard_sizes)
    opt.step()


def test_numpy_views_inside_gathered(world_of_one):
    """torch makes a storage non-resizable once numpy views it, and ZeRO3 frees a bucket by
    resizing its storage: a parameter read with .numpy() inside gathered() keeps its values (the
    array is the user's), and the bucket gathers into a new buffer, training on as before."""
    torch.manual_seed(0)
    plain = _mlp()
    model = ZeRO3(copy.deepcopy(plain))
    with model.gathered():
        arrays = {n: p.detach().numpy() for n, p in model.module.named_parameters()}
    assert all(s == "free" for s in model._buckets.state)
    for name, p in plain.named_parameters():
        assert (arrays[name] == p.detach().numpy()).all(), name
    opt, plain_opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    for net, o in ((model, opt), (plain, plain_opt)):
        net(torch.ones(2, 3)).sum().backward()
        o.step()
    with model.gathered():
        for name, p in plain.named_parameters():
            assert torch.equal(model.module.get_parameter(name), p), name
    assert model._buckets.working.live == 0


def test_external_params_errors_name_the_culprit(world_of_one):
    from tests.torch_zero3._models import Siblings
    model = Siblings()
    model.inp.requires_grad_(False)
    with pytest.raises(ValueError, match=r"external_params: Linear .* is not a module of the wrapped model"):
        ZeRO3(model, external_params={torch.nn.Linear(2, 2): [model.mix.weight]})
    with pytest.raises(ValueError, match=r"external_params\['reader'\]: 'inp.weight', which is not sharded"):
        ZeRO3(model, external_params={model.reader: [model.inp.weight]})
    with pytest.raises(ValueError, match=r"external_params\['the root module'\]: a tensor of shape \(3,\) that is no "
                                         r"parameter"):
        ZeRO3(model, external_params={model: [torch.nn.Parameter(torch.ones(3))]})
    with pytest.raises(TypeError, match="external_params must map modules"):
        ZeRO3(model, external_params=[model.mix.weight])


def test_a_read_outside_any_forward_names_the_parameter(world_of_one):
    """Outside a forward, its backward and gathered(), a read of a parameter raises naming it and
    the calls that work; inside a forward, the same read computes (the parent's head)."""
    from tests.torch_zero3._models import TinyGPT
    model = ZeRO3(TinyGPT())
    with pytest.raises(RuntimeError, match=r"parameter 'emb.weight': T is not available: it is sharded .*"
                                           r"only while a forward \(model\(x\) or model.module\(x\)\)"):
        model.module.emb.weight.T
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()


def test_step_in_backward_follows_the_optimizer_that_asked_for_it(world_of_one):
    """The model holds the in-backward optimizer weakly: deleted, it stops stepping, and a new one
    may step in its place; while it lives, a second one is refused."""
    import gc

    model = ZeRO3(torch.nn.Linear(4, 2))
    first = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.5, step_in_backward=True)
    with pytest.raises(ValueError, match="already steps in its backward with another ZeRO3Optimizer"):
        ZeRO3Optimizer(model, torch.optim.SGD, lr=0.5, step_in_backward=True)
    del first
    gc.collect()
    with model.gathered():
        before = model.module.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()  # no optimizer steps in it now
    with model.gathered():
        assert torch.equal(model.module.weight, before)
    second = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.5, step_in_backward=True)
    model(torch.ones(3, 4)).sum().backward()
    with model.gathered():
        assert not torch.equal(model.module.weight, before)
    assert second.grad_numel() == 0


def test_offload_dir_refuses_what_cannot_hold_state(world_of_one, tmp_path):
    """offload_dir names the directory it cannot use, before any state exists; a usable one leaves
    no files behind (each is unlinked as it is mapped) and its state goes when the optimizer does."""
    import gc

    model = ZeRO3(torch.nn.Linear(4, 2))
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=f"offload_dir={str(missing)!r} is not a directory"):
        ZeRO3Optimizer(model, torch.optim.Adam, offload_dir=missing)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        ZeRO3Optimizer(model, torch.optim.Adam, offload_dir=a_file)
    opt = ZeRO3Optimizer(model, torch.optim.Adam, lr=0.1, offload_dir=tmp_path)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert opt.offloaded_bytes() == 4 * opt.state_numel() == 80  # exp_avg, exp_avg_sq of 10 elements
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    files = opt._files
    del opt
    gc.collect()
    assert files.held_bytes() == 0


def test_offload_dir_in_memory_is_warned_about(world_of_one):
    """A directory on tmpfs keeps the 'offloaded' state in memory: the user is told, by name."""
    from hybrid.torch.zero.zero3._offload import filesystem_type

    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    model = ZeRO3(torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"offload_dir='/dev/shm' is on tmpfs, whose files live in memory"):
        ZeRO3Optimizer(model, torch.optim.Adam, offload_dir="/dev/shm")
