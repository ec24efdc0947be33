"""The run's other state from torch DCP, both ways: a torchtitan checkpoint's LR scheduler, data
loader and train state through hybrid and back.

The DCP checkpoints are written by torch's own ``dcp.save`` the way torchtitan's CheckpointManager
writes them: ``Stateful`` objects for the optimizer (``get_optimizer_state_dict`` with
``flatten_optimizer_state_dict=True``), the LR schedulers (a container whose ``state_dict()`` is its
first ``LambdaLR``'s), the data loader (``{"dp_rank_0": pickled bytes, "world_size": 1}``, as
``ParallelAwareDataloader``) and the train state (``{"step", "ntokens_seen"}`` and a tensor of
logged losses), the model's entries flattened to the top level; the model is
``hybrid.models.Llama`` (a complex64 ``freqs_cis`` buffer), trained 2 steps with AdamW and a warmup
``LambdaLR``. Also torch's recipe, ``{"model", "optim", "lr_scheduler"}``.

Everything must come back bit for bit (tolerance zero: the same values are copied, never
recomputed), including one more step after a resume, which must equal the uninterrupted run's
(same process, same ops on the same values). One process, no gloo world: ``dcp.save`` /
``dcp.load`` with ``no_dist=True``, as torch allows for a single process.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from hybrid.checkpoint import CheckpointError, convert, open_checkpoint
from hybrid.checkpoint.torch import load, other_state, save

CONFIG = dict(n_layers=1, dim=16, n_heads=2, hidden_dim=32, vocab_size=32, max_seq_len=8)


def _run(seed=0):
    from hybrid.models import Llama, LlamaConfig

    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _step(model, opt, sched, i):
    tokens = torch.arange(8).reshape(2, 4).add(i) % CONFIG["vocab_size"]
    model(tokens).float().pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


class _Optimizer(Stateful):  # torchtitan's OptimizersContainer
    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.opt, sd, options=StateDictOptions(flatten_optimizer_state_dict=True))


class _Schedulers(Stateful):  # torchtitan's LRSchedulersContainer: the first scheduler's state
    def __init__(self, sched):
        self.sched = sched

    def state_dict(self):
        return self.sched.state_dict()

    def load_state_dict(self, sd):
        self.sched.load_state_dict(sd)


class _Loader(Stateful):  # torchtitan's ParallelAwareDataloader over a StatefulDataLoader
    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"dp_rank_0": pickle.dumps({"samples_yielded": self.position, "sampler": [3, 1, 2]}), "world_size": 1}

    def load_state_dict(self, sd):
        self.position = pickle.loads(sd["dp_rank_0"])["samples_yielded"]


class _TrainState(Stateful):  # the trainer's own: step, tokens seen, logged losses
    def __init__(self, step=0, ntokens=0, losses=(0.0, 0.0)):
        self.step, self.ntokens, self.losses = step, ntokens, torch.tensor(losses)

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens, "losses": self.losses}

    def load_state_dict(self, sd):
        self.step, self.ntokens, self.losses = sd["step"], sd["ntokens_seen"], sd["losses"]


def _states(model, opt, sched, loader, train_state):
    """What torchtitan's CheckpointManager hands dcp.save / dcp.load: the model's entries flattened
    to the top level beside the Stateful parts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"optimizer": _Optimizer(model, opt), "lr_scheduler": _Schedulers(sched), "dataloader": loader,
            "train_state": train_state, **get_model_state_dict(model)}


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process, as intended
        return fn(*args, **kwargs)


def _torchtitan_checkpoint(path):
    import torch.distributed.checkpoint as dcp

    model, opt, sched = _run()
    for i in range(2):
        _step(model, opt, sched, i)
    loader, train_state = _Loader(position=64), _TrainState(step=2, ntokens=128, losses=(2.5, 2.25))
    _quiet(dcp.save, _states(model, opt, sched, loader, train_state), checkpoint_id=os.fspath(path), no_dist=True)
    return model, opt, sched


def _torchtitan_load(path):
    """A fresh torchtitan run resuming from ``path`` with its own dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model, opt, sched = _run(seed=1)
    loader, train_state = _Loader(), _TrainState()
    states = _states(model, opt, sched, loader, train_state)
    _quiet(dcp.load, states, checkpoint_id=os.fspath(path), no_dist=True)
    set_model_state_dict(model, {k: v for k, v in states.items() if isinstance(v, torch.Tensor)})
    return model, opt, sched, loader, train_state


def _assert_same_run(a, b):
    (model, opt, sched), (model2, opt2, sched2) = a, b
    for (n, t), (n2, t2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n == n2 and t.dtype == t2.dtype and torch.equal(t, t2), n
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[p2][key]), key
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]
    assert sched.state_dict() == sched2.state_dict()


def test_load_restores_a_torchtitan_scheduler_and_the_run_continues_bit_for_bit(tmp_path):
    original = _torchtitan_checkpoint(tmp_path / "dcp")
    resumed = _run(seed=1)
    assert load(tmp_path / "dcp", *resumed[:2], scheduler=resumed[2]) == 2
    _assert_same_run(original, resumed)
    _step(*original, 2)
    _step(*resumed, 2)
    _assert_same_run(original, resumed)  # the warmup's third lr, and the step taken with it


def test_the_other_state_is_reachable_and_listed_as_carried(tmp_path):
    from hybrid.cli.checkpoint import describe

    _torchtitan_checkpoint(tmp_path / "dcp")
    other = other_state(tmp_path / "dcp")
    assert other["dataloader"] == _Loader(position=64).state_dict()
    assert other["train_state"]["ntokens_seen"] == 128 and other["train_state"]["step"] == 2
    assert torch.equal(other["train_state"]["losses"], torch.tensor([2.5, 2.25]))
    d = describe(open_checkpoint(tmp_path / "dcp"))
    assert d["scheduler"] and d["left_out"] == []
    assert sorted(d["carried"]) == ["dataloader.dp_rank_0", "dataloader.world_size", "train_state.losses",
                                    "train_state.ntokens_seen", "train_state.step"]


def test_a_torchtitan_run_through_hybrid_and_back_loses_nothing(tmp_path):
    original = _torchtitan_checkpoint(tmp_path / "dcp")
    convert(tmp_path / "dcp", tmp_path / "hybrid", to="hybrid", world_size=2)
    assert open_checkpoint(tmp_path / "hybrid").manifest.metadata["left_out"] == []
    a, b = other_state(tmp_path / "hybrid"), other_state(tmp_path / "dcp")
    assert a["dataloader"] == b["dataloader"] and torch.equal(a["train_state"].pop("losses"), b["train_state"].pop("losses"))
    assert a["train_state"] == b["train_state"]
    # hybrid's own load, from its own format, restores the scheduler too
    resumed = _run(seed=1)
    load(tmp_path / "hybrid", *resumed[:2], scheduler=resumed[2])
    _assert_same_run(original, resumed)
    convert(tmp_path / "hybrid", tmp_path / "back", to="dcp")
    model, opt, sched, loader, train_state = _torchtitan_load(tmp_path / "back")
    _assert_same_run(original, (model, opt, sched))
    assert loader.position == 64
    assert (train_state.step, train_state.ntokens) == (2, 128)
    assert torch.equal(train_state.losses, torch.tensor([2.5, 2.25]))
    assert model.freqs_cis.dtype == torch.complex64 and torch.equal(model.freqs_cis, original[0].freqs_cis)


def test_torch_recipe_keys_with_a_scheduler(tmp_path):
    """``{"model", "optim", "lr_scheduler"}`` of get_state_dict (torch's recipe, a scheduler beside)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _run()
    for i in range(2):
        _step(model, opt, sched, i)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "lr_scheduler": sched.state_dict(), "epoch": 4}
    _quiet(dcp.save, state, checkpoint_id=os.fspath(tmp_path / "dcp"), no_dist=True)
    resumed = _run(seed=1)
    load(tmp_path / "dcp", *resumed[:2], scheduler=resumed[2])
    _assert_same_run((model, opt, sched), resumed)
    assert other_state(tmp_path / "dcp") == {"epoch": 4}
    convert(tmp_path / "dcp", tmp_path / "back", to="dcp")  # laid out as it was: model, optim, lr_scheduler
    fresh = _run(seed=1)
    model_sd, optim_sd = get_state_dict(fresh[0], fresh[1])
    state = {"model": model_sd, "optim": optim_sd, "lr_scheduler": fresh[2].state_dict(), "epoch": 0}
    _quiet(dcp.load, state, checkpoint_id=os.fspath(tmp_path / "back"), no_dist=True)
    assert state["epoch"] == 4 and state["lr_scheduler"] == sched.state_dict()


def test_a_hybrid_scheduler_goes_out_where_torchtitan_reads_it(tmp_path):
    model, opt, sched = _run()
    for i in range(2):
        _step(model, opt, sched, i)
    save(tmp_path / "hybrid", model, opt, step=2, scheduler=sched, world_size=2)
    convert(tmp_path / "hybrid", tmp_path / "dcp", to="dcp")
    resumed = _run(seed=1)
    load(tmp_path / "dcp", *resumed[:2], scheduler=resumed[2])
    _assert_same_run((model, opt, sched), resumed)


def test_the_error_for_no_scheduler_names_the_format_read(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _run()
    _step(model, opt, sched, 0)
    model_sd, optim_sd = get_state_dict(model, opt)
    _quiet(dcp.save, {"model": model_sd, "optim": optim_sd, "dataloader": {"pos": 3}},
           checkpoint_id=os.fspath(tmp_path / "dcp"), no_dist=True)
    save(tmp_path / "hybrid", model, opt, step=1)
    resumed = _run(seed=1)
    with pytest.raises(CheckpointError, match=r"this dcp checkpoint holds no LR scheduler state \(no entry "
                                              r"lr_scheduler / lr_schedulers / scheduler .*\['dataloader', 'model', "
                                              r"'optim'\]"):
        load(tmp_path / "dcp", *resumed[:2], scheduler=resumed[2])
    with pytest.raises(CheckpointError, match=r"this hybrid checkpoint holds no LR scheduler state \(saved without "
                                              r"scheduler=\)"):
        load(tmp_path / "hybrid", *resumed[:2], scheduler=resumed[2])


def test_a_torchtitan_run_trains_in_hybrid_and_goes_back(tmp_path):
    """Resumed in hybrid (its data loader and train state from other_state), one step, saved by
    hybrid with other_state= and the torchtitan layout; converted to DCP, torchtitan's own dcp.load
    resumes it: the step taken in hybrid, the scheduler, the data loader's position and the train
    state all arrive."""
    original = _torchtitan_checkpoint(tmp_path / "dcp")
    model, opt, sched = _run(seed=1)
    load(tmp_path / "dcp", model, opt, scheduler=sched)
    other = other_state(tmp_path / "dcp")
    loader, train_state = _Loader(), _TrainState()
    loader.load_state_dict(other["dataloader"])
    train_state.load_state_dict(other["train_state"])
    _step(model, opt, sched, 2)
    _step(*original, 2)
    loader.position += 32
    train_state.step += 1
    layout = open_checkpoint(tmp_path / "dcp").manifest.metadata["dcp_layout"]
    save(tmp_path / "hybrid", model, opt, step=3, scheduler=sched, world_size=2, metadata={"dcp_layout": layout},
         other_state={"dataloader": loader.state_dict(), "train_state": train_state.state_dict()})
    convert(tmp_path / "hybrid", tmp_path / "back", to="dcp")
    model2, opt2, sched2, loader2, train_state2 = _torchtitan_load(tmp_path / "back")
    _assert_same_run(original, (model2, opt2, sched2))
    assert loader2.position == 96 and (train_state2.step, train_state2.ntokens) == (3, 128)
    assert torch.equal(train_state2.losses, torch.tensor([2.5, 2.25]))


def test_other_state_that_is_not_plain_data_is_refused_before_anything_is_written(tmp_path):
    model, opt, sched = _run()
    with pytest.raises(ValueError, match=r"other_state: 'dataloader.sampler' is a builtins.object"):
        save(tmp_path / "hybrid", model, opt, step=0, other_state={"dataloader": {"sampler": object()}})
    assert list(tmp_path.iterdir()) == []
