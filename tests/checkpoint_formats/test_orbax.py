"""orbax checkpoints in and out: orbax -> hybrid.jax.zero (stages 1-3, another device count) ->
torch (through the mapping) -> orbax, and orbax -> torch directly.

The foreign checkpoint is written by orbax's own API: a flax ``TrainState`` (the flax twin of
_pair's MLP, ``optax.adamw``) whose arrays are sharded over 2 devices (``NamedSharding``, the
kernels and biases whose first dimension divides split over ``"dp"``) is saved by an
``ocp.CheckpointManager`` at step 3 of a 6-step run; the run goes on uninterrupted as the
reference. The last hand-over goes back to orbax: hybrid converts the torch run's checkpoint,
and orbax's ``StandardCheckpointer.restore`` gives a ``TrainState`` that trains on.

Tolerances, and why:
- loads move and relay elements, computing nothing: compared bit for bit;
- hybrid.jax.zero on 3 devices against the 2-device orbax run: the order of the float32
  additions of the gradient mean changes: tests/jax's rtol 1e-6, atol 2e-7;
- through torch: another implementation of the model and of AdamW: the parity tolerance of
  tests/checkpoint/test_optax_groups.py (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import convert, open_checkpoint
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint import torch as ckpt_torch
from hybrid.parity import named_jax
from tests.checkpoint_formats import _pair

SAVE, HANDOFF, TO_ORBAX, STEPS = 3, 4, 5, 6
SAME = dict(rtol=1e-6, atol=2e-7)
CROSS = dict(rtol=1e-5, atol=1e-6)
TX = lambda: optax.adamw(0.01, weight_decay=0.1)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("dp",))


def _train_state(mesh):
    """A fresh TrainState with every array placed on ``mesh`` (the optimizer's count replicated)."""
    state = train_state.TrainState.create(apply_fn=None, params=_sharded(_pair.flax_params(), mesh), tx=TX())
    return state.replace(opt_state=_sharded(state.opt_state, mesh))


def _sharded(tree, mesh):
    """Each array split over "dp" along its first dimension where it divides, else replicated."""
    def place(x):
        split = x.ndim >= 1 and x.shape[0] % mesh.size == 0
        return jax.device_put(x, NamedSharding(mesh, P("dp") if split else P()))
    return jax.tree.map(place, tree)


@jax.jit
def _orbax_step(state: train_state.TrainState, x):
    return state.apply_gradients(grads=jax.grad(_pair.flax_loss)(state.params, x))


def _flat(params) -> dict:
    return {k: np.asarray(v) for k, v in named_jax(params).items()}


@functools.cache
def _orbax_run(root: str):
    """The orbax run: a sharded TrainState, saved at SAVE by a CheckpointManager, run to STEPS."""
    mesh = _mesh(2)
    state = _train_state(mesh)
    with ocp.CheckpointManager(f"{root}/orbax") as manager:
        for i in range(STEPS):
            if i == SAVE:
                manager.save(i, args=ocp.args.StandardSave(state))
                manager.wait_until_finished()
            state = _orbax_step(state, jnp.asarray(_pair.batch(i)))
    return _flat(state.params)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    _orbax_run(str(root))
    return root


def _zero_loop(stage, mesh, params):
    """``(init, step)`` of hybrid.jax.zero at ``stage`` over ``mesh``, on the flax twin."""
    tx = hj.zero(TX(), "dp", stage=stage)
    specs = hj.state_specs(tx, params, "dp", axis_size=mesh.size)
    dp = P("dp") if stage == 3 else P()
    loss = hj.gathered(_pair.flax_loss) if stage == 3 else _pair.flax_loss
    grad = jax.grad(loss) if stage == 3 else hj.local_grad(loss, "dp")

    def step(params, state, x):
        updates, state = tx.update(grad(params, x), state, params)
        return optax.apply_updates(params, updates), state

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=dp, out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(dp, specs, P("dp")), out_specs=(dp, specs)))
    return init, step


def _zero_resume(path, stage, n=3):
    mesh = _mesh(n)
    params = jax.tree.map(jnp.zeros_like, _pair.flax_params())  # the load must replace every value
    if stage == 3:
        params = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "dp"), mesh=mesh, in_specs=P(),
                                       out_specs=P("dp")))(params)
    init, step = _zero_loop(stage, mesh, params)
    params, state, at = ckpt_jax.load(path, params, init(params))
    return params, state, at, step


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_3_devices_resumes_the_orbax_run(root, stage):
    params, state, at, step = _zero_resume(root / "orbax", stage)
    assert at == SAVE
    for i in range(SAVE, STEPS):
        params, state = step(params, state, jnp.asarray(_pair.batch(i)))
    got = _flat(hj.unshard_params(params) if stage == 3 else params)
    want = _orbax_run(str(root))
    print(f"stage {stage}, 3 devices, resumed vs orbax's uninterrupted run: max |diff| "
          f"{max(float(np.max(np.abs(got[k] - want[k]))) for k in want):.2e}")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **SAME, err_msg=name)


def _torch_step(model, opt, i):
    opt.zero_grad()
    model(torch.from_numpy(_pair.batch(i))).pow(2).mean().backward()
    opt.step()


def test_orbax_loads_into_torch_through_the_mapping(root):
    """The orbax checkpoint straight into a torch model and AdamW: parameters and moments are
    orbax's arrays relaid (transposed kernels), bit for bit; trained on, torch follows orbax."""
    model = _pair.torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    assert ckpt_torch.load(root / "orbax", model, opt, mapping=_pair.mapping()) == SAVE
    saved = open_checkpoint(root / "orbax")
    pairing = _pair.mapping().pair({s.name: s.shape for s in saved.manifest.plan.specs})
    for kind, key in (("params", None), ("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        want = pairing.to_torch(saved.tensors(kind))
        for name, p in model.named_parameters():
            got = p.detach() if key is None else opt.state[p][key]
            np.testing.assert_array_equal(got.numpy(), want[name], err_msg=f"{kind} {name}")
    assert all(int(opt.state[p]["step"]) == SAVE for p in model.parameters())
    for i in range(SAVE, STEPS):
        _torch_step(model, opt, i)
    want = pairing.to_torch(_orbax_run(str(root)))
    print(f"torch resumed from orbax vs orbax's uninterrupted run: max |diff| "
          f"{max(float(np.max(np.abs(p.detach().numpy() - want[n]))) for n, p in model.named_parameters()):.2e}")
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), want[name], **CROSS, err_msg=name)


def test_orbax_to_hybrid_jax_to_torch_to_orbax(root, tmp_path):
    mapping = _pair.mapping()
    # orbax -> hybrid.jax.zero stage 2 on 3 devices, saved at HANDOFF under torch's names.
    params, state, at, step = _zero_resume(root / "orbax", 2)
    for i in range(at, HANDOFF):
        params, state = step(params, state, jnp.asarray(_pair.batch(i)))
    ckpt_jax.save(tmp_path / "jax", params, state, step=HANDOFF, stage=2, mapping=mapping)
    # -> torch (a plain model and AdamW), saved at TO_ORBAX.
    model = _pair.torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    assert ckpt_torch.load(tmp_path / "jax", model, opt) == HANDOFF
    for i in range(HANDOFF, TO_ORBAX):
        _torch_step(model, opt, i)
    ckpt_torch.save(tmp_path / "torch", model, opt, step=TO_ORBAX)
    # -> orbax, laid out as the resuming run's sharded TrainState, restored by orbax's own API.
    mesh = _mesh(2)
    like = _train_state(mesh)
    convert(tmp_path / "torch", tmp_path / "back", to="orbax", like=(like.params, like.opt_state), mapping=mapping)
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(tmp_path / "back", like)
    assert int(state.step) == TO_ORBAX and int(state.opt_state[0].count) == TO_ORBAX
    kernel = state.params["Dense_2"]["kernel"]
    assert kernel.sharding == like.params["Dense_2"]["kernel"].sharding and len(kernel.sharding.device_set) == 2
    np.testing.assert_array_equal(np.asarray(kernel), model[4].weight.detach().numpy().T)
    for i in range(TO_ORBAX, STEPS):
        state = _orbax_step(state, jnp.asarray(_pair.batch(i)))
    got, want = _flat(state.params), _orbax_run(str(root))
    print(f"orbax -> JAX zero -> torch -> orbax vs orbax's uninterrupted run: max |diff| "
          f"{max(float(np.max(np.abs(got[k] - want[k]))) for k in want):.2e}")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **CROSS, err_msg=name)
