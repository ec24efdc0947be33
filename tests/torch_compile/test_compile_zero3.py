"""torch.compile of a ZeRO3 model, whole and per block before wrapping, against eager ZeRO3 at
1, 2 and 3 gloo ranks (cases, tolerances and which run where: ``_zero3_cases``).

A world of its own, one spawn per world size: each case resets dynamo and counts the frames and
graphs it compiles, so no other file's compiles may share the processes (and the compile cases'
world sizes, 1-3, are not ``test_compile_dist``'s 2).
"""

import doctest

import pytest

from hybrid.torch.zero.zero3 import _units
from tests.torch_compile import _zero3_cases
from tests.torch_zero import _harness


@pytest.fixture(scope="module")
def world_results():
    results = {}

    def get(world_size):
        if world_size not in results:
            results[world_size] = _harness.run_world(_zero3_cases.__name__, list(_zero3_cases.WORLDS[world_size]),
                                                     world_size, timeout_s=400)
        return results[world_size]
    return get


@pytest.mark.parametrize("world_size, case_id", [(w, c) for w, ids in _zero3_cases.WORLDS.items() for c in ids])
def test_case(world_results, world_size, case_id):
    errors = world_results(world_size)[case_id]
    assert not errors, "\n".join(errors)


def test_units_doctest():
    """Which modules carry the hooks, eager and compiled (``select_units``'s examples)."""
    result = doctest.testmod(_units)
    assert result.attempted > 0 and result.failed == 0
