"""The models hybrid trains in both frameworks, in one place. See docs/models.md.

- The GPT pair: a GPT-2-style decoder written twice, as torch users and as flax users write it
  (``TorchGPT``, ``FlaxGPT``), and the mapping between the two (``GPT_MAPPING``); ``NNXGPT``, the
  same decoder in flax NNX's idiom, under the same mapping.
- The twin MLP: ``Linear -> tanh -> ... -> Linear`` written for each framework (``TorchMLP``,
  ``mlp_logits``), from the same numpy initial values (``init_params``) under torch's names.
- A Llama-style decoder written the torchtitan way (``Llama``, ``LlamaConfig``): RMSNorm, a
  complex64 RoPE buffer, SwiGLU, an untied head, a whole-model ``init_weights(buffer_device=None)``.
- The built-in example models of ``python -m hybrid plan --model`` as TensorSpec lists
  (``EXAMPLES``: GPT-2 small in Hugging Face's naming, an MLP, a convnet, a mixed-dtype MLP).

Each half is imported on first use (PEP 562): a torch process that reads ``GPTConfig`` does not
import JAX, and a JAX one does not import torch.
"""

import importlib

_WHERE = {
    "GPTConfig": "hybrid.models._config",
    "GPT_MAPPING": "hybrid.models._config",
    "TorchGPT": ("hybrid.models._gpt_torch", "GPT"),
    "FlaxGPT": ("hybrid.models._gpt_flax", "GPT"),
    "flax_loss": ("hybrid.models._gpt_flax", "loss_fn"),
    "NNXGPT": ("hybrid.models._gpt_nnx", "GPT"),
    "nnx_loss": ("hybrid.models._gpt_nnx", "loss_fn"),
    "init_params": "hybrid.models._mlp",
    "param_order": "hybrid.models._mlp",
    "param_specs": "hybrid.models._mlp",
    "TorchMLP": "hybrid.models._mlp_torch",
    "torch_model": "hybrid.models._mlp_torch",
    "hold_params": "hybrid.models._mlp_torch",
    "mlp_logits": "hybrid.models._mlp_jax",
    "cross_entropy": "hybrid.models._mlp_jax",
    "jax_params": "hybrid.models._mlp_jax",
    "EXAMPLES": "hybrid.models._examples",
    "Llama": "hybrid.models._llama_torch",
    "LlamaConfig": "hybrid.models._llama_torch",
}


def __getattr__(name: str):
    if name in _WHERE:
        module, attr = _WHERE[name] if isinstance(_WHERE[name], tuple) else (_WHERE[name], name)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hybrid.models' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = ["EXAMPLES", "FlaxGPT", "GPTConfig", "GPT_MAPPING", "Llama", "LlamaConfig", "NNXGPT", "TorchGPT", "TorchMLP",
           "cross_entropy", "flax_loss", "hold_params", "init_params", "jax_params", "mlp_logits", "nnx_loss", "param_order", "param_specs", "torch_model"]
