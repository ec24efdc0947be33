"""What hybrid cannot map is refused before anything is written, naming it; reading a foreign
checkpoint opens nothing outside its directory (and runs no code from it); the other layouts a
DCP checkpoint comes in read alike; the command line.

The checkpoints are written by the tools' own calls (``dcp.save`` of ``get_state_dict`` in one
process, orbax's ``StandardCheckpointer``), then, for the hostile cases, edited as an attacker
would edit a downloaded checkpoint.
"""

from __future__ import annotations

import builtins
import os
import pickle

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from hybrid.checkpoint import CheckpointError, convert, open_checkpoint
from hybrid.checkpoint.dcp._reader import _Runs
from hybrid.checkpoint.orbax._safety import check_key
from hybrid.cli import main
from hybrid.core import MappingError, ParamMapping
from tests.checkpoint_formats import _pair

# dcp.save in this one process (no_dist=True) is the intent; torch warns that it assumes so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(cls, **kw):
    model = _pair.torch_model()
    opt = cls(model.parameters(), **kw)
    for i in range(2):
        opt.zero_grad()
        model(torch.from_numpy(_pair.batch(i))).pow(2).mean().backward()
        opt.step()
    return model, opt


def _dcp(path, cls=torch.optim.AdamW, extra=None, **kw):
    model, opt = _trained(cls, **kw)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, **(extra or {})}, checkpoint_id=str(path), no_dist=True)
    return model, opt


def _refused(src, dst, match, **kw):
    """``convert`` refuses, naming ``match``, and writes nothing at DST (nor its staging)."""
    with pytest.raises((CheckpointError, MappingError), match=match):
        convert(src, dst, **kw)
    assert not os.path.lexists(dst) and not os.path.lexists(dst.parent / f".{dst.name}.converting")


@pytest.mark.parametrize("cls, kw, match", [
    (torch.optim.Adagrad, {}, r"\['sum'\]"),
    (torch.optim.RAdam, {}, "lack 'amsgrad'"),
    (torch.optim.Adamax, {}, r"\['exp_inf'\]"),
])
def test_an_optimizer_hybrid_does_not_know_is_refused(tmp_path, cls, kw, match):
    _dcp(tmp_path / "dcp", cls, **kw)
    for to in ("hybrid", "dcp", "orbax"):
        _refused(tmp_path / "dcp", tmp_path / f"out-{to}", match, to=to)


def test_a_missing_step_is_refused_until_given(tmp_path):
    _dcp(tmp_path / "dcp", torch.optim.SGD, lr=0.1, momentum=0.9)  # SGD counts no steps; nothing saved one
    _refused(tmp_path / "dcp", tmp_path / "out", "records no training step", to="hybrid")
    assert convert(tmp_path / "dcp", tmp_path / "out", to="hybrid", step=2).step == 2
    assert open_checkpoint(tmp_path / "out").manifest.optimizer.count == 2
    with pytest.raises(CheckpointError, match="records step 2, but step=5"):
        open_checkpoint(_with_step(tmp_path), step=5)
    # orbax: a params tree and sgd's trace, no step leaf, no manager step, no count.
    params = {"w": jnp.ones((2, 3))}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", {"params": params, "opt_state": optax.sgd(0.1, momentum=0.9).init(params)})
    _refused(tmp_path / "orbax", tmp_path / "out3", "records no training step", to="hybrid")
    assert open_checkpoint(tmp_path / "orbax", step=4).manifest.step == 4


def _with_step(tmp_path):
    _dcp(tmp_path / "stepped", extra={"step": torch.tensor(2)})
    return tmp_path / "stepped"


def test_a_tensor_the_mapping_cannot_place_is_refused(tmp_path):
    _dcp(tmp_path / "dcp")
    like = _pair.flax_params()
    wrong = ParamMapping.flax(renames={"Dense_0": "0", "Dense_1": "2"})  # Dense_2 -> "4" missing
    _refused(tmp_path / "dcp", tmp_path / "out", "Dense_2", to="orbax", like=(like, optax.adamw(0.1).init(like)),
             mapping=wrong)


def test_an_unknown_optax_state_is_refused_naming_it(tmp_path):
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", {"params": params, "opt_state": optax.adagrad(0.1).init(params), "step": 1})
    _refused(tmp_path / "orbax", tmp_path / "out", "opt_state.0.sum_of_squares", to="hybrid")


class _Opened:
    """Every path the process opens, while it lasts."""

    def __enter__(self):
        self.paths, self._open, self._os_open = [], builtins.open, os.open
        builtins.open = lambda f, *a, **k: (self.paths.append(os.fspath(f)), self._open(f, *a, **k))[1]
        os.open = lambda f, *a, **k: (self.paths.append(os.fspath(f)), self._os_open(f, *a, **k))[1]
        return self

    def __exit__(self, *exc):
        builtins.open, os.open = self._open, self._os_open


def _edit_metadata(path, edit):
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test trusts the file it just wrote
    edit(metadata)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_dcp_metadata_pointing_outside_is_refused_before_anything_is_opened(tmp_path):
    _dcp(tmp_path / "dcp")
    (tmp_path / "outside.distcp").write_bytes((tmp_path / "dcp" / "__0_0.distcp").read_bytes())

    def point_outside(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../outside.distcp"
    _edit_metadata(tmp_path / "dcp", point_outside)
    with _Opened() as opened, pytest.raises(CheckpointError, match="outside"):
        open_checkpoint(tmp_path / "dcp")
    assert [p for p in opened.paths if "outside" in p] == []
    _refused(tmp_path / "dcp", tmp_path / "out", "'../outside.distcp'", to="hybrid")


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    _dcp(tmp_path / "dcp")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    _edit_metadata(tmp_path / "dcp", lambda m: setattr(m, "planner_data", Payload()))
    with pytest.raises(CheckpointError, match="system.*refusing to unpickle"):
        open_checkpoint(tmp_path / "dcp")
    assert not marker.exists()


def test_links_inside_a_checkpoint_are_refused(tmp_path):
    _dcp(tmp_path / "dcp")
    data = tmp_path / "dcp" / "__0_0.distcp"
    os.replace(data, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", data)
    with pytest.raises(CheckpointError, match="not a regular file"):
        open_checkpoint(tmp_path / "dcp")
    params = {"w": jnp.ones((2, 3))}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", {"params": params, "step": 1})
    target = next((tmp_path / "orbax" / "d").iterdir())
    os.replace(target, tmp_path / "elsewhere2")
    os.symlink(tmp_path / "elsewhere2", target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        open_checkpoint(tmp_path / "orbax")
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        check_key(("params", "..", "w"), where=tmp_path)


def test_dcp_layouts_read_alike(tmp_path):
    """torch's recipe ({"app": AppState-like nesting}), torchtitan's (model keys at the top level,
    the optimizer flattened under "optimizer"), and a model with buffers."""
    model, opt = _trained(torch.optim.Adam, lr=0.01)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"app": {"model": model_sd, "optim": optim_sd}}, checkpoint_id=str(tmp_path / "app"), no_dist=True)
    flat_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))[1]
    dcp.save({**model_sd, "optimizer": flat_sd, "train_state": {"step": torch.tensor(2)}, "dataloader": {"pos": 7}},
             checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    dcp.save({**model_sd, "optimizer": flat_sd, "step": torch.tensor(2)}, checkpoint_id=str(tmp_path / "top"),
             no_dist=True)
    a, b, c = (open_checkpoint(tmp_path / name) for name in ("app", "titan", "top"))
    assert a.manifest.optimizer == b.manifest.optimizer == c.manifest.optimizer
    assert a.manifest.plan == b.manifest.plan == c.manifest.plan and not c.manifest.buffers
    assert a.manifest.step == b.manifest.step == c.manifest.step == 2
    assert b.manifest.metadata["left_out"] == []  # the rest is carried (tests/checkpoint_formats/test_torchtitan_state.py)
    assert [e["path"] for e in b.manifest.run_state["carried"]["entries"]] == [["dataloader", "pos"], ["train_state", "step"]]
    for kind in ("params", "mu", "nu"):
        x, y = a.tensors(kind), b.tensors(kind)
        assert all(np.array_equal(x[k], y[k]) for k in x), kind
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    bn_opt = torch.optim.SGD(bn.parameters(), lr=0.1, momentum=0.9)
    bn(torch.randn(5, 3)).sum().backward()
    bn_opt.step()
    sd, osd = get_state_dict(bn, bn_opt)
    dcp.save({"model": sd, "optim": osd, "step": 1}, checkpoint_id=str(tmp_path / "bn"), no_dist=True)
    ckpt = open_checkpoint(tmp_path / "bn")
    assert sorted(ckpt.manifest.buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    from hybrid.checkpoint import torch as ckpt_torch
    assert ckpt_torch.load(tmp_path / "bn", fresh, torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)) == 1
    assert torch.equal(fresh[1].running_mean, bn[1].running_mean) and torch.equal(fresh[0].weight, bn[0].weight)


@pytest.mark.parametrize("shape, offsets, sizes", [((4, 6), (1, 2), (2, 3)), ((4, 6), (2, 0), (2, 6)),
                                                   ((2, 3, 4), (1, 1, 0), (1, 2, 4)), ((5,), (3,), (2,))])
def test_a_chunk_of_any_shape_lands_where_it_belongs(shape, offsets, sizes):
    """A DCP chunk that is not FSDP2's whole rows (a column shard, a block) fills the flat ranges
    it overlaps, and only its own elements."""
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    chunk = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    want = np.full(full.size, -1.0, np.float32)
    mask = np.zeros(shape, bool)
    mask[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = True
    want[mask.reshape(-1)] = full.reshape(-1)[mask.reshape(-1)]
    got = np.full(full.size, -1.0, np.float32)
    ranges = [(0, got[:7]), (7, got[7:])]
    runs = _Runs(shape, offsets, sizes)
    assert runs.overlaps(0, full.size)
    runs.copy(chunk.reshape(-1), ranges)
    np.testing.assert_array_equal(got, want)


def test_the_command_line(tmp_path, capsys):
    _dcp(tmp_path / "dcp")
    assert main(["checkpoint", "info", str(tmp_path / "dcp")]) == 0
    out = capsys.readouterr().out
    assert "dcp checkpoint (torch), step 2" in out and "optimizer adamw" in out and "4.weight" in out
    assert main(["checkpoint", "convert", str(tmp_path / "dcp"), str(tmp_path / "h"), "--to", "hybrid",
                 "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "reading and checking everything first" in captured.err and "wrote" in captured.err
    assert open_checkpoint(tmp_path / "h").manifest.world_size == 2
    assert main(["checkpoint", "convert", str(tmp_path / "dcp"), str(tmp_path / "h"), "--to", "orbax"]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["checkpoint", "convert", str(tmp_path / "h"), str(tmp_path / "o"), "--to", "orbax"]) == 0
    assert main(["checkpoint", "convert", str(tmp_path / "o"), str(tmp_path / "d2"), "--to", "dcp"]) == 1
    assert "records no torch param groups" in capsys.readouterr().err and not (tmp_path / "d2").exists()


def test_a_mapping_where_none_fits_is_named(tmp_path):
    """An orbax checkpoint of a flax tree into torch without a mapping, and a mapping given for a
    checkpoint already in torch's names: both refused with what to do."""
    from hybrid.checkpoint import torch as ckpt_torch

    params = _pair.flax_params()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", {"params": params, "opt_state": optax.adam(0.1).init(params), "step": 1})
    model = _pair.torch_model()
    with pytest.raises(CheckpointError, match="pass mapping="):
        ckpt_torch.load(tmp_path / "orbax", model, torch.optim.Adam(model.parameters()))
    _dcp(tmp_path / "dcp")
    with pytest.raises(ValueError, match="holds torch's names and to='hybrid' needs none"):
        convert(tmp_path / "dcp", tmp_path / "out", to="hybrid", mapping=_pair.mapping())
    assert not (tmp_path / "out").exists()


def test_an_ocdbt_location_outside_the_checkpoint_is_refused(tmp_path):
    """An orbax checkpoint whose OCDBT manifest (rewritten with tensorstore's own undump) points
    its B+tree root at another checkpoint's data file: refused before orbax reads anything."""
    import shutil

    import tensorstore as ts

    params = {"w": jnp.ones((2, 3))}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "other", {"params": params, "step": 1})
    shutil.copytree(tmp_path / "other", tmp_path / "evil")
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path / 'evil'}/").result()).result()
    root = manifest["versions"][0]["root"]
    root["location"] = root["location"].replace("btreenode::d/", "btreenode::../other/d/")
    (tmp_path / "evil" / "manifest.ocdbt").write_bytes(ts.ocdbt.undump_manifest(manifest))
    with pytest.raises(CheckpointError, match=r"points at data file '\.\./other/d/.*outside the checkpoint"):
        open_checkpoint(tmp_path / "evil")
