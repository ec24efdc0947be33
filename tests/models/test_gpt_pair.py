"""The GPT-2-style pair: torch's ``TorchGPT`` and flax's ``FlaxGPT`` with the same weights, crossed
through ``GPT_MAPPING``, give the same logits, loss and gradients, and the weights cross back bitwise.

Tolerances. Both sides compute the same float32 network (matmuls pinned to full float32: no TF32,
JAX "highest") in different orders: torch's CPU GEMM and XLA's dot block their sums differently,
attention's softmax and LayerNorm's mean/variance are composed differently (flax's default
``use_fast_variance`` takes E[x^2] - E[x]^2, torch two passes), and cross-entropy's log-sum-exp
too. Each is an ulp or two per operation over 4 layers. Measured on the default config (0.94M
parameters, batch 4 x 64 tokens; jitted and not): logits within 7.2e-7 to 8.4e-7 absolute
(|logits| <= 1.6), the loss within 1.4e-6 to 1.9e-6 of 6.96 (2.7e-7 relative), gradients within
1.3e-7 absolute (largest entry 0.16). Asserted: logits atol 1e-5, loss rtol 1e-6 (7e-6 absolute),
gradients atol 1e-6 with rtol 1e-4: several times the measured noise, while a real difference
between the two networks fails them: flax's LayerNorm at its default eps 1e-6 instead of GPT-2's
1e-5 moves the logits by 4.7e-3, the loss by 4.2e-5 and the gradients by 5.4e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hybrid.core import MappingError
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig, TorchGPT, flax_loss
from hybrid.parity import jax_to_torch, named_jax, named_torch, pair_models, torch_to_jax

LOGITS_ATOL = 1e-5
LOSS_RTOL = 1e-6
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
B, T = 4, 64


def _batch(config: GPTConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


def _flax_like(model: FlaxGPT):
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]


@pytest.fixture(scope="module")
def crossed():
    """The torch model (seed 0) with its loss's gradients, and the flax tree made from its weights.

    The module's tests run torch on one thread; the worker's thread count comes back after them, so
    later test files in the same pytest process do not inherit it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = GPTConfig()
        torch.manual_seed(0)
        model, flax_model = TorchGPT(config), FlaxGPT(config)
        params = torch_to_jax(model, _flax_like(flax_model), GPT_MAPPING)
        idx, targets = _batch(config)
        logits, loss = model(torch.from_numpy(idx), torch.from_numpy(targets))
        loss.backward()
        yield dict(config=config, model=model, flax_model=flax_model, params=params, idx=idx, targets=targets,
                   logits=logits.detach().numpy(), loss=loss.item())
    finally:
        torch.set_num_threads(threads)


def test_the_default_pair_is_about_a_million_parameters_counted_alike(crossed):
    config, model = crossed["config"], crossed["model"]
    torch_count = sum(p.numel() for p in model.parameters())
    flax_count = sum(x.size for x in jax.tree.leaves(crossed["params"]))
    assert torch_count == flax_count == config.num_params() == 940_800
    pairing = pair_models(model, crossed["params"], GPT_MAPPING)
    assert pairing.torch_names == tuple(n for n, _ in model.named_parameters())
    assert pairing.tied == (("lm_head.weight", "wte.weight"),)
    # The declared mapping alone (no torch module) derives the same names, layouts and tie.
    derived = GPT_MAPPING.pair(named_jax(crossed["params"]))
    assert set(derived.pairs) == set(pairing.pairs) and derived.tied == pairing.tied


def test_same_weights_give_the_same_logits_loss_and_gradients(crossed):
    flax_model, params = crossed["flax_model"], crossed["params"]
    idx, targets = jnp.asarray(crossed["idx"]), jnp.asarray(crossed["targets"])
    logits = np.asarray(jax.jit(lambda p: flax_model.apply({"params": p}, idx))(params))
    np.testing.assert_allclose(logits, crossed["logits"], rtol=0, atol=LOGITS_ATOL)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: flax_loss(flax_model, p, idx, targets)))(params)
    np.testing.assert_allclose(float(loss), crossed["loss"], rtol=LOSS_RTOL)
    pairing = pair_models(crossed["model"], params, GPT_MAPPING)
    torch_grads = named_torch(crossed["model"], grads=True)
    flax_grads = pairing.to_torch(named_jax(grads))  # the tied embedding's gradient holds the head's part on both sides
    assert list(flax_grads) == list(torch_grads)
    for name, g in torch_grads.items():
        np.testing.assert_allclose(flax_grads[name], g, err_msg=name, **GRAD_TOL)


def test_weights_cross_torch_to_flax_to_torch_bitwise(crossed):
    model = crossed["model"]
    fresh = TorchGPT(crossed["config"])
    jax_to_torch(crossed["params"], fresh, GPT_MAPPING)
    before, after = model.state_dict(), fresh.state_dict()
    assert list(after) == list(before) and "lm_head.weight" in after
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
    assert fresh.lm_head.weight is fresh.wte.weight  # still tied: one tensor written once
    # torch's state_dict (the tied alias included) converts as well.
    pairing = pair_models(model, crossed["params"], GPT_MAPPING)
    state = {n: t.numpy() for n, t in before.items()}
    assert list(pairing.to_torch(pairing.to_jax(state), tied=True)) == list(state)


def test_flax_initialised_weights_run_in_torch():
    config = GPTConfig(n_layer=2, n_embd=64, vocab_size=256, block_size=64)
    flax_model = FlaxGPT(config)
    idx, _ = _batch(config, seed=1)
    params = jax.jit(flax_model.init)(jax.random.key(1), jnp.asarray(idx))["params"]
    model = jax_to_torch(params, TorchGPT(config), GPT_MAPPING)
    logits, _ = model(torch.from_numpy(idx))
    flax_logits = jax.jit(flax_model.apply)({"params": params}, jnp.asarray(idx))
    np.testing.assert_allclose(logits.detach().numpy(), np.asarray(flax_logits), rtol=0, atol=LOGITS_ATOL)


def test_a_torch_parameter_the_flax_model_lacks_is_named(crossed):
    model = TorchGPT(crossed["config"])
    model.h[1].attn.register_parameter("c_atn_gate", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(MappingError, match=r"torch tensor 'h.1.attn.c_atn_gate' has no jax counterpart "
                                           r"\(nearest: 'h_1.attn.c_attn.kernel', 'h_1.attn.c_attn.bias'"):
        torch_to_jax(model, crossed["params"], GPT_MAPPING)
