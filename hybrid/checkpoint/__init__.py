"""Framework-neutral sharded checkpoints: either frontend saves, either loads, at any world size.

A checkpoint is a directory: ``manifest.json`` (format version, bucket plan and fingerprint,
world size, stage, step, optimizer and hyperparameters, dtypes, each file's size and header
checksum) and one safetensors file per rank holding that rank's flat slice of every bucket, for
the parameters and each optimizer slot, with a checksum of every MiB of it in its header. Loading at another world size, bucket layout or framework reshards with
``hybrid.core.reshard``. The torch and JAX entry points live in ``hybrid.checkpoint.torch`` and
``hybrid.checkpoint.jax`` (imported explicitly, like the frontends). They also read torch DCP
(``hybrid.checkpoint.dcp``: FSDP2, torchtitan) and orbax (``hybrid.checkpoint.orbax``: flax)
checkpoints, recognised by :func:`open_checkpoint`, and :func:`convert` writes any of the three
from any other. Each format is a plug-in (``_plugin.CheckpointFormat``: recognise, open, write)
found by name in the registry of ``_formats.py``, imported when first needed: reading hybrid's own
format imports neither torch nor JAX, and a DCP checkpoint never imports JAX. See docs/checkpoints.md.
"""

from hybrid.checkpoint._convert import convert
from hybrid.checkpoint._files import Checkpoint, read_state, torch_ready_order
from hybrid.checkpoint._formats import FORMATS, detect_format, open_checkpoint
from hybrid.checkpoint._leftovers import Leftover, clear_leftovers, latest, leftovers
from hybrid.checkpoint._manifest import FORMAT_VERSION, CheckpointError, FileEntry, Manifest, OptimizerInfo
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint._renamed import to_torch_names
from hybrid.checkpoint._write import save_arrays

__all__ = ["FORMATS", "FORMAT_VERSION", "Checkpoint", "CheckpointError", "CheckpointReader", "FileEntry", "Leftover",
           "Manifest", "OptimizerInfo", "clear_leftovers", "convert", "detect_format", "latest", "leftovers",
           "open_checkpoint", "read_state", "save_arrays", "to_torch_names", "torch_ready_order"]
