"""A GPT-2-style decoder written twice, as torch users and as flax users write it, and the mapping
between the two (``GPT_MAPPING``). See docs/models.md.

The torch and flax halves are imported on first use (PEP 562): a torch process that reads
``GPTConfig`` does not import JAX, and a JAX one does not import torch.
"""

import importlib

_WHERE = {
    "GPTConfig": "hybrid.models._config",
    "GPT_MAPPING": "hybrid.models._config",
    "TorchGPT": ("hybrid.models._gpt_torch", "GPT"),
    "FlaxGPT": ("hybrid.models._gpt_flax", "GPT"),
    "flax_loss": ("hybrid.models._gpt_flax", "loss_fn"),
}


def __getattr__(name: str):
    if name in _WHERE:
        module, attr = _WHERE[name] if isinstance(_WHERE[name], tuple) else (_WHERE[name], name)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hybrid.models' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = ["FlaxGPT", "GPTConfig", "GPT_MAPPING", "TorchGPT", "flax_loss"]
