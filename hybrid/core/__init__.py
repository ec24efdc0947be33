"""Pure planning: TensorSpec -> BucketPlan, ZeRO ownership, pack/unpack. Imports numpy only."""

from hybrid.core._arrays import bucket_pieces, pack, take_shard, unpack
from hybrid.core._assign import compute_bucket_assignment_by_size
from hybrid.core._buckets import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_FIRST_BUCKET_CAP_BYTES,
    MiB,
    Bucket,
    BucketPlan,
    ddp_size_limits,
    plan_buckets,
    rebuild_plan,
)
from hybrid.core.cost import (COLLECTIVES, NETWORKS, STAGES, CopyCost, CostModel, Fit, Link, StepCost, StepTimeline,
                              auto_plan, collective_seconds, exposed_seconds, predict_step, ready_times_by_elements,
                              step_cost, stream_ends, wire_bytes)
from hybrid.core._dtypes import canonical_dtype, itemsize
from hybrid.core.mapping import FLAX_RULES, Layout, MappingError, Pair, ParamMapping, ParamPairing, Rule
from hybrid.core._graph_split import GraphSplitPlan, merge_piece, plan_graph_split, split_size_limits
from hybrid.core._memory import OPTIMIZER_STATE_COPIES, ZeroMemory, zero_memory
from hybrid.core._shard import (
    BucketAssignment,
    BucketSubset,
    FlatShardPlan,
    GroupRun,
    MemberSlice,
    ParamPartition,
    assign_buckets,
    partition_params,
    shard_flat,
)
from hybrid.core._reshard import ReshardPlan, ShardCopy, reshard
from hybrid.core._reducer_state import ReducerState, mark_ready, mark_unused, start_iteration
from hybrid.core._spec import TensorSpec
from hybrid.core._zero3 import (Zero3Memory, forward_order, gather_windows, zero3_bucket_cap, zero3_group_plan,
                                zero3_memory, zero3_plan)

__all__ = [
    "COLLECTIVES", "DEFAULT_BUCKET_CAP_BYTES", "DEFAULT_FIRST_BUCKET_CAP_BYTES", "FLAX_RULES", "MiB", "NETWORKS",
    "STAGES", "CostModel", "Fit", "Layout", "Link", "MappingError", "Pair", "ParamMapping", "ParamPairing", "Rule",
    "CopyCost", "StepCost", "StepTimeline", "auto_plan", "collective_seconds", "exposed_seconds", "predict_step",
    "ready_times_by_elements", "step_cost", "stream_ends", "wire_bytes",
    "Bucket", "BucketAssignment", "BucketPlan", "BucketSubset", "FlatShardPlan", "GraphSplitPlan", "GroupRun", "MemberSlice",
    "OPTIMIZER_STATE_COPIES", "ParamPartition", "ReducerState", "ReshardPlan", "ShardCopy", "TensorSpec", "ZeroMemory",
    "assign_buckets", "canonical_dtype", "compute_bucket_assignment_by_size", "ddp_size_limits",
    "itemsize", "mark_ready", "mark_unused", "merge_piece", "pack", "partition_params", "plan_buckets", "plan_graph_split", "rebuild_plan", "reshard", "shard_flat", "split_size_limits", "start_iteration",
    "take_shard", "unpack", "zero_memory",
    "Zero3Memory", "bucket_pieces", "forward_order", "gather_windows", "zero3_bucket_cap", "zero3_group_plan", "zero3_memory",
    "zero3_plan",
]
