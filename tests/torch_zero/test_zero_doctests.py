"""The runnable example in the ZeroRedundancyOptimizer docstring must run."""

import doctest

import hybrid.torch.zero._zero1


def test_module_doctests():
    result = doctest.testmod(hybrid.torch.zero._zero1)
    assert result.attempted > 0 and result.failed == 0
