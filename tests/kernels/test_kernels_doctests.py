"""The runnable examples in hybrid.kernels' docstrings must run (they use the reference path)."""

import doctest
import importlib
import pkgutil

import pytest

import hybrid.kernels

MODULES = [info.name for info in pkgutil.iter_modules(hybrid.kernels.__path__, "hybrid.kernels.")
           if info.name != "hybrid.kernels.__main__"]


@pytest.mark.parametrize("name", MODULES)
def test_kernels_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0


def test_every_public_function_has_an_example():
    attempted = sum(doctest.testmod(importlib.import_module(name)).attempted for name in MODULES)
    assert attempted >= 10
