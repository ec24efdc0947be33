"""Running one model as a torch module and as a JAX tree: crossing between them by a declared mapping.

The mapping (names, layouts, tied tensors) is :class:`hybrid.core.ParamMapping`, pure data that
``hybrid.checkpoint`` uses too; this package reads each framework's names and moves arrays across.
See docs/models.md.
"""

from hybrid.parity._bridge import jax_to_torch, jax_tree, named_jax, named_torch, pair_models, tied_parameters, torch_to_jax

__all__ = ["jax_to_torch", "jax_tree", "named_jax", "named_torch", "pair_models", "tied_parameters", "torch_to_jax"]
