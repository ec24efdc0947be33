"""What the batched copies of a plan should cost on a GPU, before one is lent: bytes and launches
per bucket (counted as the host code will cut them) turned into time at the device's memory
bandwidth, and set against a training step of the same model.

The model is deliberately simple, so the first GPU run can check each term:
``time = launches * launch_s + (bytes read + bytes written) / (hbm_bytes_per_s * copy_efficiency)``.
"""

from __future__ import annotations

import dataclasses

from hybrid.core import BucketPlan, itemsize
from hybrid.kernels._copies import gather_copies
from hybrid.kernels._tables import count_launches


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """A GPU as the projection sees it. Every figure is a stated assumption, not a measurement."""

    name: str
    hbm_bytes_per_s: float  # peak memory bandwidth, the datasheet's
    launch_s: float  # one launch with a 13 KiB parameter block, back to back on a stream
    copy_efficiency: float  # the fraction of peak a large device-to-device copy reaches
    dense_bf16_flops: float  # peak dense bf16 tensor-core rate, for the step it is set against


# H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA's datasheet). Copies reach ~85-90% of
# peak on HBM3; a kernel launch costs a few microseconds of host time.
H100_SXM = Device("H100 SXM (HBM3, 3.35 TB/s)", 3.35e12, 5e-6, 0.85, 989e12)
# H200 SXM: the H100's chip with 4.8 TB/s HBM3e (NVIDIA's datasheet); the same launch and
# copy-efficiency assumptions, so a run on either card checks the same two terms.
H200_SXM = Device("H200 SXM (HBM3e, 4.8 TB/s)", 4.8e12, 5e-6, 0.85, 989e12)
DEVICES = {"h100": H100_SXM, "h200": H200_SXM}


@dataclasses.dataclass(frozen=True, slots=True)
class BucketCopy:
    """One bucket's gather (gradients in) and scatter (results out), projected."""

    bucket: int
    tensors: int
    bucket_bytes: int
    launches: int  # gather + scatter
    bytes_moved: int  # read + written, gather + scatter
    seconds: float


def project_plan(plan: BucketPlan, device: Device = H100_SXM) -> list[BucketCopy]:
    """Per bucket: the launches the kernels take to fill it and empty it, and the time they cost.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec(f"w{i}", (1024, 1024), "float32") for i in range(8)])
    >>> [(c.tensors, c.launches) for c in project_plan(plan)]
    [(7, 2), (1, 2)]
    """
    out = []
    for b, bucket in enumerate(plan.buckets):
        size = itemsize(bucket.dtype)
        # addresses do not change the count: only sizes and the zero fills of gaps do
        srcs, _, numels = gather_copies([1] * len(bucket.members), bucket.numels, bucket.offsets, 0,
                                        bucket.length, size)
        gather = count_launches([n * size for n in numels], zero_fills=[s == 0 for s in srcs])
        scatter = count_launches([n * size for n in bucket.numels])
        member_bytes = sum(bucket.numels) * size
        moved = (member_bytes + bucket.length * size) + 2 * member_bytes  # gather reads+writes, scatter too
        launches = gather.launches + scatter.launches
        seconds = launches * device.launch_s + moved / (device.hbm_bytes_per_s * device.copy_efficiency)
        out.append(BucketCopy(b, len(bucket.members), bucket.nbytes, launches, moved, seconds))
    return out


def transformer_step_seconds(num_params: int, *, layers: int, width: int, context: int, tokens: int,
                             mfu: float = 0.4, device: Device = H100_SXM) -> float:
    """A decoder's training step (forward + backward) at ``mfu`` of the device's bf16 peak.

    FLOPs per token ``6 N + 12 L d T`` (the weights' matmuls and attention; PaLM's appendix B, as
    nanoGPT's MFU estimate counts them).

    >>> round(transformer_step_seconds(124_439_808, layers=12, width=768, context=1024, tokens=8192), 4)
    0.0178
    """
    flops = (6 * num_params + 12 * layers * width * context) * tokens
    return flops / (mfu * device.dense_bf16_flops)
