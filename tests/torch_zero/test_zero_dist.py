"""hybrid's ZeroRedundancyOptimizer against torch's and against DDP + the plain optimizer,
on gloo worlds of 1, 2 and 3 processes. Every case of ``_cases.CASES`` runs in every world."""

from tests.torch_zero import _cases, _harness

world_results, test_case = _harness.world_case_tests(_cases)
