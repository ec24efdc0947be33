"""Cross-framework parity: one model as a torch module and as a JAX tree, trained by both of
hybrid's frontends and compared, and the crossing between them by a declared mapping.

- the harness (docs/parity.md): :func:`run` trains a user's torch/JAX pair on the same weights and
  global batches and returns a :class:`ParityReport`; :func:`assert_parity` for pytest;
  :func:`handover` resumes one framework's checkpoint in the other; the parts:
  :func:`prepare`, :func:`train_torch`, :func:`train_jax`, :func:`compare`;
- the crossing (docs/models.md): :func:`pair_models`, :func:`torch_to_jax`, :func:`jax_to_torch`
  through a :class:`hybrid.core.ParamMapping`, pure data that ``hybrid.checkpoint`` uses too.

Names are imported on first use (PEP 562): a spawned torch rank that runs the torch side does
not import JAX.
"""

import importlib

_WHERE = {
    **dict.fromkeys(["jax_to_torch", "jax_tree", "named_jax", "named_torch", "pair_models", "tied_parameters",
                     "torch_to_jax"], "hybrid.parity._bridge"),
    **dict.fromkeys(["OptimizerSpec"], "hybrid.parity._spec"),
    **dict.fromkeys(["ParityReport", "SideRun", "Tolerance", "assert_parity", "compare"], "hybrid.parity._report"),
    **dict.fromkeys(["ParitySetup", "handover", "prepare", "run", "train_jax", "train_torch"], "hybrid.parity._harness"),
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybrid.parity' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = sorted(_WHERE)
