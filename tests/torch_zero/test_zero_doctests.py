"""The runnable example in the ZeroRedundancyOptimizer docstring must run."""

import doctest

import hybrid.torch._zero


def test_module_doctests():
    result = doctest.testmod(hybrid.torch._zero)
    assert result.attempted > 0 and result.failed == 0
