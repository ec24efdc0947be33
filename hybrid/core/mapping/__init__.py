"""The declared mapping between a JAX (flax) parameter tree and a torch module: layouts (exact,
invertible steps), rules over names, and the resolved pairing. Names and shapes only."""

from hybrid.core.mapping._layout import Layout
from hybrid.core.mapping._mapping import FLAX_RULES, ParamMapping, Rule
from hybrid.core.mapping._pairing import MappingError, Pair, ParamPairing

__all__ = ["FLAX_RULES", "Layout", "MappingError", "Pair", "ParamMapping", "ParamPairing", "Rule"]
