"""The runnable examples in the docstrings of hybrid.parity's harness must run (run, handover and
train_* spawn torch ranks: docs/parity.md's example and test_harness.py run them)."""

import doctest
import importlib

import pytest

MODULES = ["hybrid.parity._spec", "hybrid.parity._report", "hybrid.parity._harness", "hybrid.cli.parity"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
