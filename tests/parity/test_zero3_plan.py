"""One stage-3 plan in both frameworks (issue 26): ``hybrid.jax.shard_params`` cuts the buckets of
``hybrid.torch.ZeRO3`` for the same model, so the two sides' plans and shard plans have one
fingerprint, on the twin MLP of hybrid.demo (by ``order=`` and by a pairing) and on the GPT pair
of hybrid.models (through GPT_MAPPING), at ZeRO3's default cap and at a small one.

The oracle is hybrid's torch ZeRO3 itself, built in one gloo process; the JAX side only sees the
JAX tree (and the pairing's torch names, shapes and order). ``jax.eval_shape`` gives the
ParamShards' static layout without computing anything.
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.sharding import PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import shard_flat
from hybrid.demo import TorchMLP, host_mesh, init_params, jax_params, param_order
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig, TorchGPT
from hybrid.parity import pair_models
from hybrid.torch import ZeRO3
from tests.parity._pairs import MLP_MAPPING
from tests.torch_zero2.test_zero2_local import world_of_one  # noqa: F401 - a fixture: one gloo process

MiB = 1 << 20
MLP_SIZES = (16, 300, 300, 300, 4)  # ~0.7 MiB of float32: one bucket at the default cap, several at 0.05 MiB
GPT = GPTConfig()  # ~0.94M parameters, 3.6 MiB: several 1 MiB buckets at the default cap


def _jax_layout(params, **plan_kw):
    """The ShardLayout shard_params gives ``params`` on 2 devices (shapes only: nothing computed)."""
    cut = jax.shard_map(lambda p: hj.shard_params(p, "dp", **plan_kw), mesh=host_mesh(2), in_specs=P(),
                        out_specs=P("dp"))
    return jax.eval_shape(cut, params).layout


def _torch_plan(module, cap_mb):
    return ZeRO3(module, bucket_cap_mb=cap_mb).bucket_plan


def _mlp(by):
    params = jax_params(init_params(0, MLP_SIZES))
    if by == "order":
        return params, dict(order=param_order(MLP_SIZES))
    return params, dict(pairing=pair_models(TorchMLP(MLP_SIZES), params, MLP_MAPPING))


def _gpt():
    model = FlaxGPT(GPT)
    like = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    return params, dict(pairing=pair_models(TorchGPT(GPT), params, GPT_MAPPING))


@pytest.mark.parametrize("cap_mb", [None, 0.05])
@pytest.mark.parametrize("model", ["mlp by order", "mlp by pairing", "gpt by GPT_MAPPING"])
def test_jax_stage3_plan_is_torch_zero3s(world_of_one, model, cap_mb):
    torch.manual_seed(0)
    if model.startswith("mlp"):
        params, plan_kw = _mlp(model.split()[-1])
        torch_plan = _torch_plan(TorchMLP(MLP_SIZES), cap_mb)
    else:
        params, plan_kw = _gpt()
        torch_plan = _torch_plan(TorchGPT(GPT), cap_mb)
    caps = {} if cap_mb is None else dict(bucket_cap_bytes=int(cap_mb * MiB))
    layout = _jax_layout(params, **plan_kw, **caps)
    plan = layout.layout.plan
    assert [[plan.specs[m].name for m in b.members] for b in plan.buckets] == \
        [[torch_plan.specs[m].name for m in b.members] for b in torch_plan.buckets]
    assert plan.fingerprint() == torch_plan.fingerprint()
    assert layout.shards.fingerprint() == shard_flat(torch_plan, 2).fingerprint()
    # Several buckets in every case but the MLP at the default cap (one 0.7 MiB bucket).
    assert (plan.num_buckets == 1) == (model.startswith("mlp") and cap_mb is None)

