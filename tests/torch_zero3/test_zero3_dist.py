"""hybrid's ZeRO3 against torch DDP + the plain optimizer (and FSDP2 for mixed precision) on gloo
worlds of 1, 2 and 3 processes. Every case of ``_cases.CASES`` runs in every world (one spawn per
world size).

The three worlds run at once: a world's ranks spend much of a case waiting for each other in small
collectives (a few bytes to a few KB each), time in which the other worlds' ranks use the cores.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.torch_zero import _harness
from tests.torch_zero3 import _cases

WORLD_SIZES = (1, 2, 3)
CASE_IDS = sorted(_cases.CASES)


@pytest.fixture(scope="module")
def world_results():
    with ThreadPoolExecutor(len(WORLD_SIZES)) as pool:
        runs = {w: pool.submit(_harness.run_world, _cases.__name__, CASE_IDS, w, timeout_s=170) for w in WORLD_SIZES}
    return {w: run.result() for w, run in runs.items()}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(world_results, world_size, case_id):
    errors = world_results[world_size][case_id]
    assert not errors, "\n".join(errors)
