"""``python -m hybrid bench jax``: bucketed all-reduce and ZeRO against plain optax, 4 host devices.

    _command  the arguments, and the MLP parts: per-leaf ``pmean`` against ``bucketed_all_reduce``,
              and ``hybrid.jax.zero`` stages 1-3 against unsharded adam
    _steps    the jitted ``shard_map`` train steps it times, and how it times them (shared with
              its GPT part, ``--device``: ``hybrid.bench.gpt``)
"""

from hybrid.bench.jax._command import main

__all__ = ["main"]
