"""Every dtype torch has for a model's tensors, through every checkpoint path, bit for bit.

A table of dtypes: the float types (float64/32/16, bfloat16), complex (complex128/64/32), the float8
types (e4m3fn, e5m2 as torchao's float8 training holds them, and the fnuz / e8m0 variants), every
integer type and bool. The trainable ones are parameters stepped once by Adam and by SGD with
momentum (their state in the same dtype, as torch keeps it); the others are frozen parameters (the
only kind an integer parameter can be) and buffers of every dtype. Each path must give back the
same bits (compared as bytes: NaN patterns of random bits included), so the tolerance is zero:

- hybrid's own format, saved from one process at 1 and 2 rank files and loaded;
- torch DCP written by torch's own ``dcp.save``, loaded by hybrid directly and through
  ``convert --to hybrid``; and a hybrid checkpoint converted ``--to dcp`` read back by torch's own
  ``dcp.load`` + ``set_state_dict``;
- JAX, where it has the type (bfloat16, complex64, float8 through ml_dtypes), both ways; a clear
  refusal naming the tensor where it does not (complex32; the 64-bit types without x64);
- a dtype no checkpoint holds (a quantized tensor) is refused, naming it, before anything is written.

All in this process (no gloo world: nothing here is a collective).
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from hybrid.checkpoint import CheckpointError, convert, open_checkpoint
from hybrid.checkpoint.torch import load, save

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental", "ignore:torch.quantize_per_tensor")

TRAINABLE = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64")
FROZEN = ("complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
          "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")
EVERY = TRAINABLE + FROZEN


def _random(dtype: str, n: int = 6, seed: int = 0) -> torch.Tensor:
    """``n`` elements of random bits (NaNs, infinities and subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    t = getattr(torch, dtype)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=t).element_size(),), dtype=torch.uint8, generator=g)
    return raw % 2 == 1 if t == torch.bool else raw.view(t)


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.numpy().tobytes() if t.dtype == torch.bool else t.view(torch.uint8).numpy().tobytes()


def _model(seed: int) -> nn.Module:
    m = nn.Module()
    for i, dtype in enumerate(TRAINABLE):
        g = torch.Generator().manual_seed(seed * 100 + i)
        m.register_parameter(f"p_{dtype}", nn.Parameter(torch.randn(6, generator=g, dtype=getattr(torch, dtype))))
    for i, dtype in enumerate(FROZEN):
        m.register_parameter(f"f_{dtype}", nn.Parameter(_random(dtype, seed=seed * 100 + i), requires_grad=False))
    for i, dtype in enumerate(EVERY):
        m.register_buffer(f"b_{dtype}", _random(dtype, seed=seed * 100 + 50 + i))
    return m


def _optimizer(model: nn.Module, kind: str):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.Adam(params, lr=0.1) if kind == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _trained(kind: str):
    model = _model(seed=1)
    opt = _optimizer(model, kind)
    for i, dtype in enumerate(TRAINABLE):
        g = torch.Generator().manual_seed(7 + i)
        getattr(model, f"p_{dtype}").grad = torch.randn(6, generator=g, dtype=getattr(torch, dtype))
    opt.step()
    return model, opt


def _assert_same(model, opt, model2, opt2):
    sd, sd2 = model.state_dict(), model2.state_dict()
    assert list(sd) == list(sd2)
    for name in sd:
        assert sd2[name].dtype == sd[name].dtype, name
        assert _bits(sd2[name]) == _bits(sd[name]), name
    if opt is None:
        return
    for p, p2 in zip((p for p in model.parameters() if p.requires_grad),
                     (p for p in model2.parameters() if p.requires_grad)):
        state, state2 = opt.state[p], opt2.state[p2]
        assert sorted(state) == sorted(state2)
        for key, value in state.items():
            assert value.dtype == state2[key].dtype and _bits(value) == _bits(state2[key]), (p.dtype, key)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_dtype_saves_and_loads_bit_for_bit(tmp_path, kind, world_size):
    model, opt = _trained(kind)
    manifest = save(tmp_path / "ckpt", model, opt, step=1, world_size=world_size)
    recorded = {s.name: s.dtype for s in manifest.plan.specs} | {n: e["dtype"] for n, e in manifest.buffers.items()}
    assert recorded == {n: str(t.dtype).removeprefix("torch.") for n, t in model.state_dict().items()}
    model2 = _model(seed=2)
    opt2 = _optimizer(model2, kind)
    assert load(tmp_path / "ckpt", model2, opt2) == 1
    _assert_same(model, opt, model2, opt2)


def test_a_complex_tensor_is_its_real_view_to_safetensors(tmp_path):
    """Any safetensors reader opens the file: a complex tensor is its real view ``[n, 2]`` (as
    ``torch.view_as_real``), bfloat16 and float8 their bits; the header names the true dtypes."""
    from safetensors.numpy import load_file

    m = nn.Linear(2, 2)
    m.register_buffer("f", torch.tensor([1 + 2j, 3 - 4j, 0.5j], dtype=torch.complex64))
    m.register_buffer("h", _random("bfloat16"))
    m.register_buffer("e", _random("float8_e4m3fn"))
    save(tmp_path / "ckpt", m, step=0, world_size=1)  # the repro: KeyError 'complex64' before
    file = tmp_path / "ckpt" / "rank-00000-of-00001.safetensors"
    arrays = load_file(file)
    np.testing.assert_array_equal(arrays["buffers/f"], torch.view_as_real(m.f).numpy())
    assert arrays["buffers/h"].dtype == np.uint16 and arrays["buffers/h"].tobytes() == _bits(m.h)
    assert arrays["buffers/e"].dtype == np.uint8 and arrays["buffers/e"].tobytes() == _bits(m.e)
    n = int.from_bytes(file.read_bytes()[:8], "little")
    meta = json.loads(file.read_bytes()[8:8 + n])["__metadata__"]
    assert json.loads(meta["hybrid.dtypes"]) == {"buffers/f": "complex64", "buffers/h": "bfloat16",
                                                 "buffers/e": "float8_e4m3fn"}


def test_the_llama_complex_buffer_round_trips(tmp_path):
    from hybrid.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    opt.step()
    save(tmp_path / "ckpt", model, opt, step=1, world_size=2)
    torch.manual_seed(1)
    with torch.device("meta"):
        fresh = Llama(LlamaConfig(n_layers=1))
    fresh.to_empty(device="cpu")  # freqs_cis: uninitialised memory, which the load must fill
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load(tmp_path / "ckpt", fresh, fresh_opt)
    assert fresh.freqs_cis.dtype == torch.complex64
    _assert_same(model, None, fresh, None)


def _unsaveable():
    m = nn.Linear(2, 2)
    m.register_buffer("q", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8))
    return m


def test_a_dtype_no_checkpoint_holds_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"tensor 'q' is qint8, which hybrid checkpoints do not hold.*nothing "
                                              r"was written"):
        save(tmp_path / "ckpt", _unsaveable(), step=0, world_size=2)
    assert list(tmp_path.iterdir()) == []  # no files, no .ckpt.saving


def test_optimizer_state_in_another_dtype_than_its_parameter_is_refused_first(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.state[model.weight]["momentum_buffer"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"'momentum_buffer' of 'weight' is torch.bfloat16, its parameter"):
        save(tmp_path / "ckpt", model, opt, step=1, world_size=2)
    assert list(tmp_path.iterdir()) == []


# -- torch DCP, both ways ---------------------------------------------------------------------------

def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process, as intended
        dcp.save(state, checkpoint_id=os.fspath(path), no_dist=True)


def _dcp_load(path, kind):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model(seed=3)
    opt = _optimizer(model, kind)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_every_dtype_crosses_dcp_both_ways(tmp_path, kind):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _trained(kind)
    model_sd, optim_sd = get_state_dict(model, opt)
    _dcp_save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(1)}, tmp_path / "dcp")
    # In: read directly, and converted to hybrid's format (2 rank files).
    direct, direct_opt = _model(seed=2), None
    direct_opt = _optimizer(direct, kind)
    assert load(tmp_path / "dcp", direct, direct_opt) == 1
    _assert_same(model, opt, direct, direct_opt)
    convert(tmp_path / "dcp", tmp_path / "hybrid", to="hybrid", world_size=2)
    model2 = _model(seed=2)
    opt2 = _optimizer(model2, kind)
    load(tmp_path / "hybrid", model2, opt2)
    _assert_same(model, opt, model2, opt2)
    # Out: the hybrid checkpoint as DCP, read by torch's own dcp.load + set_state_dict.
    convert(tmp_path / "hybrid", tmp_path / "dcp2", to="dcp")
    model3, opt3 = _dcp_load(tmp_path / "dcp2", kind)
    _assert_same(model, opt, model3, opt3)


# -- JAX --------------------------------------------------------------------------------------------

JAX_PARAMS = ("float32", "bfloat16", "float16")
JAX_HAS = ("float32", "float16", "bfloat16", "complex64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
           "float8_e5m2fnuz", "float8_e8m0fnu", "int32", "int16", "int8", "uint32", "uint16", "uint8", "bool")


def test_every_dtype_jax_has_crosses_to_jax_and_back(tmp_path):
    import jax.numpy as jnp

    from hybrid.checkpoint import jax as jax_ckpt

    model = nn.Module()
    for i, dtype in enumerate(JAX_HAS):
        model.register_buffer(f"b_{dtype}", _random(dtype, seed=i))
    # hybrid.jax plans floating-point parameters only (its planner refuses a complex leaf): complex
    # crosses as a buffer (torchtitan's freqs_cis is one).
    for dtype in JAX_PARAMS:
        model.register_parameter(f"p_{dtype}", nn.Parameter(_random(dtype, seed=99)))
    save(tmp_path / "torch", model, step=4, world_size=2)
    params_like = {f"p_{d}": jnp.zeros(6, d) for d in JAX_PARAMS}
    buffers_like = {f"b_{d}": jnp.zeros(6, d) for d in JAX_HAS}
    params, _, step = jax_ckpt.load(tmp_path / "torch", params_like)
    buffers = jax_ckpt.load_buffers(tmp_path / "torch", buffers_like)
    assert step == 4
    for name, value in {**params, **buffers}.items():
        t = getattr(model, name)
        assert str(value.dtype) == str(t.dtype).removeprefix("torch.") and np.asarray(value).tobytes() == _bits(t), name
    # Back: JAX saves them (ml_dtypes arrays), torch loads them.
    jax_ckpt.save(tmp_path / "jax", params, step=5, world_size=2, buffers=buffers)
    back = nn.Module()
    for name, t in model.state_dict().items():
        if name.startswith("p_"):
            back.register_parameter(name, nn.Parameter(torch.zeros_like(t)))
        else:
            back.register_buffer(name, torch.zeros_like(t))
    assert load(tmp_path / "jax", back) == 5
    _assert_same(model, None, back, None)


def test_what_jax_cannot_hold_is_refused_naming_the_tensor(tmp_path):
    import jax.numpy as jnp

    from hybrid.checkpoint import jax as jax_ckpt

    model = nn.Linear(2, 2)
    model.register_buffer("c", _random("complex32"))
    save(tmp_path / "c", model, step=0)
    with pytest.raises(CheckpointError, match=r"buffer 'c' is complex32, and JAX has no complex32 type"):
        jax_ckpt.load_buffers(tmp_path / "c", {"c": jnp.zeros(6, jnp.complex64)})
    save(tmp_path / "f64", nn.Linear(2, 2).double(), step=0)
    with pytest.raises(CheckpointError, match=r"tensor '(weight|bias)' is float64, and JAX holds float64 only with "
                                              r"jax.config.update\('jax_enable_x64', True\)"):
        jax_ckpt.load(tmp_path / "f64", {"weight": jnp.zeros((2, 2)), "bias": jnp.zeros(2)})


def test_doctests_of_the_dtype_modules():
    import doctest
    import importlib

    for name in ("hybrid.checkpoint._dtypes", "hybrid.checkpoint.torch._dtypes", "hybrid.checkpoint.jax._tree",
                 "hybrid.checkpoint._other_state", "hybrid.checkpoint.torch._other_state"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.attempted > 0 and result.failed == 0, name


def test_open_checkpoint_reports_the_true_dtypes(tmp_path):
    model, opt = _trained("adam")
    save(tmp_path / "ckpt", model, opt, step=1, world_size=2)
    m = open_checkpoint(tmp_path / "ckpt").manifest
    assert {s.dtype for s in m.plan.specs} == set(TRAINABLE)
    assert {e["dtype"] for e in m.buffers.values()} == set(EVERY)


def test_bfloat16_adam_state_crosses_to_optax(tmp_path):
    """torch's Adam keeps a bfloat16 parameter's moments in bfloat16, as optax.adam does."""
    import jax.numpy as jnp
    import optax

    from hybrid.checkpoint import jax as jax_ckpt

    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    save(tmp_path / "ckpt", model, opt, step=1, world_size=2)
    like = {"weight": jnp.zeros((2, 3), jnp.bfloat16), "bias": jnp.zeros(2, jnp.bfloat16)}
    params, state, step = jax_ckpt.load(tmp_path / "ckpt", like, optax.adam(0.1).init(like))
    assert step == 1
    for name, p in model.named_parameters():
        assert np.asarray(params[name]).tobytes() == _bits(p)
        assert np.asarray(state[0].mu[name]).tobytes() == _bits(opt.state[p]["exp_avg"])
        assert np.asarray(state[0].nu[name]).tobytes() == _bits(opt.state[p]["exp_avg_sq"])
