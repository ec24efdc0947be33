"""Model pairs the harness tests run (importable, so spawned torch ranks can build them)."""

from __future__ import annotations

import numpy as np

from hybrid.core import ParamMapping, Rule

# The GPT pair, small enough for a few seconds of CPU: 2 blocks of width 32, 64 tokens.
VOCAB, BLOCK = 64, 16


def gpt_config(**kw):
    from hybrid.models import GPTConfig
    return GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, **kw)


def torch_gpt():
    from hybrid.models import TorchGPT
    return TorchGPT(gpt_config()), lambda model, batch: model(batch[0], batch[1])[1]


def _flax(config):
    import jax
    import jax.numpy as jnp
    from hybrid.models import FlaxGPT, flax_loss
    model = FlaxGPT(config)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, BLOCK), jnp.int32))["params"]
    return params, lambda p, batch: flax_loss(model, p, batch[0], batch[1])


def flax_gpt():
    return _flax(gpt_config())


def flax_gpt_default_eps():
    """The broken twin: flax's LayerNorm at its own default epsilon, 1e-6, where torch's is 1e-5."""
    return _flax(gpt_config(layer_norm_eps=1e-6))


def gpt_data(step: int, rows: int = 12):
    """Next-token batches ``(inputs, targets)``, int64 ``(rows, BLOCK)``: each row counts up by 3
    (mod the vocabulary) from a random start, one token in eight random, so the loss falls."""
    rng = np.random.default_rng([7, step])
    tokens = (rng.integers(0, VOCAB, size=(rows, 1)) + 3 * np.arange(BLOCK + 1)) % VOCAB
    noise = rng.random(tokens.shape) < 1 / 8
    tokens[noise] = rng.integers(0, VOCAB, size=int(noise.sum()))
    return tokens[:, :-1], tokens[:, 1:]


# The twin MLP of hybrid.demo: the same names and layouts on both sides (layers.0.weight ...).
MLP_SIZES = (16, 32, 32, 4)
MLP_MAPPING = ParamMapping((Rule("{name}", "{name}", name="the same name and layout"),))


def torch_mlp():
    import torch.nn.functional as F
    from hybrid.demo import TorchMLP
    return TorchMLP(MLP_SIZES), lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])


def jax_mlp():
    from hybrid.demo import cross_entropy, init_params, jax_params
    return jax_params(init_params(0, MLP_SIZES)), lambda params, batch: cross_entropy(params, *batch)


def mlp_data(step: int):
    from hybrid.demo import global_batch
    return global_batch(0, step, MLP_SIZES, 24)
