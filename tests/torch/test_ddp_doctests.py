"""The runnable examples in the torch frontend's docstrings must run (ZeRO's are in tests/torch_zero*)."""

import doctest

import hybrid.torch._ddp


def test_ddp_doctests():
    result = doctest.testmod(hybrid.torch._ddp)
    assert result.attempted > 0 and result.failed == 0
