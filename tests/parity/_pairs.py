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


# A user's own pair, for the CLI: a small regression net in torch and in flax.

def tiny_linear():
    """Not a pair: a module alone (the harness refuses it by name)."""
    import torch
    return torch.nn.Linear(3, 1)


def tiny_torch():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = torch.nn.Linear(3, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.out(torch.tanh(self.hidden(x)))

    return Net(), lambda net, batch: ((net(batch["x"]) - batch["y"]) ** 2).mean()


def tiny_torch_unreduced_loss():
    """A mistake a user makes: the loss per row, not its mean."""
    net, _ = tiny_torch()
    return net, lambda net, batch: (net(batch["x"]) - batch["y"]) ** 2


def tiny_torch_failing_on_rank_1():
    """A loss that works here (where prepare observes torch's order) and fails on rank 1 only."""
    import torch.distributed as dist
    net, loss = tiny_torch()

    def failing(net, batch):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise FloatingPointError("rank 1's data loader gave a NaN row")
        return loss(net, batch)
    return net, failing


def tiny_flax():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, name="out")(jnp.tanh(nn.Dense(8, name="hidden")(x)))

    net = Net()
    params = jax.eval_shape(net.init, jax.random.key(0), jnp.zeros((1, 3)))["params"]
    return params, lambda p, batch: ((net.apply({"params": p}, batch["x"]) - batch["y"]) ** 2).mean()


def tiny_data(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1, keepdims=True)).astype(np.float32)}
