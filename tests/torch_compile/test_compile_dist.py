"""torch.compile(hybrid DDP) with graph splits, 2 gloo ranks: against eager hybrid DDP and torch's
compiled DDP (its DDPOptimizer). All cases run in one spawn of two ranks."""

from tests.torch_compile import _cases
from tests.torch_zero import _harness

world_results, test_case = _harness.world_case_tests(_cases, world_sizes=(2,), timeout_s=170)
