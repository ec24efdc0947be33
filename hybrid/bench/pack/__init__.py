"""``python -m hybrid bench pack``: batched copy into and out of buckets vs one contiguous copy.

    _command     the arguments, the two workloads (``transformer_shapes``, ``small_shapes``) and
                 the copy paths timed against one contiguous copy
    _projection  ``--project``: what the CUDA kernels should take on a given GPU, without one
"""

from hybrid.bench.pack._command import main, small_shapes, transformer_shapes

__all__ = ["main", "small_shapes", "transformer_shapes"]
