"""Checkpoints and what users already have: torch's state dicts, plain optax states, hybrid.jax.zero.

Same-framework round trips are exact (bitwise); torch -> optax is compared after one more step
with the parity tolerance (float32, two implementations of Adam's arithmetic).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import Mesh

import hybrid.jax as hj
from hybrid.checkpoint import Checkpoint, CheckpointError
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint import torch as ckpt_torch
from tests.jax._jax_model import CAPS, jitted, loss, make_batch, make_params, reference, shard_map_train


def _torch_adam(steps=3, cls=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = cls(model.parameters(), lr=0.01, **kw)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 5)).square().mean().backward()
        opt.step()
    return model, opt


def _fresh(cls=torch.optim.Adam, **kw):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    return model, cls(model.parameters(), lr=0.01, **kw)


def _assert_same_torch(model, opt, other, other_opt):
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    a, b = opt.state_dict(), other_opt.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for key in a["state"][i]:
            assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)


@pytest.mark.parametrize("cls, kw", [(torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.1}),
                                     (torch.optim.SGD, {"momentum": 0.9})])
def test_torch_state_dicts_out_and_in(tmp_path, cls, kw):
    model, opt = _torch_adam(cls=cls, **kw)
    ckpt_torch.save(tmp_path / "a", model, opt, step=3, world_size=2)
    model_sd, opt_sd = ckpt_torch.state_dicts(tmp_path / "a")
    other, other_opt = _fresh(cls, **kw)
    other.load_state_dict(model_sd)
    other_opt.load_state_dict(opt_sd)  # torch's own loader takes the dict as a plain optimizer's
    _assert_same_torch(model, opt, other, other_opt)
    assert opt_sd["param_groups"][0]["lr"] == 0.01

    # ... and back: a checkpoint made from the dicts loads into a fresh model at any world size.
    ckpt_torch.save_state_dicts(tmp_path / "b", model.state_dict(), opt.state_dict(), step=3, world_size=3)
    third, third_opt = _fresh(cls, **kw)
    assert ckpt_torch.load(tmp_path / "b", third, third_opt) == 3
    _assert_same_torch(model, opt, third, third_opt)


def _zero_run(num_devices, tx):
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("dp",))
    params = make_params()
    init, step = shard_map_train(tx, mesh, params)
    return params, init, step


def _leaves_close(a, b, rtol, atol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_plain_optax_state_into_zero_and_out(tmp_path):
    # Unsharded adam for 2 steps, saved in 3 files; loaded into zero(adam) on 2 devices, 3 more
    # steps must follow unsharded adam (rtol 1e-6, atol 2e-7 as tests/jax: a mean of per-device
    # means vs one mean). Every step jitted, the oracle's alike (compiling
    # is most of this test's time; op by op, each operation compiled alone).
    inner = optax.adam(0.05)
    history = reference(inner, make_params(), 5)

    @jitted
    def plain_step(params, state, x, y):
        u, state = inner.update(jax.grad(loss)(params, x, y), state, params)
        return optax.apply_updates(params, u), state

    params = make_params()
    state = inner.init(params)
    for i in range(2):
        params, state = plain_step(params, state, *make_batch(i))
    ckpt_jax.save(tmp_path / "plain", params, state, step=2, world_size=3)

    tx = hj.zero(inner, "dp", stage=2, **CAPS)
    start, init, step = _zero_run(2, tx)
    zstate = init(start)
    zparams, zstate, saved_step = ckpt_jax.load(tmp_path / "plain", start, zstate, **CAPS)
    assert saved_step == 2
    for i in range(2, 5):
        zparams, zstate = step(zparams, zstate, *make_batch(i))
    _leaves_close(zparams, history[4], 1e-6, 2e-7)

    # The zero state saved (2 device files) and loaded into a plain optax state: the same slots.
    ckpt_jax.save(tmp_path / "zero", zparams, zstate, step=5, **CAPS)
    assert Checkpoint(tmp_path / "zero").manifest.world_size == 2
    p2, s2, _ = ckpt_jax.load(tmp_path / "zero", make_params(), inner.init(make_params()), **CAPS)
    saved = Checkpoint(tmp_path / "zero")
    mu = saved.tensors("mu")
    got = {hj.key_path_name(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(s2[0].mu)[0]}
    assert got.keys() == mu.keys() and all(np.array_equal(got[k], mu[k]) for k in mu)
    assert int(s2[0].count) == 5
    _leaves_close(p2, zparams, 0, 0)


def test_zero_state_needs_its_layout(tmp_path):
    tx = hj.zero(optax.adam(0.1), "dp", **CAPS)
    start, init, _ = _zero_run(2, tx)
    state = init(start)
    with pytest.raises(CheckpointError, match="pass the order=, bucket caps, ready_order= and pairing= you gave hybrid.jax.zero"):
        ckpt_jax.save(tmp_path / "c", start, state, step=0)  # default caps: another plan
    ckpt_jax.save(tmp_path / "c", start, state, step=0, **CAPS)
    with pytest.raises(CheckpointError, match=r"holds adam state \['mu', 'nu'\], but the optax state \(TraceState\)"):
        ckpt_jax.load(tmp_path / "c", start, optax.sgd(0.1, momentum=0.9).init(start))


def test_torch_adam_into_optax_adam(tmp_path):
    # One more step from the loaded state must match torch's next step within the parity
    # tolerance: the two Adams round differently (eps placement, bias correction order).
    model, opt = _torch_adam(steps=3)
    ckpt_torch.save(tmp_path / "t", model, opt, step=3, world_size=2)
    params = {"0": {"weight": jnp.zeros((4, 5)), "bias": jnp.zeros(4)}, "2": {"weight": jnp.zeros((3, 4)), "bias": jnp.zeros(3)}}
    order = ["0.weight", "0.bias", "2.weight", "2.bias"]
    tx = optax.adam(0.01)
    params, state, step = ckpt_jax.load(tmp_path / "t", params, tx.init(params), order=order)
    assert step == 3 and int(state[0].count) == 3

    x = torch.randn(8, 5)
    opt.zero_grad()
    model(x).square().mean().backward()
    grads = {"0": {"weight": model[0].weight.grad.numpy(), "bias": model[0].bias.grad.numpy()},
             "2": {"weight": model[2].weight.grad.numpy(), "bias": model[2].bias.grad.numpy()}}
    opt.step()
    updates, _ = tx.update(jax.tree_util.tree_map(jnp.asarray, grads), state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(new["0"]["weight"]), model[0].weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["2"]["bias"]), model[2].bias.detach().numpy(), rtol=1e-5, atol=1e-6)
