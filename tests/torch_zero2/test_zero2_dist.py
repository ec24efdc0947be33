"""hybrid's ZeRO2 against torch DDP + the plain optimizer on gloo worlds of 1, 2 and 3 processes.
Every case of ``_cases.CASES`` runs in every world (one spawn per world size)."""

import pytest

from tests.torch_zero import _harness
from tests.torch_zero2 import _cases

WORLD_SIZES = (1, 2, 3)
CASE_IDS = sorted(_cases.CASES)


@pytest.fixture(scope="module")
def world_results():
    results = {}

    def get(world_size):
        if world_size not in results:
            results[world_size] = _harness.run_world(_cases.__name__, CASE_IDS, world_size, timeout_s=170)
        return results[world_size]
    return get


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(world_results, world_size, case_id):
    errors = world_results(world_size)[case_id]
    assert not errors, "\n".join(errors)
