"""hybrid: data-parallel machinery for torch and JAX, planned once in ``hybrid.core``.

Frontends are imported explicitly (``import hybrid.torch``, ``import hybrid.jax``) so that using
one framework never imports the other.
"""

__version__ = "0.1.0"
