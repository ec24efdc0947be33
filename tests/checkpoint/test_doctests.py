"""The runnable examples in hybrid.checkpoint's docstrings run."""

import doctest
import importlib

import pytest

MODULES = ["hybrid.checkpoint._files", "hybrid.checkpoint._shard_file", "hybrid.checkpoint._write", "hybrid.checkpoint._manifest",
           "hybrid.checkpoint.torch._save", "hybrid.checkpoint.torch._load", "hybrid.checkpoint.jax._save",
           "hybrid.checkpoint.jax._load",
           "hybrid.checkpoint.jax._optax_groups", "hybrid.checkpoint._leftovers", "hybrid.checkpoint._foreign",
           "hybrid.checkpoint._formats", "hybrid.checkpoint._renamed", "hybrid.checkpoint._convert",
           "hybrid.checkpoint.dcp._reader", "hybrid.checkpoint.orbax._reader",
           "hybrid.checkpoint.dcp._records"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
