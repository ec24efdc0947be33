"""Framework-neutral sharded checkpoints: either frontend saves, either loads, at any world size.

A checkpoint is a directory: ``manifest.json`` (format version, bucket plan and fingerprint,
world size, stage, step, optimizer and hyperparameters, dtypes, each file's size and header
checksum) and one safetensors file per rank holding that rank's flat slice of every bucket, for
the parameters and each optimizer slot, with a checksum of every MiB of it in its header. Loading at another world size, bucket layout or framework reshards with
``hybrid.core.reshard``. The torch and JAX entry points live in ``hybrid.checkpoint.torch`` and
``hybrid.checkpoint.jax`` (imported explicitly, like the frontends). See docs/checkpoints.md.
"""

from hybrid.checkpoint._files import Checkpoint, read_state
from hybrid.checkpoint._leftovers import Leftover, clear_leftovers, latest, leftovers
from hybrid.checkpoint._manifest import FORMAT_VERSION, CheckpointError, FileEntry, Manifest, OptimizerInfo
from hybrid.checkpoint._write import save_arrays

__all__ = ["FORMAT_VERSION", "Checkpoint", "CheckpointError", "FileEntry", "Leftover", "Manifest", "OptimizerInfo",
           "clear_leftovers", "latest", "leftovers", "read_state", "save_arrays"]
