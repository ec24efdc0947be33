"""The twin MLP's numpy half: its parameters' names, specs and initial values.

One MLP written for each framework (``_mlp_torch.TorchMLP``, ``_mlp_jax.mlp_logits``),
``Linear -> tanh -> ... -> Linear`` with parameters named as torch's ``nn.ModuleList`` of
``nn.Linear`` names them (``layers.0.weight`` of shape ``(out, in)``, ``layers.0.bias``, ...): both
start from the arrays :func:`init_params` returns, so they differ only in how each computes.
"""

from __future__ import annotations

import numpy as np

from hybrid.core import TensorSpec


def param_order(sizes) -> list[str]:
    """Parameter names in torch's registration order (the ``order=`` to give ``hybrid.jax``).

    >>> param_order((3, 2))
    ['layers.0.weight', 'layers.0.bias']
    """
    return [f"layers.{i}.{kind}" for i in range(len(sizes) - 1) for kind in ("weight", "bias")]


def param_specs(sizes) -> list[TensorSpec]:
    """TensorSpecs of the model in registration order, what both frontends plan buckets on.

    >>> [(s.name, s.shape) for s in param_specs((3, 2))]
    [('layers.0.weight', (2, 3)), ('layers.0.bias', (2,))]
    """
    return [TensorSpec(f"layers.{i}.{kind}", (n_out, n_in) if kind == "weight" else (n_out,), "float32")
            for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])) for kind in ("weight", "bias")]


def init_params(seed: int, sizes) -> dict[str, np.ndarray]:
    """float32 initial parameters by name, in registration order, drawn as ``nn.Linear`` draws them
    (uniform in ``+-1/sqrt(fan_in)``) but from numpy, so both frameworks start from the same bits.

    >>> p = init_params(0, (3, 2))
    >>> list(p), p["layers.0.weight"].shape, p["layers.0.weight"].dtype
    (['layers.0.weight', 'layers.0.bias'], (2, 3), dtype('float32'))
    """
    rng = np.random.default_rng([seed, 0])
    out = {}
    for spec in param_specs(sizes):
        bound = 1.0 / np.sqrt(sizes[int(spec.name.split(".")[1])])
        out[spec.name] = rng.uniform(-bound, bound, size=spec.shape).astype(np.float32)
    return out
