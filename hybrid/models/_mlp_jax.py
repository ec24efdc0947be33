"""The twin MLP's JAX half: a function over a pytree whose key paths are torch's names.

The same network as ``_mlp_torch.TorchMLP``: ``x @ W.T + b`` per layer (``nn.Linear``'s
layout), tanh between layers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax


def jax_params(params: dict[str, np.ndarray]) -> dict:
    """The pytree the JAX twin reads: ``{"layers": [{"weight": w, "bias": b}, ...]}``, whose key
    paths (``hybrid.jax.specs``) are torch's names: ``layers.0.weight`` ...

    >>> import hybrid.jax as hj
    >>> from hybrid.models import init_params
    >>> [s.name for s in hj.specs(jax_params(init_params(0, (3, 2))))]
    ['layers.0.bias', 'layers.0.weight']
    """
    n = len(params) // 2
    return {"layers": [{"weight": jnp.asarray(params[f"layers.{i}.weight"]),
                        "bias": jnp.asarray(params[f"layers.{i}.bias"])} for i in range(n)]}


def mlp_logits(params, x):
    """The twin MLP: ``x @ W.T + b`` per layer (``nn.Linear``), tanh between layers."""
    layers = params["layers"]
    for i, layer in enumerate(layers):
        x = x @ layer["weight"].T + layer["bias"]
        if i < len(layers) - 1:
            x = jnp.tanh(x)
    return x


def cross_entropy(params, x, y):
    """Mean cross-entropy over the rows given (``torch.nn.functional.cross_entropy``'s mean)."""
    return optax.losses.softmax_cross_entropy_with_integer_labels(mlp_logits(params, x), y).mean()
