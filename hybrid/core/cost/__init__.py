"""What communication costs: collectives by the textbook latency-bandwidth model, fitted to a
measured process group, and a training step's communication under DDP and ZeRO stages 1-3."""

from hybrid.core.cost._collectives import (COLLECTIVES, NETWORKS, PROBE_SIZES, CostModel, Fit, Link,
                                           collective_seconds, exposed_seconds, wire_bytes)
from hybrid.core.cost._step import STAGES, StepCost, step_cost

__all__ = ["COLLECTIVES", "NETWORKS", "PROBE_SIZES", "STAGES", "CostModel", "Fit", "Link", "StepCost",
           "collective_seconds", "exposed_seconds", "step_cost", "wire_bytes"]
