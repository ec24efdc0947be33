"""The twin MLP's torch half: ``nn.Linear`` layers in a ``ModuleList``, tanh between them.

The same network as ``_mlp_jax.mlp_logits``, with the parameter names and layouts of
``_mlp.param_specs``; :func:`torch_model` builds it holding given arrays.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class TorchMLP(nn.Module):
    """The twin MLP: ``nn.Linear`` layers in a ``ModuleList`` named ``layers``, tanh between them.

    >>> [n for n, _ in TorchMLP((3, 4, 2)).named_parameters()]
    ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']
    """

    def __init__(self, sizes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def torch_model(params: dict[str, np.ndarray]) -> TorchMLP:
    """A :class:`TorchMLP` holding copies of ``params`` (names and shapes as :func:`init_params`).

    >>> from hybrid.models import init_params
    >>> p = init_params(0, (3, 2))
    >>> bool((torch_model(p).layers[0].weight.detach().numpy() == p["layers.0.weight"]).all())
    True
    """
    sizes = [params["layers.0.weight"].shape[1]] + [
        params[f"layers.{i}.weight"].shape[0] for i in range(len(params) // 2)]
    return hold_params(TorchMLP(sizes), params)


def hold_params(model: nn.Module, params: dict[str, np.ndarray]) -> nn.Module:
    """``model`` holding copies of ``params``, which must name its parameters in registration
    order with their shapes (a ValueError names the first that does not); returns it.

    >>> arrays = {"weight": np.ones((1, 2), np.float32), "bias": np.zeros(1, np.float32)}
    >>> hold_params(torch.nn.Linear(2, 1), arrays).weight.tolist()
    [[1.0, 1.0]]
    """
    own = dict(model.named_parameters())
    if list(own) != list(params):
        raise ValueError(f"params must be named {list(own)} in that order, got {list(params)}")
    with torch.no_grad():
        for name, value in params.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {value.shape}, the model has {tuple(own[name].shape)}")
            own[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return model
