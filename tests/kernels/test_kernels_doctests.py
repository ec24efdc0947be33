"""The runnable examples in hybrid.kernels' docstrings must run (they use the reference path)."""

import doctest

import hybrid.kernels


def test_kernels_doctests():
    result = doctest.testmod(hybrid.kernels)
    assert result.attempted > 0 and result.failed == 0
