"""torch's own ``test_ddp_zero_overlap`` procedure (PyTorch's
test/distributed/optim/test_zero_redundancy_optimizer.py, read at pytorch/pytorch commit
0807990db8a3355cef4d9916494907e18c35f431) against hybrid's DDP, ZeRO and overlap hooks, on gloo
and CPU where upstream runs it only on NCCL and GPUs (torch's hooks refuse gloo: pytorch/pytorch
issue 62300): all 16 CPU parametrizations in a world of 2 processes (upstream's CPU world size),
4 of them in a world of 3, plus two cases with different inputs per rank in both. What was read
upstream, what was adapted and why: ``_torch_overlap_cases``.

One spawn per world size runs all of that world's cases (``_harness.run_world``); a hung
collective raises after the harness's 45 s process-group timeout, the spawn is abandoned after
150 s, and each test has a pytest timeout, so a hang fails.
"""

import pytest

from tests.torch_zero import _harness, _torch_overlap_cases

pytestmark = pytest.mark.timeout(170)

_PAIRS = [(case_id, w) for case_id, worlds in _torch_overlap_cases.WORLD_SIZES.items() for w in worlds]


@pytest.fixture(scope="module")
def world_results():
    results = {}

    def get(world_size):
        if world_size not in results:
            case_ids = [c for c, w in _PAIRS if w == world_size]
            results[world_size] = _harness.run_world(_torch_overlap_cases.__name__, case_ids, world_size,
                                                     timeout_s=150)
        return results[world_size]
    return get


@pytest.mark.parametrize(("case_id", "world_size"), _PAIRS)
def test_case(world_results, case_id, world_size):
    errors = world_results(world_size)[case_id]
    assert not errors, "\n".join(errors)
