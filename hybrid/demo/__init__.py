"""The twin models trained by both frontends: the parity tests, the examples and ``python -m hybrid demo``.

The MLP (numpy init, the same function written for each framework) and hybrid.models' GPT pair
(torch's init, crossed to flax by the declared mapping): ``TrainConfig(gpt=GPTConfig(...))``.

The torch and JAX halves are imported on first use (PEP 562), so a spawned torch worker that
unpickles ``train_torch`` does not import JAX, and a JAX script does not import torch.
"""

import importlib

_WHERE = {
    "TrainConfig": "hybrid.demo._model",
    "TrainResult": "hybrid.demo._model",
    "batch": "hybrid.demo._model",
    "initial_params": "hybrid.demo._model",
    "token_batch": "hybrid.demo._tokens",
    "gpt_init": "hybrid.demo._tokens",
    "global_batch": "hybrid.demo._model",
    "init_params": "hybrid.models._mlp",
    "param_order": "hybrid.models._mlp",
    "param_specs": "hybrid.models._mlp",
    "rank_rows": "hybrid.demo._model",
    "TorchMLP": "hybrid.models._mlp_torch",
    "build_torch": "hybrid.demo._torch_run",
    "torch_module": "hybrid.demo._torch_run",
    "launch_torch": "hybrid.demo._torch_run",
    "pin_torch_numerics": "hybrid.demo._torch_run",
    "spawn_world": "hybrid.demo._world",
    "torch_model": "hybrid.models._mlp_torch",
    "train_torch": "hybrid.demo._torch_run",
    "train_torch_runs": "hybrid.demo._torch_run",
    "train_torch_steps": "hybrid.demo._torch_run",
    "JaxModel": "hybrid.demo._jax_run",
    "JaxTraining": "hybrid.demo._jax_run",
    "jax_model": "hybrid.demo._jax_run",
    "build_jax": "hybrid.demo._jax_run",
    "cross_entropy": "hybrid.models._mlp_jax",
    "ensure_host_devices": "hybrid.demo._jax_run",
    "host_mesh": "hybrid.demo._jax_run",
    "jax_params": "hybrid.models._mlp_jax",
    "make_optimizer": "hybrid.demo._jax_run",
    "mlp_logits": "hybrid.models._mlp_jax",
    "numpy_params": "hybrid.demo._jax_run",
    "pin_jax_numerics": "hybrid.demo._jax_run",
    "train_jax": "hybrid.demo._jax_run",
    "train_jax_steps": "hybrid.demo._jax_run",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybrid.demo' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = [
    "JaxModel", "JaxTraining", "TorchMLP", "TrainConfig", "TrainResult",
    "batch", "build_jax", "build_torch", "cross_entropy", "ensure_host_devices", "global_batch", "gpt_init",
    "host_mesh", "init_params",
    "initial_params", "jax_model", "jax_params",
    "launch_torch", "make_optimizer", "mlp_logits", "numpy_params", "param_order", "param_specs", "rank_rows",
    "pin_jax_numerics", "pin_torch_numerics", "spawn_world", "token_batch", "torch_module", "train_torch_runs",
    "torch_model", "train_jax", "train_jax_steps", "train_torch", "train_torch_steps",
]
