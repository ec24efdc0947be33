"""The runnable examples in the command line's docstrings run (hybrid.cli.parity's: tests/parity)."""

import doctest
import importlib

import pytest

MODULES = ["hybrid.cli._plan_options", "hybrid.cli._plan_report", "hybrid.cli._project"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
