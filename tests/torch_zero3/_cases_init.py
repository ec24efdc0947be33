"""Cases for the model's own whole-model initialiser on a meta build (issue 44, item 3), run in the
worlds of ``test_zero3_dist`` (``_cases`` merges them). The oracle is a CPU build of the same model
followed by the same call under the same RNG state: torchtitan's ``init_weights()`` on the Llama
decoder (complex64 ``freqs_cis`` reassigned included), bit for bit (``torch.equal``) at every world
size, since every rank runs the same draws on the CPU and keeps its elements; the RNG ends where the
CPU build leaves it. An initialiser that uses a parameter again after others (a gather back from the
slices) and GPT's tied head too. The init's peak of live CPU tensor bytes (hybrid.bench._live's
allocator counter) is bounded by this rank's slices plus the largest parameter and the buffers.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from hybrid.models import GPTConfig, Llama, LlamaConfig, TorchGPT
from hybrid.torch import ZeRO3

SEED_BUILD, SEED_INIT = 0, 5  # the init runs under another RNG state than the build, as after to_empty()


def _same_as_cpu_build(make, call, *, zero3: dict | None = None) -> ZeRO3:
    """Meta build + ``ZeRO3(init_fn=call(meta))`` against a CPU build + ``call(cpu)()``."""
    torch.manual_seed(SEED_BUILD)
    with torch.device("meta"):
        meta = make()
    torch.manual_seed(SEED_INIT)
    model = ZeRO3(meta, init_fn=call(meta), **(zero3 or {}))
    rng_after = torch.get_rng_state()
    torch.manual_seed(SEED_BUILD)
    ref = make()
    torch.manual_seed(SEED_INIT)
    call(ref)()
    assert torch.equal(rng_after, torch.get_rng_state()), "the RNG is not where the CPU build's init leaves it"
    ours = model.state_dict()
    want = ref.state_dict()
    assert list(ours) == [f"module.{k}" for k in want]
    for k, v in want.items():
        assert ours[f"module.{k}"].dtype == v.dtype and torch.equal(ours[f"module.{k}"], v), k
    return model


CALLS = {
    "bound": lambda m: m.init_weights,  # torchtitan's model.init_weights(buffer_device=None)
    "buffer_device": lambda m: functools.partial(m.init_weights, buffer_device=torch.device("cpu")),
    "lambda": lambda m: (lambda: m.init_weights()),
}


def llama_init(rank: int, world_size: int, *, call: str, zero3: dict) -> None:
    model = _same_as_cpu_build(lambda: Llama(LlamaConfig()), CALLS[call], zero3=zero3)
    assert model.module.freqs_cis.dtype == torch.complex64 and model.module.freqs_cis.device.type == "cpu"
    assert all(not p.is_meta for p in model.module.buffers())


def gpt_tied_whole(rank: int, world_size: int) -> None:
    """GPT's init_weights() (module=None: the whole model) writes the tied head twice."""
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = _same_as_cpu_build(lambda: TorchGPT(config), lambda m: m.init_weights, zero3={"bucket_cap_mb": 1e-3})
    assert model.module.lm_head.weight is model.module.wte.weight


class Revisits(nn.Module):
    """An initialiser that comes back to parameters it left: scales ``a`` after setting ``b`` from
    it, and initialises ``c`` through a view held across another parameter's init."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(7, 5)
        self.c = nn.Parameter(torch.empty(4, 3))
        self.register_buffer("scale", torch.ones(5))

    def init_weights(self):
        nn.init.normal_(self.a.weight)
        nn.init.uniform_(self.a.bias)
        flat_c = self.c.view(-1)  # alive while b is set: c must not be finished under it
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight * 2)
            self.b.bias.zero_()
            flat_c.uniform_(-1, 1)
            self.a.weight.mul_(0.5)  # a again, after b: gathered back from the slices
            self.scale.fill_(3.0)
        nn.init.normal_(self.a.bias)  # overwritten whole: back without its values


def revisits(rank: int, world_size: int) -> None:
    """Equal to the CPU build; ``a.weight`` read twice after others (gathered back twice: a
    collective at every world size above 1), ``a.bias`` overwritten whole (not gathered)."""
    from hybrid.torch.zero.zero3 import _init_whole

    gathered, gather = [], _init_whole._Gatherer.gather
    _init_whole._Gatherer.gather = lambda self, e: (gathered.append(e.name), gather(self, e))[1]
    try:
        _same_as_cpu_build(Revisits, lambda m: m.init_weights, zero3={"bucket_cap_mb": 1e-4})
    finally:
        _init_whole._Gatherer.gather = gather
    assert gathered == ["a.weight", "a.weight"], gathered


class _Forgets(nn.Linear):
    """Its init_weights() is Linear's reset_parameters(): the extra parameter stays unset."""

    def __init__(self):
        super().__init__(3, 3)
        self.w = nn.Parameter(torch.empty(3))

    init_weights = nn.Linear.reset_parameters


class _ReadsUnset(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def init_weights(self):
        with torch.no_grad():
            self.fc.weight.mul_(2)  # a CPU build's constructor values; a meta build has none
            self.fc.bias.zero_()


def whole_init_refusals(rank: int, world_size: int) -> None:
    for make, match in ((_Forgets, r"\['w'\] is on the meta device and the root module \(_Forgets\)'s whole-model "
                                   r"initialiser init_fn\(\) did not set it"),
                        (_ReadsUnset, r"reads 'fc.weight' \(aten::mul_\) before setting it")):
        with torch.device("meta"):
            meta = make()
        with pytest.raises(ValueError, match=match):
            ZeRO3(meta, init_fn=meta.init_weights)


# A Llama of 3.7M parameters (14 MiB) in 16 layers, its largest parameter 0.5 MiB: big enough that the
# bound (slices, buffers, the largest parameter, the init's 1.6 MiB of temporaries and 1 MiB) stays
# well under the whole model at 2 and 3 ranks (10.2 and 7.9 of 14 MiB; peaks seen 9.3 and 6.9), so an
# init that held the whole model fails it; the 56 MiB model it was spent ~0.8 s of CPU per rank and
# world drawing numbers (0.2 s now).
BIG = LlamaConfig(vocab_size=1024, dim=128, n_layers=16, n_heads=8, hidden_dim=384, max_seq_len=512)


def whole_init_memory(rank: int, world_size: int) -> None:
    """The peak of live CPU tensor bytes while ``ZeRO3(meta, init_fn=meta.init_weights)``
    initialises: at most this rank's slices, the buffers, the largest parameter, what the same
    ``init_weights()`` allocates beside the model it initialises on a CPU build (``trunc_normal_``'s
    rejection masks and redraws: ~3.75x the parameter it draws) and 1 MiB."""
    from hybrid.bench import _live
    from hybrid.torch.zero.zero3 import _model

    _live.install()
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Llama(BIG)
    largest = max(p.numel() * 4 for p in meta.parameters())
    seen = {}

    def materialise(*args, **kwargs):  # the init alone: ZeRO3's own buffers come after it
        before = _live.live_bytes()
        _live.reset_peak()
        slices = real(*args, **kwargs)
        seen["peak"] = _live.peak_bytes() - before
        return slices

    real, _model.materialise = _model.materialise, materialise
    try:
        model = ZeRO3(meta, init_fn=meta.init_weights)
    finally:
        _model.materialise = real
    peak = seen["peak"]
    cpu = Llama(BIG)
    before = _live.live_bytes()
    _live.reset_peak()
    cpu.init_weights()
    transient = _live.peak_bytes() - before  # the initialiser's own temporaries, on a CPU build
    del cpu
    slices = sum(s.numel() * s.element_size() for s in model._buckets.slices)
    buffers = sum(b.numel() * b.element_size() for b in model.module.buffers())
    whole = BIG.num_params() * 4
    print(f"rank {rank}/{world_size}: init peak {peak / 2**20:.2f} MiB; slices {slices / 2**20:.2f} MiB, buffers "
          f"{buffers / 2**20:.2f} MiB, largest parameter {largest / 2**20:.2f} MiB, the CPU build's init_weights() "
          f"temporaries {transient / 2**20:.2f} MiB, model {whole / 2**20:.2f} MiB")
    assert peak <= slices + buffers + largest + transient + (1 << 20), (peak, slices, buffers, largest, transient)
    if world_size > 1:
        assert peak < whole / world_size + whole / 4, "the init held about the whole model"


CASES = {f"whole_init[llama-{call}-{layout}]": functools.partial(llama_init, call=call, zero3=zero3)
         for call in CALLS for layout, zero3 in (("default", {}), ("buckets", {"bucket_cap_mb": 0.05}),
                                                 ("memory_policy", {"policy": "memory"}))
         if call == "bound" or layout == "buckets"}
CASES["whole_init[gpt_tied]"] = gpt_tied_whole
CASES["whole_init[revisits]"] = revisits
CASES["whole_init[refusals]"] = whole_init_refusals
CASES["whole_init[zz_memory]"] = whole_init_memory  # last in its world: it installs the allocator counter
