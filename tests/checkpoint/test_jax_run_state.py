"""The JAX side of a run's state: buffers (flax's batch_stats) and the user's JSON, saved and given
back; a torch run's BatchNorm statistics read by name; torch's per-parameter optimizer state
refused where optax cannot hold it (bitwise: loading copies, it computes nothing)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from hybrid.checkpoint import CheckpointError, read_state
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint import torch as ckpt_torch


def test_buffers_and_state_round_trip(tmp_path):
    params = {"dense": {"kernel": jnp.ones((3, 2))}}
    stats = {"bn": {"mean": jnp.arange(2.0), "var": jnp.full(2, 3.0)}}
    tx = optax.adam(1e-3)
    ckpt_jax.save(tmp_path / "ckpt", params, tx.init(params), step=4, world_size=2, buffers=stats,
                  state={"epoch": 1, "data_position": 640})
    like = {"bn": {"mean": jnp.zeros(2), "var": jnp.zeros(2)}}
    back = ckpt_jax.load_buffers(tmp_path / "ckpt", like)
    np.testing.assert_array_equal(back["bn"]["var"], stats["bn"]["var"])
    assert read_state(tmp_path / "ckpt") == {"epoch": 1, "data_position": 640}
    with pytest.raises(CheckpointError, match=r"buffers differ: buffers has \['bn.count'\]"):
        ckpt_jax.load_buffers(tmp_path / "ckpt", {"bn": {**like["bn"], "count": jnp.zeros(())}})
    with pytest.raises(ValueError, match=r"the state must be JSON-serializable: 'key' is not"):
        ckpt_jax.save(tmp_path / "bad", params, step=0, state={"key": jnp.zeros(2)})


def test_torch_batchnorm_statistics_load_into_jax_by_name(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(8, 4))  # one training-mode forward moves the statistics
    ckpt_torch.save(tmp_path / "ckpt", model, step=1)
    like = {"1": {"running_mean": jnp.zeros(3), "running_var": jnp.zeros(3),
                  "num_batches_tracked": jnp.zeros((), jnp.int32)}}
    back = ckpt_jax.load_buffers(tmp_path / "ckpt", like)
    np.testing.assert_array_equal(back["1"]["running_mean"], model[1].running_mean.numpy())
    assert int(back["1"]["num_batches_tracked"]) == 1


def test_torch_state_per_parameter_is_refused_in_optax(tmp_path):
    """A parameter that never had a gradient has no torch state: optax would invent count and zeros."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model[0](torch.randn(8, 4)).sum().backward()
    opt.step()
    ckpt_torch.save(tmp_path / "ckpt", model, opt, step=1)
    params = {"0": {"weight": jnp.zeros((3, 4)), "bias": jnp.zeros(3)},
              "1": {"weight": jnp.zeros((2, 3)), "bias": jnp.zeros(2)}}
    with pytest.raises(CheckpointError, match=r"no state yet: \['1.weight', '1.bias'\]"):
        ckpt_jax.load(tmp_path / "ckpt", params, optax.adam(1e-2).init(params))
