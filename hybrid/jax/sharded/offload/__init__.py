"""ZeRO-3 with the optimizer state in files (:class:`OffloadedZero3`), the files (``_state_files``)
and the probe that decides whether an inner transform can be stepped a bucket at a time (``_probe``)."""

from hybrid.jax.sharded.offload._optimizer import OffloadedZero3
from hybrid.jax.sharded.offload._probe import check_per_bucket

__all__ = ["OffloadedZero3", "check_per_bucket"]
