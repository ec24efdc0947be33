"""hybrid's ZeRO2 and the overlap hooks against torch DDP + the plain optimizer on gloo worlds of
1, 2 and 3 processes. Every case of ``_cases.CASES`` runs in every world (one spawn per world size)."""

from tests.torch_zero import _harness
from tests.torch_zero2 import _cases

world_results, test_case = _harness.world_case_tests(_cases)
