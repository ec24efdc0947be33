"""A resumed torch run is the uninterrupted run: what torch's own ``load_state_dict`` calls restore
(hyperparameters, LR scheduler, buffers, AMSGrad's state, parameters without state) comes back.

Each case trains a loop uninterrupted, and again with ``hybrid.checkpoint.torch.save`` at step
SAVE, a fresh model, optimizer and scheduler built as the script builds them, ``load`` and the
rest of the loop. Same process, same arithmetic: the two runs must agree bitwise (rtol 0, atol 0)
in every loss, parameter and buffer. The printed max differences of the pre-fix behaviour
(``hyperparameters="optimizer"``, ``buffers=False``) are the figures of the closing note.
"""

import numpy as np
import pytest
import torch
from torch import nn

from hybrid.checkpoint import Checkpoint, CheckpointError, read_state, save_arrays
from hybrid.checkpoint import torch as ckpt

STEPS, SAVE = 30, 20


def _data(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _mlp(seed=0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 12)] + ([nn.BatchNorm1d(12)] if batchnorm else []) + [nn.Tanh(), nn.Linear(12, 3)]
    return nn.Sequential(*layers)


def _adamw_two_groups(model, *, amsgrad_first=False):
    """The common AdamW setup: decay on weights, none on biases (and norms)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "amsgrad": amsgrad_first},
                              {"params": rest, "weight_decay": 0.0}], lr=1.5e-3)


def _warmup(opt):
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=25)


def _step(model, opt, sched, step, loss_fn=None):
    x, y = _data(step)
    opt.zero_grad()
    loss = (loss_fn or (lambda m, x: m(x)))(model, x).sub(y).square().mean()
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()
    return loss.item()


def _run(build, path=None, *, load_kwargs=None, loss_fn=None, save_at=SAVE):
    """Losses and final state of the loop, uninterrupted (``path`` None) or resumed at ``save_at``
    from a checkpoint at ``path``."""
    model, opt, sched = build()
    losses = [_step(model, opt, sched, s, loss_fn) for s in range(save_at)]
    if path is not None:
        ckpt.save(path, model, opt, step=save_at, scheduler=sched, state={"epoch": 2, "seed": 17})
        model, opt, sched = build(seed=99)  # a fresh run: other init, and the script's own lr / scheduler
        assert ckpt.load(path, model, opt, scheduler=sched, **(load_kwargs or {})) == save_at
    losses += [_step(model, opt, sched, s, loss_fn) for s in range(save_at, STEPS)]
    return np.array(losses), model, opt


def _max_diff(a, b):
    _, ma, _ = a
    _, mb, _ = b
    return max((x - y).abs().max().item() for x, y in zip(ma.state_dict().values(), mb.state_dict().values())
               if x.is_floating_point())


def _assert_same(a, b):
    np.testing.assert_array_equal(a[0], b[0])
    for (name, x), y in zip(a[1].state_dict().items(), b[1].state_dict().values()):
        assert torch.equal(x, y), name


def _build_warmup(seed=0):
    model = _mlp(seed)
    opt = _adamw_two_groups(model)
    return model, opt, _warmup(opt)


def test_warmup_scheduler_loop_resumes_exactly(tmp_path):
    """AdamW in two groups with a linear warm-up: the resumed step runs at the saved lr."""
    uninterrupted = _run(_build_warmup)
    resumed = _run(_build_warmup, tmp_path / "ckpt")
    _assert_same(resumed, uninterrupted)
    assert resumed[2].param_groups[0]["lr"] == uninterrupted[2].param_groups[0]["lr"]
    assert read_state(tmp_path / "ckpt") == {"epoch": 2, "seed": 17}
    kept = _run(_build_warmup, tmp_path / "kept", load_kwargs={"hyperparameters": "optimizer"})
    print(f"warm-up loop: resumed vs uninterrupted max |param diff| {_max_diff(resumed, uninterrupted):.1e} "
          f"(keeping the receiving optimizer's hyperparameters: {_max_diff(kept, uninterrupted):.1e}, "
          f"final loss off by {abs(kept[0][-1] - uninterrupted[0][-1]):.1e})")
    assert _max_diff(kept, uninterrupted) > 1e-4  # what the old default did


def test_torch_own_resume_is_the_same(tmp_path):
    """The oracle of the oracle: torch's state_dict()/load_state_dict() resume equals ours."""
    model, opt, sched = _build_warmup()
    for s in range(SAVE):
        _step(model, opt, sched, s)
    saved = (model.state_dict(), opt.state_dict(), sched.state_dict())
    ckpt.save(tmp_path / "ckpt", model, opt, step=SAVE, scheduler=sched)
    theirs, ours = _build_warmup(seed=99), _build_warmup(seed=98)
    for sd, obj in zip(saved, theirs):
        obj.load_state_dict(sd)
    ckpt.load(tmp_path / "ckpt", ours[0], ours[1], scheduler=ours[2])
    assert ours[1].state_dict()["param_groups"] == theirs[1].state_dict()["param_groups"]
    assert ours[2].state_dict() == theirs[2].state_dict()
    for s in range(SAVE, STEPS):
        assert _step(*ours, s) == _step(*theirs, s)


def test_groups_that_moved_are_named(tmp_path):
    model, opt, sched = _build_warmup()
    _step(model, opt, sched, 0)
    ckpt.save(tmp_path / "ckpt", model, opt, step=1)
    other = _mlp(1)
    one_group = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=r"param group 0 holds \['0.weight', '0.bias', '2.weight', '2.bias'\], "
                                              r"which is no saved group"):
        ckpt.load(tmp_path / "ckpt", other, one_group)
    ckpt.load(tmp_path / "ckpt", other, one_group, hyperparameters="optimizer")
    assert one_group.param_groups[0]["lr"] == 1e-3
    with pytest.raises(ValueError, match="hyperparameters='saved'; expected 'checkpoint'"):
        ckpt.load(tmp_path / "ckpt", other, one_group, hyperparameters="saved")


def _build_bn(seed=0):
    model = _mlp(seed, batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, None


def test_batchnorm_statistics_resume(tmp_path):
    uninterrupted = _run(_build_bn)
    resumed = _run(_build_bn, tmp_path / "ckpt")
    _assert_same(resumed, uninterrupted)  # running_mean, running_var, num_batches_tracked included
    assert resumed[1][1].num_batches_tracked.item() == STEPS
    plain = _run(_build_bn, tmp_path / "plain", load_kwargs={"buffers": False})
    print(f"BatchNorm: resumed vs uninterrupted max diff {_max_diff(resumed, uninterrupted):.1e} "
          f"(statistics not restored: {_max_diff(plain, uninterrupted):.1e})")
    assert _max_diff(plain, uninterrupted) > 1e-3


def test_buffers_are_checked_by_name(tmp_path):
    model, opt, _ = _build_bn()
    ckpt.save(tmp_path / "ckpt", model, opt, step=0)
    other = _mlp(1, batchnorm=True)
    other[1].register_buffer("extra", torch.zeros(2))
    with pytest.raises(CheckpointError, match=r"buffers differ: Sequential has \['1.extra'\]"):
        ckpt.load(tmp_path / "ckpt", other)
    # Parameters alone (as an older hybrid, or JAX without buffers=, saved them): said, not skipped.
    save_arrays(tmp_path / "no-buffers", {n: p.detach().numpy() for n, p in model.named_parameters()})
    with pytest.raises(CheckpointError, match=r"holds no buffers, but Sequential has \['1.running_mean', "
                                              r"'1.running_var', '1.num_batches_tracked'\]"):
        ckpt.load(tmp_path / "no-buffers", model)
    ckpt.load(tmp_path / "no-buffers", model, buffers=False)


def _build_amsgrad(seed=0):
    model = _mlp(seed)
    return model, _adamw_two_groups(model, amsgrad_first=True), None


def test_amsgrad_in_one_group_resumes_exactly(tmp_path):
    uninterrupted = _run(_build_amsgrad)
    resumed = _run(_build_amsgrad, tmp_path / "ckpt")
    _assert_same(resumed, uninterrupted)
    state = resumed[2].state
    assert all(("max_exp_avg_sq" in state[p]) == (p.dim() > 1) for p in resumed[1].parameters())


def test_amsgrad_state_missing_is_refused(tmp_path):
    model = _mlp()
    opt = _adamw_two_groups(model)
    _step(model, opt, None, 0)
    ckpt.save(tmp_path / "ckpt", model, opt, step=1)
    other = _mlp(1)
    with pytest.raises(CheckpointError, match=r"holds adamw state \['mu', 'nu'\], but AdamW keeps \['mu', 'nu', "
                                              r"'max_nu'\]"):
        ckpt.load(tmp_path / "ckpt", other, _adamw_two_groups(other, amsgrad_first=True),
                  hyperparameters="optimizer")


def _late(model, x):
    """The second layer's bias joins the loss only from step 8 on: no gradient, no state before."""
    h = torch.tanh(model[0](x))
    out = h @ model[2].weight.T
    return out + model[2].bias if _late.step >= 8 else out


def _build_late(seed=0):
    model = _mlp(seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), None


@pytest.mark.parametrize("save_at", [5, 20], ids=["no state yet", "fewer steps"])
def test_parameter_without_state_resumes_exactly(tmp_path, save_at):
    counter = {"step": 0}

    def loss_fn(model, x):
        _late.step = counter["step"]
        counter["step"] += 1
        return _late(model, x)

    def run(path):
        counter["step"] = 0
        return _run(_build_late, path, loss_fn=loss_fn, save_at=save_at)

    uninterrupted, resumed = run(None), run(tmp_path / "ckpt")
    _assert_same(resumed, uninterrupted)
    info = Checkpoint(tmp_path / "ckpt").manifest.optimizer
    if save_at == 5:
        assert info.without_state == ("2.bias",) and not info.counts
    else:
        assert info.counts["2.bias"] == save_at - 8 and info.counts["0.weight"] == save_at


def test_state_dicts_round_trip_keeps_no_state(tmp_path):
    """save_state_dicts takes an optimizer with stateless parameters; state_dicts gives torch's dict back."""
    model = _mlp()
    opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-2},
                            {"params": model[2].parameters(), "lr": 1e-3}])
    x, y = _data(0)
    opt.zero_grad()
    torch.tanh(model[0](x)).sum().backward()  # model[2] gets no gradient: no state
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    ckpt.save_state_dicts(tmp_path / "ckpt", model.state_dict(), opt.state_dict(), step=1, world_size=2,
                          param_names=names)
    _, opt_sd = ckpt.state_dicts(tmp_path / "ckpt")
    theirs = opt.state_dict()
    assert sorted(opt_sd["state"]) == sorted(theirs["state"]) == [0, 1]
    assert [g["lr"] for g in opt_sd["param_groups"]] == [1e-2, 1e-3]
    fresh = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    fresh.load_state_dict(opt_sd)
    for p in model[0].parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert not any(p in fresh.state for p in model[2].parameters())


def test_run_state_must_be_json(tmp_path):
    model = _mlp()
    with pytest.raises(ValueError, match=r"the state must be JSON-serializable: 'rng' is not"):
        ckpt.save(tmp_path / "ckpt", model, step=0, state={"epoch": 1, "rng": torch.get_rng_state()})
    assert not (tmp_path / "ckpt").exists()
    ckpt.save(tmp_path / "ckpt", model, step=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="holds no LR scheduler state"):
        ckpt.load(tmp_path / "ckpt", model, scheduler=_warmup(opt))
    assert read_state(tmp_path / "ckpt") == {}


def _ranks_worker(kind, path, rank, port, out):
    """One gloo rank: DDP over a BatchNorm MLP, AdamW in two groups (AMSGrad in one) sharded by
    ZeRO-1 or ZeRO2, a warm-up scheduler; uninterrupted, then saved at SAVE and resumed."""
    import datetime

    import torch.distributed as dist

    from hybrid.torch import DistributedDataParallel, ZeroRedundancyOptimizer, ZeRO2

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))

    def build(seed=0):
        ddp = DistributedDataParallel(_mlp(seed, batchnorm=True))
        groups = [{"params": [p for p in ddp.module.parameters() if p.dim() > 1], "weight_decay": 0.1,
                   "amsgrad": True},
                  {"params": [p for p in ddp.module.parameters() if p.dim() == 1], "weight_decay": 0.0}]
        if kind == "zero1":
            opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=1.5e-3)
        else:
            opt = ZeRO2(ddp, torch.optim.AdamW, param_groups=groups, lr=1.5e-3)
        return ddp, opt, _warmup(opt)

    def step(ddp, opt, sched, s):
        x, y = _data(s)
        opt.zero_grad()
        loss = ddp(x[rank * 8:(rank + 1) * 8]).sub(y[rank * 8:(rank + 1) * 8]).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    try:
        run = build()
        losses = [step(*run, s) for s in range(STEPS)]
        reference = {k: v.clone() for k, v in run[0].module.state_dict().items()}
        run = build()
        resumed = [step(*run, s) for s in range(SAVE)]
        ckpt.save(path, run[0], run[1], step=SAVE - 1, scheduler=run[2])
        # Again over it: each rank removes its own file of the replaced checkpoint.
        ckpt.save(path, run[0], run[1], step=SAVE, scheduler=run[2])
        run = build(seed=99)
        ckpt.load(path, run[0], run[1], scheduler=run[2])
        resumed += [step(*run, s) for s in range(SAVE, STEPS)]
        differ = [k for k, v in run[0].module.state_dict().items() if not torch.equal(v, reference[k])]
        out.put((rank, "equal" if resumed == losses and not differ else f"differ: losses {resumed == losses}, "
                 f"tensors {differ}", 0.0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}", 0.0))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["zero1", "zero2"])
def test_two_ranks_resume_exactly(tmp_path, kind):
    """The same at 2 gloo ranks with hybrid's ZeRO classes: bitwise (same ranks, same arithmetic)."""
    from tests._procs import forkserver_ranks

    reports, _ = forkserver_ranks(_ranks_worker, (kind, str(tmp_path / "ckpt")), 2, wait_s=120)
    assert {r: outcome for r, (outcome, _) in reports.items()} == {0: "equal", 1: "equal"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no leftovers of the replaced checkpoint
