"""torch DCP checkpoints in and out: FSDP2 -> hybrid torch (ZeRO3; at 3 ranks DDP, ZeRO-1, ZeRO2,
ZeRO3) -> DCP -> FSDP2, and FSDP2 -> flax + optax -> DCP -> FSDP2.

Every foreign checkpoint is written by torch's own calls: an FSDP2 run (``fully_shard`` per
Linear and on the root, CPU mesh, 2 gloo ranks) saves ``dcp.save({"model": ..., "optim": ...})``
of ``get_state_dict(model, optimizer)`` at step 3 of 6, for AdamW, Adam and SGD with momentum,
each with two param groups (decay on the weights only, twice the lr on the biases). The resumed
runs build their optimizers with other learning rates: the load must restore the saved ones.

Tolerances, and why:
- hybrid ZeRO3 at 2 ranks resumed from FSDP2 equals FSDP2's uninterrupted run bit for bit (the
  two agree bit for bit on gloo: a sum of two gradients is the same in either order, the
  division by 2 is exact, and both step torch's optimizer elementwise on the same values); so
  does the chain FSDP2 -> ZeRO3 -> (hybrid checkpoint, converted to DCP) -> FSDP2.
- at 3 ranks (DDP with a plain optimizer, ZeRO-1, ZeRO2, ZeRO3) only the order of the float32 additions
  in the gradient mean changes: rtol 1e-6, atol 1e-7 (tests/checkpoint/test_resume.py's).
- flax + optax is another implementation of the model and of Adam: the parity tolerance of
  tests/checkpoint/test_optax_groups.py (rtol 1e-5, atol 1e-6), for the flax run and for FSDP2
  resumed from it.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._procs import forkserver_ranks, init_gloo
from tests.checkpoint_formats import _pair

SAVE, HANDOFF, STEPS = 3, 4, 6
SAME = dict(rtol=1e-6, atol=1e-7)
CROSS = dict(rtol=1e-5, atol=1e-6)


def _train(net, opt, steps, rank, world, at=None, save=None):
    import torch

    for step in steps:
        if step == at:
            save()
        x = torch.from_numpy(_pair.batch(step)).chunk(world)[rank]
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _fsdp2(kind, lr_scale=1.0):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _pair.torch_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # named: on a GPU host the default is CUDA
    for layer in model:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _pair.torch_optimizer(model, kind, lr_scale=lr_scale)


def _full_params(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.removeprefix("module."): v.detach().numpy().copy() for k, v in sd.items()}


def _lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def _fsdp2_run(kind, root, rank, world):
    """FSDP2 to STEPS, saving DCP at SAVE the way torch's recipe does (SGD records no step: the
    run saves its own, as torchtitan's train_state does)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp2(kind)

    def save():
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        if kind == "sgd":
            state["train_state"] = {"step": torch.tensor(SAVE)}
        dcp.save(state, checkpoint_id=f"{root}/fsdp-{kind}")

    _train(model, opt, range(STEPS), rank, world, at=SAVE, save=save)
    return _full_params(model)


def _zero3_run(kind, root, rank, world):
    """hybrid ZeRO3 resumed from FSDP2's DCP (recognised), saving hybrid's at HANDOFF."""
    from hybrid.checkpoint import torch as ckpt
    from hybrid.torch import ZeRO3

    net = ZeRO3(_pair.torch_model())
    opt = _pair.torch_optimizer(None, kind, lr_scale=5.0, zero3=net)
    start = ckpt.load(f"{root}/fsdp-{kind}", net, opt)
    lrs = _lrs(opt)
    _train(net, opt, range(start, STEPS), rank, world, at=HANDOFF,
           save=lambda: ckpt.save(f"{root}/zero3-{kind}", net, opt, step=HANDOFF))
    return {"start": start, "lrs": lrs,
            "params": {k.removeprefix("module."): v.detach().numpy().copy() for k, v in net.state_dict().items()}}


def _zero3_at(root, rank, world):
    """hybrid ZeRO3 at another world size than FSDP2's, resumed from its AdamW checkpoint."""
    from hybrid.checkpoint import torch as ckpt
    from hybrid.torch import ZeRO3

    net = ZeRO3(_pair.torch_model())
    opt = _pair.torch_optimizer(None, "adamw", lr_scale=5.0, zero3=net)
    start = ckpt.load(f"{root}/fsdp-adamw", net, opt)
    lrs = _lrs(opt)
    _train(net, opt, range(start, STEPS), rank, world)
    return {"start": start, "lrs": lrs,
            "params": {k.removeprefix("module."): v.detach().numpy().copy() for k, v in net.state_dict().items()}}


def _ddp_run(kind, root, rank, world):
    """At 3 ranks: DDP + Adam (plain), DDP + ZeRO-1 (AdamW), DDP + ZeRO2 (SGD)."""
    import torch

    from hybrid.checkpoint import torch as ckpt
    from hybrid.torch import DistributedDataParallel, ZeRO2, ZeroRedundancyOptimizer

    model = _pair.torch_model()
    ddp = DistributedDataParallel(model)
    groups = _pair.torch_groups(model, kind, lr_scale=5.0)
    if kind == "adamw":
        opt = ZeroRedundancyOptimizer(groups, torch.optim.AdamW)
    elif kind == "sgd":
        opt = ZeRO2(ddp, torch.optim.SGD, param_groups=groups)
    else:
        opt = _pair.torch_optimizer(model, kind, lr_scale=5.0)
    start = ckpt.load(f"{root}/fsdp-{kind}", ddp, opt)
    lrs = _lrs(opt)
    _train(ddp, opt, range(start, STEPS), rank, world)
    return {"start": start, "lrs": lrs, "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}}


def _fsdp2_back(kind, root, rank, world, source=None):
    """FSDP2 resumed with torch's own dcp.load + set_state_dict from the converted checkpoint
    (``source``: another one than ZeRO3's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp2(kind, lr_scale=5.0)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{root}/{source or f'back-{kind}'}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    lrs = _lrs(opt)
    _train(model, opt, range(HANDOFF, STEPS), rank, world)
    return {"lrs": lrs, "params": _full_params(model)}


JOBS = {"fsdp2": _fsdp2_run, "zero3": _zero3_run, "ddp": _ddp_run, "fsdp2_back": _fsdp2_back}


def _ranks(job, root, rank, port, out):
    init_gloo(rank, port, world=3 if job == "ddp" else 2, timeout_s=60)
    import torch.distributed as dist

    results = {kind: JOBS[job](kind, root, rank, dist.get_world_size()) for kind in _pair.OPTIMIZERS}
    if job == "fsdp2_back":  # and the flax run's checkpoint, saved from JAX
        results["jax"] = _fsdp2_back("adamw", root, rank, dist.get_world_size(), source="back-jax")
    if job == "ddp":  # and ZeRO3 at this other world size
        results["zero3"] = _zero3_at(root, rank, dist.get_world_size())
    out.put((rank, results, 0.0))
    dist.destroy_process_group()


def _launch(job, root, world=2):
    reports, _ = forkserver_ranks(_ranks, (job, str(root)), world, world=world, wait_s=150)
    return reports[0][0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybrid.checkpoint import convert

    root = tmp_path_factory.mktemp("dcp")
    out = {"root": root, "fsdp2": _launch("fsdp2", root), "zero3": _launch("zero3", root),
           "ddp": _launch("ddp", root, world=3)}
    for kind in _pair.OPTIMIZERS:  # hybrid's checkpoint out to DCP, as the command line does it
        convert(root / f"zero3-{kind}", root / f"back-{kind}", to="dcp")
    out["flax"] = _flax_run(root)
    out["fsdp2_back"] = _launch("fsdp2_back", root)
    return out


def _flax_run(root):
    """FSDP2's AdamW checkpoint into the flax twin through the mapping, its param groups as
    optax_from_manifest's transform, trained to STEPS; saved at HANDOFF under torch's names and
    converted to DCP with the torch param groups the FSDP2 run resumes with."""
    import jax
    import jax.numpy as jnp
    import optax

    from hybrid.checkpoint import convert
    from hybrid.checkpoint import jax as ckpt_jax

    path, mapping = root / "fsdp-adamw", _pair.mapping()
    like = jax.tree.map(jnp.zeros_like, _pair.flax_params())
    tx = ckpt_jax.optax_from_manifest(path, like, mapping=mapping)
    params, state, step = ckpt_jax.load(path, like, tx.init(like), mapping=mapping)

    @jax.jit
    def train_step(params, state, x):
        g = jax.grad(_pair.flax_loss)(params, x)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(step, STEPS):
        if i == HANDOFF:
            ckpt_jax.save(root / "jax", params, state, step=i, mapping=mapping)
        params, state = train_step(params, state, jnp.asarray(_pair.batch(i)))
    names = [n for n, _ in _pair.torch_model().named_parameters()]
    groups = [{"params": [n for n in names if n.endswith("weight")], "lr": 0.01, "weight_decay": 0.1},
              {"params": [n for n in names if n.endswith("bias")], "lr": 0.02, "weight_decay": 0.0}]
    convert(root / "jax", root / "back-jax", to="dcp", param_groups=groups)
    flat = _flat(params)
    return {"start": step, "params": mapping.pair({k: v.shape for k, v in flat.items()}).to_torch(flat)}


def _max_diff(got: dict, want: dict) -> float:
    return max(float(np.max(np.abs(got[k] - want[k]))) for k in want)


@pytest.mark.parametrize("kind", _pair.OPTIMIZERS)
def test_zero3_resumed_from_fsdp2_equals_its_uninterrupted_run_bit_for_bit(runs, kind):
    got, want = runs["zero3"][kind], runs["fsdp2"][kind]
    assert got["start"] == SAVE
    assert got["lrs"] == [0.01, 0.02]  # the saved groups' hyperparameters, not the optimizer's own
    assert list(got["params"]) == list(want)
    for name in want:
        np.testing.assert_array_equal(got["params"][name], want[name], err_msg=name)


@pytest.mark.parametrize("kind", [*_pair.OPTIMIZERS, "zero3"])
def test_ddp_zero1_zero2_zero3_at_3_ranks_follow_fsdp2(runs, kind):
    got, want = runs["ddp"][kind], runs["fsdp2"]["adamw" if kind == "zero3" else kind]
    assert got["start"] == SAVE and got["lrs"] == [0.01, 0.02]
    print(f"{kind}: 3-rank resume vs FSDP2 uninterrupted, max |diff| {_max_diff(got['params'], want):.2e}")
    for name in want:
        np.testing.assert_allclose(got["params"][name], want[name], **SAME, err_msg=name)


@pytest.mark.parametrize("kind", _pair.OPTIMIZERS)
def test_fsdp2_resumes_hybrids_checkpoint_through_dcp_bit_for_bit(runs, kind):
    got, want = runs["fsdp2_back"][kind], runs["fsdp2"][kind]
    assert got["lrs"] == [0.01, 0.02]  # set_state_dict restored the hybrid run's groups
    for name in want:
        np.testing.assert_array_equal(got["params"][name], want[name], err_msg=name)


def test_the_dcp_checkpoint_reads_as_the_run_saved_it(runs):
    from hybrid.checkpoint import open_checkpoint

    for kind in _pair.OPTIMIZERS:
        ckpt = open_checkpoint(runs["root"] / f"fsdp-{kind}")
        m = ckpt.manifest
        assert (ckpt.format, m.step, m.optimizer.name) == ("dcp", SAVE, kind)
        assert [g["param_names"] for g in m.optimizer.hyperparameters["param_groups"]] == [
            ["0.weight", "2.weight", "4.weight"], ["0.bias", "2.bias", "4.bias"]]
        assert m.optimizer.slots == (("trace",) if kind == "sgd" else ("mu", "nu"))
        assert m.optimizer.count == SAVE and not m.optimizer.counts


def test_fsdp2_checkpoint_resumes_in_flax_and_optax(runs):
    """FSDP2's AdamW checkpoint into the flax twin (the fixture's _flax_run) follows FSDP2's run."""
    got, want = runs["flax"], runs["fsdp2"]["adamw"]
    assert got["start"] == SAVE
    print(f"flax + optax resumed vs FSDP2 uninterrupted, max |diff| {_max_diff(got['params'], want):.2e}")
    for name in want:
        np.testing.assert_allclose(got["params"][name], want[name], **CROSS, err_msg=name)


def test_fsdp2_resumes_a_jax_run_through_dcp(runs):
    """The flax run's hybrid checkpoint (saved from JAX under torch's names), converted to DCP
    with the run's torch param groups: FSDP2 resumes it and follows its own uninterrupted run."""
    got, want = runs["fsdp2_back"]["jax"], runs["fsdp2"]["adamw"]
    assert got["lrs"] == [0.01, 0.02]
    print(f"FSDP2 <- DCP <- JAX vs FSDP2 uninterrupted, max |diff| {_max_diff(got['params'], want):.2e}")
    for name in want:
        np.testing.assert_allclose(got["params"][name], want[name], **CROSS, err_msg=name)


def _flat(params) -> dict:
    from hybrid.parity import named_jax
    return {k: np.asarray(v) for k, v in named_jax(params).items()}
