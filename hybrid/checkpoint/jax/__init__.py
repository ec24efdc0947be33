"""Sharded checkpoints from and into JAX: params and the optax state of ``hybrid.jax.zero`` (the
padded flat buckets, sharded over the mesh) or of a plain, unsharded optax transform.

ZeRO stage 3 needs no format of its own: its :class:`hybrid.jax.ParamShards` are the parameters
cut exactly as the files store them, and its state is the stage-2 state of the same plan. Pass
the shards where the params tree goes; the plan travels with them (no ``order`` or caps needed).

The optimizer state is found by type: ``optax.ScaleByAdamState`` (slots ``mu``, ``nu`` and its
``count``; adam, adamw, ...) and ``optax.TraceState`` (slot ``trace``: sgd with momentum), inside
a :class:`hybrid.jax.ZeroState` or not. Any ``optax.ScaleByScheduleState`` count is restored too.
The mesh may be one process's devices (single controller) or span the processes of a
``jax.distributed`` job: there every process saves and loads, each writing and reading only the
slices its own devices hold (``_processes.py`` has the save's agreement).
"""

from hybrid.checkpoint.jax._load import load, load_buffers
from hybrid.checkpoint.jax._optax_groups import optax_from_manifest
from hybrid.checkpoint.jax._save import save

__all__ = ["load", "load_buffers", "optax_from_manifest", "save"]
