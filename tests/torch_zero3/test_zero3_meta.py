"""ZeRO3 from a module built on the meta device (issue 36, item 1): each rank initialises the model
one module at a time and keeps its slices only. The oracle is a CPU build under the same seed:
torch's own layers (whose constructors call ``reset_parameters()``) equal a plain ``Net()`` bit for
bit, buffers included, and leave the RNG where it does; an ``init_fn`` equals the same calls on a
CPU build, in ``model.modules()`` order. A module that nothing initialises is refused naming the
tensor. At 2 ranks (one spawn): the same values, then training equal to torch DDP over the CPU
build bit for bit, and the allocator-counted peak of the build within this rank's slices plus one
module."""

import copy
import warnings

import pytest
import torch
from torch import nn

from hybrid.models import GPTConfig, TorchGPT
from hybrid.torch import ZeRO3, ZeRO3Optimizer
from tests._procs import forkserver_ranks, init_gloo
from tests.torch_zero3._models import CausalMixer, Mixed, RootScale, causal_init, tokens
from tests.torch_zero2.test_zero2_local import world_of_one  # noqa: F401 - a fixture: one gloo process


def meta_build(make, seed: int = 0, **zero3):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = make()
    return ZeRO3(model, **zero3)


def cpu_build(make, seed: int = 0):
    torch.manual_seed(seed)
    return make()


def assert_same_state(zero3: ZeRO3, ref: nn.Module) -> None:
    ours = zero3.state_dict()
    want = ref.state_dict()
    assert list(ours) == [f"module.{k}" for k in want]
    for k, v in want.items():
        assert torch.equal(ours[f"module.{k}"], v), k


SMALL_GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("cap", [None, 1e-4])
def test_torch_layers_equal_a_cpu_build(world_of_one, cap):
    model = meta_build(Mixed, bucket_cap_mb=cap)
    after = torch.get_rng_state()
    ref = cpu_build(Mixed)
    assert torch.equal(after, torch.get_rng_state()), "the RNG is not where a CPU build leaves it"
    assert_same_state(model, ref)
    assert all(b.device.type == "cpu" for b in model.module.buffers())
    assert model.module.bn.running_var.tolist() == [1.0] * 16


def test_init_fn_equals_the_same_calls_on_a_cpu_build(world_of_one):
    """A GPT with a tied head, initialised by its own init_weights one module at a time: the tied
    weight ends with its last write, as the loop on the CPU."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = TorchGPT(SMALL_GPT)
    torch.manual_seed(1)
    model = ZeRO3(meta, init_fn=meta.init_weights, bucket_cap_mb=1e-3)
    ref = TorchGPT(SMALL_GPT)
    torch.manual_seed(1)
    for m in ref.modules():
        if m._parameters or m._buffers:
            ref.init_weights(m)
    assert_same_state(model, ref)
    assert model.module.lm_head.weight is model.module.wte.weight
    torch.manual_seed(1)
    ref.init_weights()  # torchtitan's whole-model call: the same loop
    assert_same_state(model, ref)


def test_a_model_with_its_own_init_weights_is_warned_about_without_init_fn(world_of_one):
    # Built on the meta device, TorchGPT's __init__ initialisation never ran: without init_fn each
    # Linear gets torch's default (kaiming uniform, std 1/sqrt(3 fan_in)), not GPT-2's 0.02.
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=64)
    with torch.device("meta"):
        meta = TorchGPT(config)
    with pytest.warns(UserWarning, match=r"ZeRO3: GPT defines init_weights\(\).*pass init_fn=model.init_weights"):
        defaults = ZeRO3(meta)
    with torch.device("meta"):
        meta = TorchGPT(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpt2 = ZeRO3(meta, init_fn=meta.init_weights)
    fc = "module.h.0.mlp.c_fc.weight"
    assert float(defaults.state_dict()[fc].std()) > 0.05  # torch's default for a fan-in of 64: 0.072
    assert abs(float(gpt2.state_dict()[fc].std()) - config.init_std) < 0.002


def test_buffers_computed_in_init_need_an_init_fn(world_of_one):
    with pytest.raises(ValueError, match=r"'mask' is on the meta device and nothing initialises it: the root "
                                         r"module \(CausalMixer\) has no reset_parameters\(\); give ZeRO3\(\.\.\., "
                                         r"init_fn=fn\)"):
        meta_build(CausalMixer)
    model = meta_build(CausalMixer, init_fn=causal_init)
    ref = cpu_build(CausalMixer)
    assert torch.equal(model.module.mask, ref.mask)  # not in any state dict: persistent=False
    assert_same_state(model, ref)
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


class _Replaces(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))

    def reset_parameters(self):
        self.w = nn.Parameter(torch.ones(3))


class _Forgets(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.w = nn.Parameter(torch.empty(3))

    def reset_parameters(self):
        pass


class _ReadsFinished(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = _Head(self.fc)


class _Head(nn.Module):
    def __init__(self, fc):
        super().__init__()
        self.__dict__["fc"] = fc
        self.w = nn.Parameter(torch.empty(3, 3))

    def reset_parameters(self):
        with torch.no_grad():
            self.w.copy_(self.fc.weight * 2)  # reads another module's finished weight


@pytest.mark.parametrize("make, init_fn, match", [
    (RootScale, None, r"'scale' is on the meta device and nothing initialises it: the root module \(RootScale\) "
                      r"has no reset_parameters\(\); give ZeRO3\(\.\.\., init_fn=fn\).*or define reset_parameters\(\) "
                      r"on RootScale"),
    (_Replaces, None, r"the root module \(_Replaces\)'s initialiser replaced 'w' with another object; initialise "
                      r"it in place"),
    (_Forgets, None, r"'w' is on the meta device and the root module \(_Forgets\)'s initialiser did not set it"),
    (_ReadsFinished, None, r"module 'head' \(_Head\)'s initialiser uses 'fc.weight' .*which an earlier unit "
                           r"initialised"),
    (Mixed, "not callable", r"init_fn must be a callable taking a module"),
])
def test_refusals_name_the_tensor_and_the_fix(world_of_one, make, init_fn, match):
    with pytest.raises((ValueError, TypeError), match=match):
        meta_build(make, init_fn=init_fn)


def test_meta_and_real_parameters_mixed_are_refused(world_of_one):
    with torch.device("meta"):
        model = Mixed()
    model.out = nn.Linear(16, 4)
    with pytest.raises(ValueError, match=r"are on the meta device but \['out.weight', 'out.bias'\] are not"):
        ZeRO3(model)
    with pytest.raises(ValueError, match="init_fn= and device= are for a module built on the meta device"):
        ZeRO3(Mixed(), init_fn=causal_init)


WIDE = 8 * (256 * 256 + 256) * 4  # bytes of the memory check's 8 Linear(256, 256)


def _wide():
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def _ranks(rank, port, out):
    from hybrid.bench import _live

    _live.install()
    init_gloo(rank, port)
    report = {}
    torch.manual_seed(rank)  # each rank's own seed: the build takes rank 0's, as DDP takes its values
    before = _live.live_bytes()
    _live.reset_peak()
    with torch.device("meta"):
        wide = _wide()
    built = ZeRO3(wide, bucket_cap_mb=0.3)
    report["build_peak"] = _live.peak_bytes() - before
    report["slices"] = sum(s.numel() * 4 for s in built._buckets.slices)
    ref = cpu_build(_wide)
    report["wide_same"] = all(torch.equal(built.state_dict()[f"module.{k}"], v) for k, v in ref.state_dict().items())
    del built, wide
    # Training from the meta build equals torch DDP from the CPU build.
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Mixed()
    model = ZeRO3(meta, bucket_cap_mb=1e-3)
    # BatchNorm's statistics stay each rank's own (ZeRO3, like FSDP, does not broadcast buffers).
    ref = torch.nn.parallel.DistributedDataParallel(cpu_build(Mixed), broadcast_buffers=False)
    opt, ref_opt = ZeRO3Optimizer(model, torch.optim.Adam, lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        x = tokens(rank, step, vocab=10)
        for net, o in ((model, opt), (ref, ref_opt)):
            net(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    ours = model.state_dict()
    report["trained_same"] = [k for k, v in ref.state_dict().items() if not torch.equal(ours[k], v)]
    out.put((rank, report, 0.0))


@pytest.mark.timeout(120)
def test_two_ranks_hold_their_slices_and_train_as_ddp(live_counter):
    reports, _ = forkserver_ranks(_ranks, (), 2)
    for rank, (r, _) in sorted(reports.items()):
        print(f"rank {rank}: build peak {r['build_peak']} bytes, slices {r['slices']}, model {WIDE}")
        assert r["wide_same"] and r["trained_same"] == [], r
        assert r["slices"] <= WIDE / 2 + 4 * 8  # half the model, padding at most one element a bucket
        # Its slices, one module materialised (a Linear: 263 KB) and small change: never the model.
        assert r["build_peak"] <= r["slices"] + WIDE // 8 + (16 << 10), r
