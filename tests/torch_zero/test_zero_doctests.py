"""The runnable examples in the ZeRO modules' docstrings must run."""

import doctest

import pytest

import hybrid.torch.zero._parts
import hybrid.torch.zero._zero1


@pytest.mark.parametrize("module", [hybrid.torch.zero._zero1, hybrid.torch.zero._parts], ids=lambda m: m.__name__)
def test_module_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
