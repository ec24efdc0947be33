"""hybrid.core's declared torch/JAX mapping over names and shapes: rules, layouts, ties, errors.

Layouts are permutations and re-viewings of the same elements, so every conversion back is
checked bitwise (``np.array_equal`` on float32 with NaN-free random values, and dtype equality).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.core import FLAX_RULES, Layout, MappingError, ParamMapping, ParamPairing, Rule

GPT_JAX = {"wte.embedding": (32, 8), "wpe.embedding": (16, 8), "h_0.ln_1.scale": (8,), "h_0.ln_1.bias": (8,),
           "h_0.attn.c_attn.kernel": (8, 24), "h_0.attn.c_attn.bias": (24,), "ln_f.scale": (8,), "ln_f.bias": (8,)}
GPT_TORCH = {"wte.weight": (32, 8), "wpe.weight": (16, 8), "h.0.ln_1.weight": (8,), "h.0.ln_1.bias": (8,),
             "h.0.attn.c_attn.weight": (24, 8), "h.0.attn.c_attn.bias": (24,), "ln_f.weight": (8,),
             "ln_f.bias": (8,)}
TIED = {"lm_head.weight": "wte.weight"}


def _arrays(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def test_flax_rules_place_a_gpt_block_in_torch_order():
    pairing = ParamMapping.flax(tied=TIED).pair(GPT_JAX, GPT_TORCH)
    assert pairing.torch_names == tuple(GPT_TORCH)
    assert {p.jax: p.torch for p in pairing.pairs} == dict(zip(GPT_JAX, GPT_TORCH))
    assert str(pairing.pairs[4].layout) == "transpose(1, 0)" and pairing.tied == (("lm_head.weight", "wte.weight"),)
    # Without torch's names the rules derive them, reading "ln_1" as linen's name of a list's item 1
    # unless a rename keeps it: then the same pairing, in the JAX order.
    assert ParamMapping.flax().pair(GPT_JAX).torch_name("h_0.ln_1.scale") == "h.0.ln.1.weight"
    derived = ParamMapping.flax(tied=TIED, renames={"ln_1": "ln_1"}).pair(GPT_JAX)
    assert derived.torch_names == pairing.torch_names and derived.tied == pairing.tied


def test_round_trip_is_bitwise_and_tied_aliases_cross():
    pairing = ParamMapping.flax(tied=TIED).pair(GPT_JAX, GPT_TORCH)
    torch_side = _arrays(GPT_TORCH)
    state_dict = pairing.to_torch(pairing.to_jax(torch_side), tied=True)
    assert list(state_dict) == list(GPT_TORCH) + ["lm_head.weight"]
    assert state_dict["lm_head.weight"] is state_dict["wte.weight"]
    for name, value in torch_side.items():
        assert state_dict[name].dtype == value.dtype and np.array_equal(state_dict[name], value), name
    # A state_dict (alias included) converts too; the alias must hold its source's values.
    back = pairing.to_jax({**torch_side, "lm_head.weight": torch_side["wte.weight"].copy()})
    assert np.array_equal(back["h_0.attn.c_attn.kernel"], torch_side["h.0.attn.c_attn.weight"].T)
    with pytest.raises(MappingError, match="'lm_head.weight' is tied to 'wte.weight' but holds other values"):
        pairing.to_jax({**torch_side, "lm_head.weight": torch_side["wte.weight"] + 1})


def test_unplaceable_tensors_are_errors_naming_them_and_the_nearest_names():
    extra_torch = {**GPT_TORCH, "h.0.attn.rel_bias": (4,)}
    with pytest.raises(MappingError, match=r"torch tensor 'h.0.attn.rel_bias' has no jax counterpart "
                                           r"\(nearest: 'h_0.attn.c_attn.bias'"):
        ParamMapping.flax().pair(GPT_JAX, extra_torch)
    typo = {("h.0.attn.c_atn.weight" if n == "h.0.attn.c_attn.weight" else n): s for n, s in GPT_TORCH.items()}
    with pytest.raises(MappingError) as e:
        ParamMapping.flax().pair(GPT_JAX, typo)
    assert ("jax tensor 'h_0.attn.c_attn.kernel': rule 'flax Dense kernel (in, out) / torch Linear weight (out, in)' "
            "names it 'h.0.attn.c_attn.weight' on the torch side, and torch has no such tensor (nearest: "
            "'h.0.attn.c_atn.weight'") in str(e.value)
    assert "torch tensor 'h.0.attn.c_atn.weight' has no jax counterpart (nearest: 'h_0.attn.c_attn.kernel'" in str(e.value)
    with pytest.raises(MappingError, match=r"jax tensor 'h_0.attn.w' of shape \(8, 8\) matches no rule "
                                           r"\(nearest: 'h.0.attn.c_attn.weight'.*add a Rule"):
        ParamMapping.flax().pair({**GPT_JAX, "h_0.attn.w": (8, 8)}, GPT_TORCH)


def test_conversions_refuse_missing_unknown_and_misshapen_arrays():
    pairing = ParamMapping.flax().pair(GPT_JAX, GPT_TORCH)
    arrays = _arrays(GPT_TORCH)
    del arrays["ln_f.bias"]
    arrays["ln_f.biass"] = np.zeros(8, np.float32)
    with pytest.raises(MappingError, match=r"(?s)torch tensor 'ln_f.biass' has no place in the pairing \(nearest: "
                                           r"'ln_f.bias'.*torch tensor 'ln_f.bias' is missing"):
        pairing.to_jax(arrays)
    with pytest.raises(MappingError, match=r"jax tensor 'wpe.embedding' has shape \(8, 16\), the pairing \(16, 8\)"):
        pairing.to_torch({**_arrays(GPT_JAX), "wpe.embedding": np.zeros((8, 16), np.float32)})


def test_shape_mismatch_names_the_rule_and_a_user_rule_overrides_it():
    # HF GPT-2's Conv1D keeps its weight (in, out), as flax does: the built-in Dense rule transposes.
    hf_torch = {"h.0.attn.c_attn.weight": (8, 24)}
    with pytest.raises(MappingError, match=r"makes it torch shape \(24, 8\), but torch's 'h.0.attn.c_attn.weight' "
                                           r"has shape \(8, 24\): add a rule"):
        ParamMapping.flax().pair({"h_0.attn.c_attn.kernel": (8, 24)}, hf_torch)
    conv1d = Rule("{module}.kernel", "{module}.weight", ndim=2, name="HF Conv1D (in, out)")
    pairing = ParamMapping.flax([conv1d]).pair({"h_0.attn.c_attn.kernel": (8, 24)}, hf_torch)
    assert pairing.pairs[0].rule == "HF Conv1D (in, out)" and pairing.pairs[0].layout == Layout()


def test_user_rule_renames_and_reshapes_a_custom_module():
    # A custom flax module keeps per-head kernels (heads, in, head_dim); its torch twin one (heads * head_dim, in).
    rule = Rule("{module}.w", "{module}.proj", Layout.transpose(0, 2, 1).then(Layout.reshape(-1, 6)), name="Heads")
    mapping = ParamMapping.flax([rule], renames={"attention": "attn"})
    pairing = mapping.pair({"blocks_1.attention.w": (3, 6, 4)}, {"blocks.1.attn.proj": (12, 6)})
    w = np.random.default_rng(0).standard_normal((3, 6, 4)).astype(np.float32)
    torch_w = pairing.to_torch({"blocks_1.attention.w": w})["blocks.1.attn.proj"]
    assert np.array_equal(torch_w[4 * 2 + 1], w[2, :, 1])  # row h * head_dim + k is head h's column k
    assert np.array_equal(pairing.to_jax({"blocks.1.attn.proj": torch_w})["blocks_1.attention.w"], w)
    with pytest.raises(MappingError, match="rule 'Heads' matches it, but its layout does not fit: cannot reshape"):
        mapping.pair({"x.w": (3, 5, 3)})


def test_list_names_and_literal_names_both_cross():
    jax = {"conv_1.kernel": (3, 3, 2, 4), "h_0.bias": (4,)}
    pairing = ParamMapping.flax().pair(jax, {"conv_1.weight": (4, 2, 3, 3), "h.0.bias": (4,)})
    assert pairing.torch_names == ("conv_1.weight", "h.0.bias")
    assert ParamMapping.flax().pair(jax).torch_names == ("conv.1.weight", "h.0.bias")  # linen's list convention
    with pytest.raises(MappingError, match=r"could mean any of the torch tensors \['h.0.bias', 'h_0.bias'\]"):
        ParamMapping.flax().pair({"h_0.bias": (4,)}, {"h.0.bias": (4,), "h_0.bias": (4,)})


def test_tied_declarations_are_checked():
    with pytest.raises(MappingError, match=r"tied 'lm_head.weight' has shape \(8, 32\), its source 'wte.weight' "
                                           r"\(32, 8\)"):
        ParamMapping.flax(tied=TIED).pair(GPT_JAX, {**GPT_TORCH, "lm_head.weight": (8, 32)})
    with pytest.raises(MappingError, match="'wte.weight' is no torch tensor of the pairing"):
        ParamMapping.flax(tied=TIED).pair({"ln_f.scale": (8,)})


def test_rule_and_layout_validation():
    with pytest.raises(ValueError, match="both templates must use the same fields"):
        Rule("{a}.kernel", "{b}.weight")
    with pytest.raises(ValueError, match="permutation"):
        Layout.transpose(0, 0)
    with pytest.raises(ValueError, match="at most one -1"):
        Layout.reshape(-1, -1)
    with pytest.raises(TypeError, match="rules must be Rule objects"):
        ParamMapping(rules=("{m}.kernel",))


def test_mapping_and_pairing_are_json_round_trippable():
    mapping = ParamMapping.flax([Rule("{m}.w", "{m}.proj", Layout.transpose(1, 0), ndim=2)], renames={"a": "b"},
                                tied=TIED)
    assert ParamMapping.from_json(json.loads(json.dumps(mapping.to_json()))) == mapping
    pairing = mapping.pair(GPT_JAX, GPT_TORCH)
    again = ParamPairing.from_json(pairing.dumps())
    assert again == pairing and again.fingerprint() == pairing.fingerprint()
    assert ParamMapping.flax().pair(GPT_JAX).fingerprint() != pairing.fingerprint()
    assert len(FLAX_RULES) == 7


@st.composite
def _layouts(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    steps, current = [], shape
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            axes = tuple(draw(st.permutations(range(len(current)))))
            steps.append(("transpose", axes))
            current = tuple(current[a] for a in axes)
        else:
            size = int(np.prod(current))
            first = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
            new = (first, -1) if draw(st.booleans()) else (first, size // first)
            steps.append(("reshape", new))
            current = (first, size // first)
    return shape, Layout(tuple(steps)), current


@settings(max_examples=60, deadline=None)
@given(_layouts())
def test_every_layout_is_exactly_invertible(case):
    shape, layout, torch_shape = case
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = layout.to_torch(x)
    assert layout.torch_shape(shape) == torch_shape == y.shape
    back = layout.to_jax(y, shape)
    assert back.dtype == x.dtype and np.array_equal(back, x)
    # The same steps on a torch tensor (permute, not transpose) give the same values.
    torch = pytest.importorskip("torch")
    assert np.array_equal(layout.to_torch(torch.from_numpy(x)).numpy(), y)
