"""The runnable examples in the torch frontend's docstrings must run (ZeRO's are in tests/torch_zero*)."""

import doctest

import pytest

import hybrid.torch._collectives
import hybrid.torch._cost_probe
import hybrid.torch._ready
import hybrid.torch.ddp._auto
import hybrid.torch.ddp._ddp
import hybrid.torch.ddp._logging
import hybrid.torch.ddp._parts


@pytest.mark.parametrize("module", [hybrid.torch.ddp._ddp, hybrid.torch.ddp._logging, hybrid.torch.ddp._parts,
                                    hybrid.torch.ddp._auto, hybrid.torch._cost_probe, hybrid.torch._ready,
                                    hybrid.torch._collectives])
def test_ddp_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
