"""The built-in Conv rule and a user's rule, checked against the frameworks' own modules.

A small conv net written in torch (``nn.Conv1d``, grouped strided ``nn.Conv2d``, ``nn.Conv3d``,
``nn.GroupNorm``) and in flax linen (``nn.Conv`` with ``feature_group_count``, ``nn.GroupNorm``):
with the torch weights crossed through ``ParamMapping.flax()`` both give the same outputs
(channels last in flax, first in torch). A custom module (per-head kernels, a layout no built-in
rule knows) is refused by name until the user declares its rule, then crosses both ways.

Tolerance: float32 convolutions, GroupNorm and matmuls summed in different orders by torch's CPU
kernels and XLA's: measured 4.8e-7 absolute on the conv outputs (magnitude 2.9; the bias-free
Conv3d 0.0) and 2.4e-7 on the custom module's (magnitude 4.9); asserted atol 1e-5.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hybrid.core import Layout, MappingError, ParamMapping, Rule
from hybrid.parity import jax_to_torch, named_jax, named_torch, pair_models, torch_to_jax

ATOL = 1e-5


class TorchConvs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(3, 4, kernel_size=3)
        self.conv2 = torch.nn.Conv2d(4, 6, kernel_size=(3, 2), stride=2, groups=2)
        self.norm = torch.nn.GroupNorm(2, 6, eps=1e-5)
        self.conv3 = torch.nn.Conv3d(2, 3, kernel_size=2, bias=False)

    def forward(self, x1, x3):
        y = self.conv1(x1)                               # (B, 4, L)
        y = self.norm(self.conv2(y[:, :, None, :].expand(-1, -1, 5, -1)))
        return y, self.conv3(x3)


class FlaxConvs(nn.Module):
    @nn.compact
    def __call__(self, x1, x3):
        y = nn.Conv(4, kernel_size=(3,), padding="VALID", name="conv1")(x1)
        y = jnp.broadcast_to(y[:, None], (y.shape[0], 5, *y.shape[1:]))
        y = nn.Conv(6, kernel_size=(3, 2), strides=2, padding="VALID", feature_group_count=2, name="conv2")(y)
        y = nn.GroupNorm(num_groups=2, epsilon=1e-5, name="norm")(y)
        return y, nn.Conv(3, kernel_size=(2, 2, 2), padding="VALID", use_bias=False, name="conv3")(x3)


def test_conv_kernels_cross_with_the_built_in_rules():
    torch.manual_seed(0)
    model = TorchConvs()
    with torch.no_grad():  # non-trivial norm parameters, so a mixed-up scale/bias would show
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    rng = np.random.default_rng(0)
    x1 = rng.standard_normal((2, 3, 9)).astype(np.float32)
    x3 = rng.standard_normal((2, 2, 4, 3, 3)).astype(np.float32)
    flax_model = FlaxConvs()
    channels_last = (jnp.asarray(x1.transpose(0, 2, 1)), jnp.asarray(x3.transpose(0, 2, 3, 4, 1)))
    like = jax.eval_shape(flax_model.init, jax.random.key(0), *channels_last)["params"]
    params = torch_to_jax(model, like)
    assert np.asarray(params["conv2"]["kernel"]).shape == (3, 2, 2, 6)  # HWIO, I = in / groups
    rules = {p.torch: p.rule for p in pair_models(model, params).pairs}
    assert rules["conv2.weight"] == "flax Conv kernel (H, W, I, O) / torch Conv2d weight (O, I, H, W)"
    assert rules["conv1.weight"].endswith("Conv1d weight (O, I, W)") and rules["conv3.weight"].endswith("(O, I, D, H, W)")
    y2, y3 = model(torch.from_numpy(x1), torch.from_numpy(x3))
    f2, f3 = flax_model.apply({"params": params}, *channels_last)
    np.testing.assert_allclose(np.asarray(f2), y2.detach().numpy().transpose(0, 2, 3, 1), rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(f3), y3.detach().numpy().transpose(0, 2, 3, 4, 1), rtol=0, atol=ATOL)
    back = named_torch(jax_to_torch(params, TorchConvs()))
    assert all(np.array_equal(back[n], v) for n, v in named_torch(model).items())


class TorchHeads(torch.nn.Module):
    """torch: one (heads * head_dim, in) matrix, ``x @ proj.T``."""

    def __init__(self, d_in=6, heads=3, head_dim=4):
        super().__init__()
        self.mix = torch.nn.Linear(d_in, d_in)
        self.proj = torch.nn.Parameter(torch.randn(heads * head_dim, d_in))

    def forward(self, x):
        return self.mix(x) @ self.proj.T


class FlaxHeads(nn.Module):
    """flax: a custom module keeping one (in, head_dim) kernel per head, ``w`` of shape (heads, in, head_dim)."""

    heads: int = 3
    head_dim: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(x.shape[-1], name="mix")(x)
        w = self.param("w", nn.initializers.normal(1.0), (self.heads, x.shape[-1], self.head_dim))
        return jnp.einsum("bd,hdk->bhk", x, w).reshape(x.shape[0], -1)


def test_a_user_rule_places_a_custom_module():
    torch.manual_seed(0)
    model = TorchHeads()
    flax_model = FlaxHeads()
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    like = jax.eval_shape(flax_model.init, jax.random.key(0), jnp.asarray(x))["params"]
    with pytest.raises(MappingError, match=r"2 tensors cannot be placed:\n  jax tensor 'w' of shape \(3, 6, 4\) matches "
                                           r"no rule \(no similar names\): add a Rule for its module\n  torch tensor "
                                           r"'proj' has no jax counterpart"):
        torch_to_jax(model, like)
    # (heads, in, head_dim) -> (heads, head_dim, in) -> (heads * head_dim, in): row h * head_dim + k is head h's k.
    mapping = ParamMapping.flax([Rule("w", "proj", Layout.transpose(0, 2, 1).then(Layout.reshape(-1, 6)),
                                      name="per-head kernel / Linear-style weight")])
    params = torch_to_jax(model, like, mapping)
    np.testing.assert_allclose(np.asarray(flax_model.apply({"params": params}, x)),
                               model(torch.from_numpy(x)).detach().numpy(), rtol=0, atol=ATOL)
    back = named_torch(jax_to_torch(params, TorchHeads(), mapping))
    assert all(np.array_equal(back[n], v) for n, v in named_torch(model).items())
    assert list(named_jax(params)) == ["mix.bias", "mix.kernel", "w"]
