"""``python -m hybrid bench checkpoint``: sharded checkpoint save and load speed per rank, against
plain file I/O of the same bytes, measured side by side.

    _command    the arguments, and hybrid's own format against plain I/O (torch: 2 gloo ranks;
                JAX: 2 host devices)
    _dcp_orbax  the foreign formats beside hybrid's own: torch DCP (FSDP2) and orbax
"""

from hybrid.bench.checkpoint._command import main

__all__ = ["main"]
