"""JAX frontend: data parallelism and ZeRO sharding as optax transforms over hybrid.core plans."""

from hybrid.jax._all_reduce import BucketedAllReduceState, bucketed_all_reduce
from hybrid.jax._auto import auto_bucket_plan
from hybrid.jax._clip import clip_by_global_norm
from hybrid.jax._cost_probe import measure_collectives
from hybrid.jax._finite import apply_if_finite
from hybrid.jax._grad import local_grad
from hybrid.jax._multi_steps import MultiSteps
from hybrid.jax._ready import gradient_ready_order
from hybrid.jax.sharded._init import abstract_shards, init_shards
from hybrid.jax.sharded.offload import OffloadedZero3
from hybrid.jax.sharded._params import ParamShards, gather_params, gathered, shard_params, unshard_params
from hybrid.jax._specs import key_path_name, specs
from hybrid.jax._state_specs import state_specs
from hybrid.jax.sharded._xla_flags import MEMORY_FIRST_XLA_CPU_FLAGS, use_memory_first_xla_cpu
from hybrid.jax.sharded._zero import NON_ELEMENTWISE, ZeroState, zero

__all__ = [
    "MEMORY_FIRST_XLA_CPU_FLAGS", "MultiSteps", "NON_ELEMENTWISE", "BucketedAllReduceState", "OffloadedZero3", "ParamShards", "ZeroState",
    "abstract_shards", "apply_if_finite", "auto_bucket_plan", "bucketed_all_reduce", "clip_by_global_norm", "gather_params", "gathered",
    "gradient_ready_order", "init_shards", "key_path_name", "local_grad", "measure_collectives", "shard_params", "specs",
    "state_specs", "unshard_params", "use_memory_first_xla_cpu", "zero",
]  # and ShardedModule (flax NNX at stage 3), imported on first use: not in __all__, so * never imports flax


def __getattr__(name):
    # ShardedModule is an nnx.Module: flax is imported only when it is asked for
    if name == "ShardedModule":
        from hybrid.jax.sharded._nnx import ShardedModule
        return ShardedModule
    raise AttributeError(f"module 'hybrid.jax' has no attribute {name!r}")
