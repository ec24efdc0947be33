"""ZeRO for JAX: ``zero`` (stages 1 and 2: optimizer state, then gradients, on flat bucket
slices), stage 3's parameters as slices (``ParamShards``, ``shard_params``, ``gather_params``,
``gathered``), stage 3 with its optimizer state in files (``OffloadedZero3``), and the masks and partitions an inner optax transform sees on slices.
Inside ``shard_map`` / ``pmap``, or with ``mesh=`` inside a plain ``jax.jit`` on global buckets sharded by
``NamedSharding`` (``_jit``, ``_global``)."""

from hybrid.jax.sharded._init import abstract_shards, init_shards
from hybrid.jax.sharded.offload import OffloadedZero3
from hybrid.jax.sharded._params import ParamShards, gather_params, gathered, shard_params, unshard_params
from hybrid.jax.sharded._slices import ZeroState
from hybrid.jax.sharded._zero import zero

__all__ = ["OffloadedZero3", "ParamShards", "ZeroState", "abstract_shards", "gather_params", "gathered", "init_shards", "shard_params",
           "unshard_params", "zero"]
