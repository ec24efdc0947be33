"""Per-rank memory under DDP and ZeRO stages 1-3, by the ZeRO paper's formulas.

Rajbhandari et al. (2020), section 5: with Psi parameters, K bytes of optimizer state per
parameter and Nd data-parallel ranks, a rank holds
  DDP:    params + grads + K * Psi
  ZeRO-1: params + grads + K * Psi / Nd            (optimizer states partitioned, P_os)
  ZeRO-2: params + grads / Nd + K * Psi / Nd       (gradients partitioned too, P_os+g)
  ZeRO-3: (params + grads + K * Psi) / Nd           (parameters partitioned too, P_os+g+p)
Stage 3 also holds full buckets while they are used (hybrid.core.zero3_memory: the working set,
which the paper leaves out). The paper's Adam example has K = 12 (fp32 master weights, momentum, variance); here K follows the
chosen optimizer, with 4 more bytes when fp32 master weights are kept (mixed precision).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybrid.core._spec import TensorSpec, check_specs

# fp32 state tensors each optimizer keeps per parameter.
OPTIMIZER_STATE_COPIES = {"sgd": 0, "momentum": 1, "adagrad": 1, "lion": 1, "adam": 2, "adamw": 2}


@dataclasses.dataclass(frozen=True, slots=True)
class ZeroMemory:
    """Bytes per rank; ``*_formula`` are the paper's, the rest use an actual partition."""

    num_params: int
    param_bytes: int
    grad_bytes: int
    state_bytes_per_param: int
    world_size: int

    @property
    def ddp(self) -> float:
        return self.param_bytes + self.grad_bytes + self.state_bytes_per_param * self.num_params

    @property
    def zero1(self) -> float:
        return self.param_bytes + self.grad_bytes + self.state_bytes_per_param * self.num_params / self.world_size

    @property
    def zero2(self) -> float:
        return (self.param_bytes + self.grad_bytes / self.world_size
                + self.state_bytes_per_param * self.num_params / self.world_size)

    @property
    def zero3(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.state_bytes_per_param * self.num_params) / self.world_size


def zero_memory(specs: Sequence[TensorSpec], world_size: int, optimizer: str = "adam", *,
                master_weights: bool = False) -> ZeroMemory:
    """The ZeRO paper's per-rank memory model for these parameters.

    >>> m = zero_memory([TensorSpec("w", (1000,), "float32")], 4, "adam")
    >>> m.ddp, m.zero1, m.zero2, m.zero3
    (16000, 10000.0, 7000.0, 4000.0)
    """
    specs = check_specs(specs)
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE_COPIES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    k = 4 * (OPTIMIZER_STATE_COPIES[optimizer] + int(master_weights))
    nbytes = sum(s.nbytes for s in specs)
    return ZeroMemory(sum(s.numel for s in specs), nbytes, nbytes, k, world_size)
