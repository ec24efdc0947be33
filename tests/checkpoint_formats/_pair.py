"""The model pair the foreign-format tests train: a torch MLP and its flax twin, their data, and
the mapping between them (flax ``Dense_i`` is torch's ``nn.Sequential`` entry ``2 i``)."""

import numpy as np

WIDTHS = (5, 7, 6, 4)
BATCH = 12  # split evenly over 2, 3 and 4 ranks or devices
RENAMES = {f"Dense_{i}": str(2 * i) for i in range(len(WIDTHS) - 1)}


def batch(step: int) -> np.ndarray:
    """Step ``step``'s global batch (every run, in either framework, sees the same)."""
    return np.random.default_rng(1000 + step).normal(size=(BATCH, WIDTHS[0])).astype(np.float32)


def torch_model():
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def torch_groups(model, kind: str, *, lr_scale: float = 1.0):
    """Two param groups, as users write them: the weights decay, the biases do not (and step at
    another lr); ``lr_scale`` builds the optimizer with other values, which a load must replace."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    lr = 0.01 * lr_scale
    if kind == "sgd":
        return [{"params": weights, "lr": lr, "momentum": 0.9, "weight_decay": 0.01},
                {"params": biases, "lr": 2 * lr, "momentum": 0.9, "weight_decay": 0.0}]
    return [{"params": weights, "lr": lr, "weight_decay": 0.1}, {"params": biases, "lr": 2 * lr, "weight_decay": 0.0}]


OPTIMIZERS = ("adamw", "adam", "sgd")


def torch_optimizer(model_or_params, kind: str, *, lr_scale: float = 1.0, zero3=None):
    """``kind``'s torch optimizer over the two groups (over a ZeRO3 model: its ZeRO3Optimizer)."""
    import torch

    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[kind]
    model = zero3.module if zero3 is not None else model_or_params
    groups = torch_groups(model, kind, lr_scale=lr_scale)
    if zero3 is not None:
        from hybrid.torch import ZeRO3Optimizer
        return ZeRO3Optimizer(zero3, cls, param_groups=groups)
    return cls(groups)


def flax_model():
    import flax.linen as nn
    import jax.numpy as jnp

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, w in enumerate(WIDTHS[1:]):
                x = nn.Dense(w)(x)
                x = jnp.tanh(x) if i < len(WIDTHS) - 2 else x
            return x

    return MLP()


def mapping():
    from hybrid.core import ParamMapping
    return ParamMapping.flax(renames=RENAMES)


def flax_params():
    import jax
    import jax.numpy as jnp
    return flax_model().init(jax.random.key(0), jnp.zeros((1, WIDTHS[0])))["params"]


def flax_loss(params, x):
    return (flax_model().apply({"params": params}, x) ** 2).mean()
