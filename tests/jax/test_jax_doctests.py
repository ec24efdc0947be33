"""The runnable examples in the JAX frontend's docstrings must run."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["hybrid.jax._all_reduce", "hybrid.jax._clip", "hybrid.jax._elementwise",
                                  "hybrid.jax._finite", "hybrid.jax._grad", "hybrid.jax._multi_steps",
                                  "hybrid.jax._specs", "hybrid.jax._state_specs",
                                  "hybrid.jax.sharded._zero", "hybrid.jax._cost_probe", "hybrid.jax._ready",
                                  "hybrid.jax.sharded._params", "hybrid.jax.sharded._init", "hybrid.jax._auto",
                                  "hybrid.jax.sharded._axis_aware", "hybrid.jax.sharded._xla_flags", "hybrid.jax.sharded._nnx",
                                  "hybrid.jax.sharded.offload._optimizer", "hybrid.jax.sharded.offload._probe"])
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
