"""A GPT pair hybrid did not write, named as an outsider names it, and its mapping written as
docs/models.md "Adding a rule" shows (no ``grads_together`` anywhere): torch ``tok_emb``,
``blocks.i.ln1``, ``attn.qkv`` ...; flax ``wte``, ``h_i.ln_1``, ``attn.c_attn`` ...

``*_small`` is a few seconds of CPU; ``*_wide`` holds 1.6M parameters (6.1 MiB), so at torch's
default caps its plan has a 1 MiB first bucket and a second one.
"""

from __future__ import annotations

import numpy as np

from hybrid.core import Layout, ParamMapping, Rule

VOCAB, BLOCK = 64, 16
SMALL = dict(width=32, layers=2, heads=2)
WIDE = dict(width=128, layers=8, heads=4)

T = Layout.transpose(1, 0)


def mapping(layers: int) -> ParamMapping:
    rules = [
        Rule("{b}.ln_1.scale", "{b}.ln1.weight", name="block LayerNorm 1 scale"),
        Rule("{b}.ln_1.bias", "{b}.ln1.bias", name="block LayerNorm 1 bias"),
        Rule("{b}.ln_2.scale", "{b}.ln2.weight", name="block LayerNorm 2 scale"),
        Rule("{b}.ln_2.bias", "{b}.ln2.bias", name="block LayerNorm 2 bias"),
        Rule("{b}.attn.c_attn.kernel", "{b}.attn.qkv.weight", T, name="qkv"),
        Rule("{b}.attn.c_attn.bias", "{b}.attn.qkv.bias", name="qkv bias"),
        Rule("{b}.attn.c_proj.kernel", "{b}.attn.proj.weight", T, name="attention out"),
        Rule("{b}.attn.c_proj.bias", "{b}.attn.proj.bias", name="attention out bias"),
        Rule("{b}.mlp.c_fc.kernel", "{b}.mlp.fc.weight", T, name="mlp in"),
        Rule("{b}.mlp.c_fc.bias", "{b}.mlp.fc.bias", name="mlp in bias"),
        Rule("{b}.mlp.c_proj.kernel", "{b}.mlp.proj.weight", T, name="mlp out"),
        Rule("{b}.mlp.c_proj.bias", "{b}.mlp.proj.bias", name="mlp out bias"),
    ]
    renames = {"wte": "tok_emb", "wpe": "pos_emb", **{f"h_{i}": f"blocks.{i}" for i in range(layers)}}
    return ParamMapping.flax(rules, renames=renames)


SMALL_MAPPING = mapping(SMALL["layers"])
WIDE_MAPPING = mapping(WIDE["layers"])


def _torch(width: int, layers: int, heads: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in self.qkv(x).split(width, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, width))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(width), Attention(), nn.LayerNorm(width), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class OutsiderGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, width), nn.Embedding(BLOCK, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, idx):
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.tok_emb.weight.T  # the head tied to the token embedding

    def loss(model, batch):
        logits = model(batch[0])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))

    return OutsiderGPT(), loss


def _flax(width: int, layers: int, heads: int):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = jnp.split(nn.Dense(3 * width, name="c_attn")(x), 3, axis=-1)
            q, k, v = (z.reshape(b, t, heads, -1).transpose(0, 2, 1, 3) for z in (q, k, v))
            scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
            y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, width)
            return nn.Dense(width, name="c_proj")(y)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(width, name="c_proj")(nn.gelu(nn.Dense(4 * width, name="c_fc")(x), approximate=True))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + Attention(name="attn")(nn.LayerNorm(epsilon=1e-5, name="ln_1")(x))
            return x + MLP(name="mlp")(nn.LayerNorm(epsilon=1e-5, name="ln_2")(x))

    class FlaxGPT(nn.Module):
        def setup(self):
            self.wte, self.wpe = nn.Embed(VOCAB, width), nn.Embed(BLOCK, width)
            self.h = [Block() for _ in range(layers)]
            self.ln_f = nn.LayerNorm(epsilon=1e-5)

        def __call__(self, idx):
            x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            return self.wte.attend(self.ln_f(x))

    model = FlaxGPT()
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, BLOCK), jnp.int32))["params"]

    def loss(p, batch):
        logits = model.apply({"params": p}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return params, loss


def torch_small():
    return _torch(**SMALL)


def flax_small():
    return _flax(**SMALL)


def torch_wide():
    return _torch(**WIDE)


def flax_wide():
    return _flax(**WIDE)


def data(step: int, rows: int = 12):
    """Next-token batches ``(inputs, targets)``, int64 ``(rows, BLOCK)``, counting up by 3 from a
    random start with one token in eight random."""
    rng = np.random.default_rng([11, step])
    tokens = (rng.integers(0, VOCAB, size=(rows, 1)) + 3 * np.arange(BLOCK + 1)) % VOCAB
    noise = rng.random(tokens.shape) < 1 / 8
    tokens[noise] = rng.integers(0, VOCAB, size=int(noise.sum()))
    return tokens[:, :-1], tokens[:, 1:]
