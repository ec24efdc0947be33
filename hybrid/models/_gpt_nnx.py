"""The GPT-2-style decoder as flax NNX users write it: ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.Linear``.

The same network as :class:`hybrid.models.TorchGPT` and :class:`hybrid.models.FlaxGPT`, written in
flax's newer API: modules are objects holding their ``nnx.Param``s, the blocks an ``nnx.List``.
``nnx.split(model, nnx.Param)`` gives an ``nnx.State`` whose arrays sit under each variable's
``.value``; hybrid names every array by its variable (``h.0.attn.c_attn.kernel``), so the state
goes wherever a params tree goes (``hybrid.jax.zero``, ``hybrid.jax.specs``, the mapping, the
checkpoints), and ``hybrid.models.GPT_MAPPING`` pairs it with the torch model as it pairs linen's
``h_0.attn.c_attn.kernel`` (NNX's list already says ``h.0``, torch's ``ModuleList`` spelling).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax
from flax import nnx

from hybrid.models._config import GPTConfig
from hybrid.models._gpt_flax import decode


def _normal(config: GPTConfig, residual: bool = False):
    std = config.init_std / math.sqrt(2 * config.n_layer) if residual else config.init_std
    return nnx.initializers.normal(stddev=std)


def _linear(n_in: int, n_out: int, config: GPTConfig, rngs: nnx.Rngs, residual: bool = False) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, kernel_init=_normal(config, residual), rngs=rngs)


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        C = config.n_embd
        self.n_head = config.n_head
        self.c_attn = _linear(C, 3 * C, config, rngs)
        self.c_proj = _linear(C, C, config, rngs, residual=True)

    def __call__(self, x):
        B, T, C = x.shape
        q, k, v = (t.reshape(B, T, self.n_head, C // self.n_head) for t in jnp.split(self.c_attn(x), 3, axis=-1))
        y = nnx.dot_product_attention(q, k, v, mask=nnx.make_causal_mask(jnp.ones((B, T), bool)))
        return self.c_proj(y.reshape(B, T, C))


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        C = config.n_embd
        self.c_fc = _linear(C, 4 * C, config, rngs)
        self.c_proj = _linear(4 * C, C, config, rngs, residual=True)

    def __call__(self, x):
        return self.c_proj(nnx.gelu(self.c_fc(x), approximate=True))  # GPT-2's tanh gelu


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        C, eps = config.n_embd, config.layer_norm_eps
        self.ln_1 = nnx.LayerNorm(C, epsilon=eps, rngs=rngs)
        self.attn = CausalSelfAttention(config, rngs)
        self.ln_2 = nnx.LayerNorm(C, epsilon=eps, rngs=rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
    """The NNX twin of the model pair; ``model(idx)`` gives the logits.

    >>> import jax
    >>> from flax import nnx
    >>> import hybrid.jax
    >>> config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> model = GPT(config, rngs=nnx.Rngs(0))
    >>> graphdef, params = nnx.split(model, nnx.Param)
    >>> [s.name for s in hybrid.jax.specs(params)][:3]      # by variable, without nnx's ".value"
    ['h.0.attn.c_attn.bias', 'h.0.attn.c_attn.kernel', 'h.0.attn.c_proj.bias']
    >>> sum(x.size for x in jax.tree.leaves(params)) == config.num_params()
    True
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 16)
    """

    def __init__(self, config: GPTConfig = GPTConfig(), *, rngs: nnx.Rngs):
        c = self.config = config
        self.wte = nnx.Embed(c.vocab_size, c.n_embd, embedding_init=_normal(c), rngs=rngs)
        self.wpe = nnx.Embed(c.block_size, c.n_embd, embedding_init=_normal(c), rngs=rngs)
        self.h = nnx.List([Block(c, rngs) for _ in range(c.n_layer)])
        self.ln_f = nnx.LayerNorm(c.n_embd, epsilon=c.layer_norm_eps, rngs=rngs)

    def __call__(self, idx):
        return decode(self, idx)  # the linen model's forward, the LM head tied to the token embedding


def loss_fn(model: GPT, idx, targets):
    """Mean next-token cross-entropy of an NNX model, as ``nnx.grad(loss_fn)(model, ...)`` takes it.

    >>> from flax import nnx
    >>> config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> model = GPT(config, rngs=nnx.Rngs(0))
    >>> idx = jnp.zeros((2, 5), jnp.int32)
    >>> bool(loss_fn(model, idx, idx) > 0)
    True
    """
    return optax.softmax_cross_entropy_with_integer_labels(model(idx), targets).mean()
