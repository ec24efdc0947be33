"""The runnable examples in the docstrings of hybrid.models and hybrid.parity must run."""

import doctest
import importlib

import pytest

MODULES = ["hybrid.models._config", "hybrid.models._gpt_torch", "hybrid.models._gpt_flax", "hybrid.models._gpt_nnx", "hybrid.models._mlp",
           "hybrid.models._mlp_torch", "hybrid.models._mlp_jax", "hybrid.models._llama_torch", "hybrid.parity._bridge"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
