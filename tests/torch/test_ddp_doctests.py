"""The runnable examples in the torch frontend's docstrings must run (ZeRO's are in tests/torch_zero*)."""

import doctest

import pytest

import hybrid.torch._ddp
import hybrid.torch._ddp_logging
import hybrid.torch._ddp_parts


@pytest.mark.parametrize("module", [hybrid.torch._ddp, hybrid.torch._ddp_logging, hybrid.torch._ddp_parts])
def test_ddp_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
