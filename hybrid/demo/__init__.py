"""The twin model trained by both frontends: the parity tests, the examples and ``python -m hybrid demo``."""

from hybrid.demo._jax_run import JaxTraining
from hybrid.demo._jax_run import build_jax
from hybrid.demo._jax_run import cross_entropy
from hybrid.demo._jax_run import host_mesh
from hybrid.demo._jax_run import jax_params
from hybrid.demo._jax_run import make_optimizer
from hybrid.demo._jax_run import mlp_logits
from hybrid.demo._jax_run import numpy_params
from hybrid.demo._jax_run import pin_jax_numerics
from hybrid.demo._jax_run import train_jax
from hybrid.demo._jax_run import train_jax_steps
from hybrid.demo._model import TrainConfig
from hybrid.demo._model import TrainResult
from hybrid.demo._model import global_batch
from hybrid.demo._model import init_params
from hybrid.demo._model import param_order
from hybrid.demo._model import param_specs
from hybrid.demo._model import rank_rows
from hybrid.demo._torch_run import TorchMLP
from hybrid.demo._torch_run import build_torch
from hybrid.demo._torch_run import launch_torch
from hybrid.demo._torch_run import pin_torch_numerics
from hybrid.demo._torch_run import spawn_world
from hybrid.demo._torch_run import torch_model
from hybrid.demo._torch_run import train_torch
from hybrid.demo._torch_run import train_torch_runs
from hybrid.demo._torch_run import train_torch_steps

__all__ = [
    "JaxTraining", "TorchMLP", "TrainConfig", "TrainResult",
    "build_jax", "build_torch", "cross_entropy", "global_batch", "host_mesh", "init_params", "jax_params",
    "launch_torch", "make_optimizer", "mlp_logits", "numpy_params", "param_order", "param_specs", "rank_rows",
    "pin_jax_numerics", "pin_torch_numerics", "spawn_world", "train_torch_runs",
    "torch_model", "train_jax", "train_jax_steps", "train_torch", "train_torch_steps",
]
