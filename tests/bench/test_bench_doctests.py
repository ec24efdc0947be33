"""The runnable examples in the docstrings of the GPT training-step benches must run."""

import doctest
import importlib

import pytest

MODULES = ["hybrid.bench.gpt._config", "hybrid.bench.gpt._device", "hybrid.bench.gpt._report",
           "hybrid.bench.gpt._run", "hybrid.bench.gpt._torch"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
