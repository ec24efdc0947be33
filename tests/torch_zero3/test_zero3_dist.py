"""hybrid's ZeRO3 against torch DDP + the plain optimizer (and FSDP2 for mixed precision) on gloo
worlds of 1, 2 and 3 processes. Every case of ``_cases.CASES`` runs in every world (one spawn per
world size)."""

from tests.torch_zero import _harness
from tests.torch_zero3 import _cases

world_results, test_case = _harness.world_case_tests(_cases)
