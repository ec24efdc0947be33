"""torch DCP as a plug-in: a directory with a ``.metadata`` file, read by :class:`DcpCheckpoint`
and written by torch's own ``dcp.save`` (``_writer.py``). Recognising one imports nothing; opening
or writing one imports torch, never JAX."""

from __future__ import annotations

from hybrid.checkpoint._plugin import CheckpointFormat
from hybrid.checkpoint._protocol import resolve

METADATA = ".metadata"  # _metadata.METADATA, named here too: importing that module imports torch


class DcpFormat(CheckpointFormat):
    name = "dcp"
    signature = f"{METADATA} (torch DCP)"

    def detect(self, path) -> bool:
        return (resolve(path) / METADATA).exists()

    def open(self, path, *, step=None, param_names=None, **options):
        from hybrid.checkpoint.dcp._reader import DcpCheckpoint

        return DcpCheckpoint(path, step=step, param_names=param_names, **options)

    def writer(self, source, *, param_groups=None, model_key: str | None = None, optim_key: str | None = None,
               **options):
        """The whole state dict read and checked now (``dcp_state_dict``: the keys given, else its
        default layout); written by ``dcp.save``."""
        from hybrid.checkpoint.dcp._writer import dcp_state_dict, save_here

        del options
        keys = {k: v for k, v in (("model_key", model_key), ("optim_key", optim_key)) if v is not None}
        state = dcp_state_dict(source, param_groups=param_groups, **keys)
        return lambda path: save_here(state, path)


FORMAT = DcpFormat()
