"""The runnable examples in docstrings and docs/ must run."""

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ["hybrid.core._arrays", "hybrid.core._assign", "hybrid.core._buckets", "hybrid.core._dtypes", "hybrid.core._graph_split", "hybrid.core._reducer_state",
           "hybrid.core.mapping._layout", "hybrid.core.mapping._mapping", "hybrid.core.mapping._pairing",
           "hybrid.core._memory", "hybrid.core._reshard", "hybrid.core._shard", "hybrid.core._spec", "hybrid.core._state_dir", "hybrid.cli._table",
           "hybrid.bench._stats", "hybrid.core.cost._collectives", "hybrid.core.cost._step", "hybrid.core.cost._stream", "hybrid.core.cost._timeline", "hybrid.core._zero3",
           "hybrid.core.cost._auto"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_examples(page):
    result = doctest.testfile(str(ROOT / "docs" / page), module_relative=False)
    assert result.failed == 0
