"""The runnable examples in hybrid.demo's docstrings must run (torch's spawn a 2-rank gloo world)."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["hybrid.demo._model", "hybrid.demo._tokens", "hybrid.demo._jax_run",
                                  "hybrid.demo._jax_model", "hybrid.demo._gpt_jax", "hybrid.demo._torch_run",
                                  "hybrid.demo._world", "hybrid.demo._checkpointing",
                                  "hybrid.demo._forked"])
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
