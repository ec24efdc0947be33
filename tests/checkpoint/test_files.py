"""Checkpoint files: corruption, truncation, missing shards, foreign manifests, interrupted saves.

Every bad checkpoint must raise CheckpointError naming the file, before anything is changed.
"""

import hashlib
import json
import os
import pathlib

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hybrid.checkpoint._write as write_module
from hybrid.checkpoint import Checkpoint, CheckpointError, save_arrays
from hybrid.checkpoint import torch as ckpt_torch


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _trained(seed=0, steps=2):
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 5)).square().mean().backward()
        opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained()
    path = tmp_path / "ckpt"
    ckpt_torch.save(path, model, opt, step=2, world_size=3)
    return path, model, opt


def _load_into_fresh(path):
    """Load into a fresh model and optimizer; returns them (for before/after comparisons)."""
    model = _model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, ckpt_torch.load(path, model, opt)


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()}, {k: dict(v) for k, v in opt.state.items()})


def _assert_untouched(model, opt, before):
    params, state = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert len(opt.state) == len(state)


def test_round_trip_is_exact(saved):
    path, model, opt = saved
    other, other_opt, step = _load_into_fresh(path)
    assert step == 2
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), n
    for p, q in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], other_opt.state[q][key]), key


@pytest.mark.parametrize("damage, message", [
    ("flip", r"rank-00001-of-00003\.safetensors: bytes \d+\.\.\d+ of its data differ from their checksum .*: the "
             r"file is corrupt"),
    ("flip header", r"rank-00001-of-00003\.safetensors: its header differs from the manifest's checksum of it: the "
                    r"file is corrupt"),
    ("truncate", r"rank-00001-of-00003\.safetensors: \d+ bytes, the manifest says \d+: the file is truncated"),
    ("delete", r"rank-00001-of-00003\.safetensors: shard file of rank 1 is missing"),
])
def test_damaged_shard_is_named_and_nothing_changes(saved, damage, message):
    path, _, _ = saved
    shard = path / "rank-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    if damage.startswith("flip"):
        data[-3 if damage == "flip" else 20] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:len(data) // 2]))
    else:
        shard.unlink()
    model = _model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=message):
        ckpt_torch.load(path, model, opt)
    _assert_untouched(model, opt, before)


def _edit_manifest(path, edit):
    file = path / "manifest.json"
    d = json.loads(file.read_text())
    edit(d)
    file.write_text(json.dumps(d))


def test_unsupported_format_version(saved):
    path, _, _ = saved
    _edit_manifest(path, lambda d: d.update(format_version=99))
    with pytest.raises(CheckpointError, match=r"manifest\.json: format version 99 is not supported .* reads versions \[1, 2, 3\]"):
        Checkpoint(path)


def test_edited_plan_is_caught_by_its_fingerprint(saved):
    path, _, _ = saved
    _edit_manifest(path, lambda d: d["plan"]["specs"][0].update(name="renamed"))
    with pytest.raises(CheckpointError, match="does not match its fingerprint"):
        Checkpoint(path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        Checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty/manifest\.json is missing"):
        Checkpoint(tmp_path / "empty")


def test_manifest_of_another_model_names_the_tensors(saved):
    path, _, _ = saved
    other = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(other.parameters())
    before = _snapshot(other, opt)
    with pytest.raises(CheckpointError, match=r"tensor '2\.weight' is float32\[3, 4\] in the checkpoint and float32\[2, 4\]"):
        ckpt_torch.load(path, other, opt)
    _assert_untouched(other, opt, before)
    renamed = torch.nn.Linear(5, 4)
    with pytest.raises(CheckpointError, match=r"saved from another model: Linear has \['bias', 'weight'\]"):
        ckpt_torch.load(path, renamed)


def test_optimizer_of_another_kind_is_refused(saved):
    path, _, _ = saved
    model = _model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"holds adam state \['mu', 'nu'\], but SGD keeps \['trace'\]"):
        ckpt_torch.load(path, model, opt)
    _assert_untouched(model, opt, before)


def test_interrupted_save_leaves_the_previous_checkpoint(saved, monkeypatch):
    path, model, _ = saved
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    real = write_module.write_shard

    def dies_on_rank_1(p, rank, world_size, tensors, **kwargs):
        if rank == 1:
            staging = pathlib.Path(p).parent / f".{pathlib.Path(p).name}.saving"
            (staging / "rank-00001-of-00003.safetensors.part").write_bytes(b"half a fi")
            raise KeyboardInterrupt("killed mid-write")
        return real(p, rank, world_size, tensors, **kwargs)

    monkeypatch.setattr(write_module, "write_shard", dies_on_rank_1)
    newer, newer_opt = _trained(seed=5, steps=3)
    with pytest.raises(KeyboardInterrupt):
        ckpt_torch.save(path, newer, newer_opt, step=3, world_size=3)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    _, _, step = _load_into_fresh(path)
    assert step == 2
    monkeypatch.setattr(write_module, "write_shard", real)
    ckpt_torch.save(path, newer, newer_opt, step=3, world_size=3)  # a later save clears the leftovers
    assert not any(p.name.startswith(".ckpt") for p in path.parent.iterdir())
    assert Checkpoint(path).manifest.step == 3


def test_interrupted_swap_reads_the_previous_directory(saved):
    path, _, _ = saved
    os.replace(path, path.parent / ".ckpt.previous")  # the moment between commit_save's two renames
    with pytest.warns(UserWarning, match="interrupted while swapping"):
        assert Checkpoint(path).manifest.step == 2


def test_bfloat16_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    ckpt_torch.save(tmp_path / "c", model, step=0, world_size=2)
    other = torch.nn.Linear(3, 2).to(torch.bfloat16)
    ckpt_torch.load(tmp_path / "c", other)
    assert torch.equal(other.weight, model.weight) and other.weight.dtype == torch.bfloat16
    assert Checkpoint(tmp_path / "c").manifest.dtypes["params/0"] == "bfloat16"


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_rank_files_hold_the_flat_slices(tmp_path, world_size):
    params = {"a": np.arange(7, dtype=np.float32), "b": np.arange(5, dtype=np.float32).reshape(5, 1) + 100}
    save_arrays(tmp_path / "c", params, world_size=world_size, step=4)
    ckpt = Checkpoint(tmp_path / "c")
    shards = ckpt.manifest.shards
    for r in range(world_size):
        for b in range(ckpt.manifest.plan.num_buckets):
            lo, hi = shards.shard_range(b, r)
            assert ckpt.read(r, f"params/{b}", 0, hi - lo).shape == (hi - lo,)
    got = ckpt.tensors("params")
    assert list(got) == ["a", "b"] and all(np.array_equal(got[k], v) for k, v in params.items())


@pytest.mark.parametrize("name", ["../elsewhere.safetensors", "{outside}", "sub/rank-00001-of-00003.safetensors",
                                  "rank-00002-of-00003.safetensors"])
def test_manifest_file_names_outside_the_directory_are_refused(saved, name):
    """A downloaded checkpoint must never make the loader open other files: the shard is copied to
    where the edited name points (so the old loader read it there and loaded), and must be refused."""
    path, _, _ = saved
    outside = path.parent / "elsewhere.safetensors"
    outside.write_bytes((path / "rank-00001-of-00003.safetensors").read_bytes())
    (path / "sub").mkdir()
    (path / "sub" / "rank-00001-of-00003.safetensors").write_bytes(outside.read_bytes())
    name = name.format(outside=str(outside))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][1]["name"] = name
    (path / "manifest.json").write_text(json.dumps(manifest))
    model = _model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"manifest\.json: the file of rank 1 is named .*refusing to open"):
        ckpt_torch.load(path, model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_shard_that_is_a_symlink_is_refused(saved):
    """A link inside the checkpoint directory may point anywhere: a shard must be a regular file."""
    path, _, _ = saved
    shard = path / "rank-00001-of-00003.safetensors"
    outside = path.parent / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00003\.safetensors: shard file of rank 1 is not a "
                                              r"regular file"):
        _load_into_fresh(path)


@pytest.mark.parametrize("field, edit", [
    ("step", lambda d: d.update(step=d["step"] + 1)),
    ("optimizer.count", lambda d: d["optimizer"].update(count=d["optimizer"]["count"] + 10)),
    ("hyperparameters", lambda d: d["optimizer"]["hyperparameters"]["param_groups"][0].update(lr=1.0)),
    ("metadata", lambda d: d["metadata"].update(run="other")),
    ("stage", lambda d: d.update(stage=2)),
    ("framework", lambda d: d.update(framework="jax")),
])
def test_edited_manifest_field_is_caught(saved, field, edit):
    """Fields outside the plan are bound to the files' checksums: an edit (Adam's bias correction
    follows optimizer.count) is refused before anything changes."""
    path, _, _ = saved
    _edit_manifest(path, edit)
    model = _model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"manifest\.json was edited after the save: .*differ from those "
                                              r"rank-0000\d-of-00003\.safetensors was written for"):
        ckpt_torch.load(path, model, opt)
    _assert_untouched(model, opt, before)


def test_downgrading_the_format_version_does_not_skip_the_binding(saved):
    path, _, _ = saved
    _edit_manifest(path, lambda d: d.update(format_version=1, step=d["step"] + 1))
    with pytest.raises(CheckpointError, match="was edited after the save"):
        _load_into_fresh(path)


def test_format_1_checkpoint_still_loads_with_a_warning(saved):
    """A checkpoint from before the binding (no digest in its files) loads, saying what it lacks."""
    path, model, _ = saved
    for shard in path.glob("rank-*.safetensors"):
        # A version-1 file: the same tensors, no metadata in the header.
        save_file(load_file(str(shard)), str(shard))
    def v1(d):
        d["format_version"] = 1
        for f in d["files"]:
            shard = path / f["name"]
            f["nbytes"] = shard.stat().st_size
            f["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    _edit_manifest(path, v1)
    with pytest.warns(UserWarning, match="a format-1 checkpoint; its manifest's fields .* are not covered"):
        other, _, step = _load_into_fresh(path)
    assert step == 2 and torch.equal(other[0].weight, model[0].weight)
