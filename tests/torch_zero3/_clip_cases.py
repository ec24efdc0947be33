"""ZeRO3Optimizer.clip_grad_norm_ on the Llama decoder (issue 44, item 5), in the worlds of
``_cases``: the float64 norm of the very gradient slices ZeRO3 holds (gathered from every rank) and
torch's ``clip_grad_norm_`` on a float32 copy of them are the oracles (``assert_clips_as_torch``:
its docstring and ``tests/torch_zero2/_clip_cases.py`` give the tolerances). One bucket (a slice of
the whole model, where the float32 norm of one long slice was 6e-5 off), a bucket per module, and
FSDP2's mixed precision (bfloat16 compute, float32 or bfloat16 reduction); norm types 2, inf and 1,
one backward each, SGD steps between them.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from hybrid.models import Llama, LlamaConfig
from hybrid.torch import ZeRO3, ZeRO3Optimizer
from tests.torch_zero2._clip_cases import clip_llama_steps


def clip_norm_llama(rank: int, world_size: int, *, layout: dict, reduce_dtype=None, mixed: bool = False) -> None:
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if mixed else None
    zero = ZeRO3(Llama(LlamaConfig()), mp_policy=policy, **layout)
    opt = ZeRO3Optimizer(zero, torch.optim.SGD, lr=1.0)
    clip_llama_steps(zero, opt, lambda: opt._gather_per_tensor(zero.bucket_plan, zero.shards, zero._grads.slices),
                     rank, f"ZeRO3 rank {rank}/{world_size} {layout} mixed={mixed} reduce {reduce_dtype}")


CLIP_CASES = {
    "clip_norm_llama[one_bucket]": functools.partial(clip_norm_llama, layout={}),
    "clip_norm_llama[memory_policy]": functools.partial(clip_norm_llama, layout={"policy": "memory"}),
    "clip_norm_llama[mixed-float32_reduce]": functools.partial(clip_norm_llama, layout={}, mixed=True,
                                                               reduce_dtype=torch.float32),
    "clip_norm_llama[mixed-bfloat16_reduce]": functools.partial(clip_norm_llama, layout={"bucket_cap_mb": 0.2},
                                                                mixed=True),
}
