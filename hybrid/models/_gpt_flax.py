"""The GPT-2-style decoder as flax users write it: linen's ``Embed``, ``LayerNorm`` and ``Dense``.

The same network as :class:`hybrid.models.TorchGPT`, in flax's names and layouts: ``Dense`` keeps
its ``kernel`` as ``(in, out)``, ``LayerNorm`` its ``scale`` and ``bias``, ``Embed`` its
``embedding``; the blocks are a list attribute set up in ``setup`` (linen names them ``h_0``,
``h_1``, ...), and the LM head is ``wte.attend``, the token embedding used a second time.
``hybrid.models.GPT_MAPPING`` pairs every parameter with the torch model's.

Written with ``flax.linen``: the API most flax code and checkpoints use, whose parameters are a
plain pytree that ``hybrid.jax``'s optax transforms and ``hybrid.checkpoint.jax`` take as they
are. (flax's newer ``nnx`` holds them in module objects; ``nnx.split`` gives the same kind of tree.)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import optax

from hybrid.models._config import GPTConfig


def _normal(config: GPTConfig, residual: bool = False):
    std = config.init_std / math.sqrt(2 * config.n_layer) if residual else config.init_std
    return nn.initializers.normal(stddev=std)


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        B, T, C = x.shape
        H = self.config.n_head
        qkv = nn.Dense(3 * C, kernel_init=_normal(self.config), name="c_attn")(x)
        q, k, v = (t.reshape(B, T, H, C // H) for t in jnp.split(qkv, 3, axis=-1))
        y = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((B, T), bool)))
        return nn.Dense(C, kernel_init=_normal(self.config, residual=True), name="c_proj")(y.reshape(B, T, C))


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        C = self.config.n_embd
        x = nn.gelu(nn.Dense(4 * C, kernel_init=_normal(self.config), name="c_fc")(x), approximate=True)
        return nn.Dense(C, kernel_init=_normal(self.config, residual=True), name="c_proj")(x)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        eps = self.config.layer_norm_eps
        x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(epsilon=eps, name="ln_1")(x))
        return x + MLP(self.config, name="mlp")(nn.LayerNorm(epsilon=eps, name="ln_2")(x))


class GPT(nn.Module):
    """The flax half of the model pair; ``apply({"params": p}, idx)`` gives the logits.

    >>> import jax
    >>> config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> idx = jnp.zeros((2, 5), jnp.int32)
    >>> shapes = jax.eval_shape(GPT(config).init, jax.random.key(0), idx)["params"]  # names, shapes: no compute
    >>> sorted(shapes), sum(x.size for x in jax.tree.leaves(shapes)) == config.num_params()
    (['h_0', 'ln_f', 'wpe', 'wte'], True)
    >>> shapes["h_0"]["attn"]["c_attn"]["kernel"].shape                # Dense: (in, out)
    (8, 24)
    >>> params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    >>> GPT(config).apply({"params": params}, idx).shape
    (2, 5, 16)
    """

    config: GPTConfig = GPTConfig()

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.vocab_size, c.n_embd, embedding_init=_normal(c))
        self.wpe = nn.Embed(c.block_size, c.n_embd, embedding_init=_normal(c))
        self.h = [Block(c) for _ in range(c.n_layer)]
        self.ln_f = nn.LayerNorm(epsilon=c.layer_norm_eps)

    def __call__(self, idx):
        return decode(self, idx)


def decode(model, idx):
    """The decoder's forward over ``model``'s ``wte``, ``wpe``, blocks ``h`` and ``ln_f``: the same
    code for the linen model and its NNX twin, whose modules are called alike."""
    T = idx.shape[1]
    if T > model.config.block_size:
        raise ValueError(f"a sequence of {T} tokens is longer than block_size={model.config.block_size}")
    x = model.wte(idx) + model.wpe(jnp.arange(T))
    for block in model.h:
        x = block(x)
    return model.wte.attend(model.ln_f(x))  # the LM head tied to the token embedding


def loss_fn(model: GPT, params, idx, targets):
    """Mean next-token cross-entropy, what ``torch.nn.functional.cross_entropy`` gives the torch half.

    >>> import jax
    >>> config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> idx = jnp.zeros((2, 5), jnp.int32)
    >>> shapes = jax.eval_shape(GPT(config).init, jax.random.key(0), idx)["params"]
    >>> zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    >>> bool(jnp.isclose(loss_fn(GPT(config), zeros, idx, idx), jnp.log(16)))  # all-zero logits: ln(vocab)
    True
    """
    logits = model.apply({"params": params}, idx)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
