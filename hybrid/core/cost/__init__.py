"""What communication costs: collectives by the textbook latency-bandwidth model, fitted to a
measured process group, a training step's communication under DDP and ZeRO stages 1-3, and the
bucket plan that the cost model says ends the backward's communication soonest."""

from hybrid.core.cost._auto import auto_plan
from hybrid.core.cost._collectives import (COLLECTIVES, NETWORKS, PROBE_SIZES, CostModel, Fit, Link,
                                           collective_seconds, wire_bytes)
from hybrid.core.cost._step import STAGES, StepCost, step_cost
from hybrid.core.cost._stream import exposed_seconds, stream_ends
from hybrid.core.cost._timeline import CopyCost, StepTimeline, predict_step, ready_times_by_elements

__all__ = ["COLLECTIVES", "NETWORKS", "PROBE_SIZES", "STAGES", "CopyCost", "CostModel", "Fit", "Link", "StepCost",
           "StepTimeline", "auto_plan", "collective_seconds", "exposed_seconds", "predict_step",
           "ready_times_by_elements", "step_cost", "stream_ends", "wire_bytes"]
