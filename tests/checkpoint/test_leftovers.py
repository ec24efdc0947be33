"""A failed save leaves no hidden ``.NAME.saving`` behind where a process lives to remove it, and
what a killed save leaves is found and cleared by ``hybrid.checkpoint.leftovers`` /
``clear_leftovers``, which never remove the only complete copy of a checkpoint.

Before: a save that raised after its staging directory existed left ``.NAME.saving`` until a
later save of the same NAME, which with a name per step never comes."""

import pathlib

import numpy as np
import pytest

import hybrid.checkpoint._protocol as protocol
from hybrid.checkpoint import Checkpoint, clear_leftovers, leftovers, save_arrays

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


class _DiskFull(protocol.FileSystem):
    """Writing a rank file fails, as a full disk makes it."""

    def before(self, op, path):
        if op == "write" and path.name.startswith("rank-00001"):
            raise OSError(28, "No space left on device")


def test_a_failed_save_removes_what_it_staged(tmp_path, monkeypatch):
    path = tmp_path / "step-1"
    save_arrays(path, PARAMS, world_size=2, step=1)
    monkeypatch.setattr(protocol, "fs", _DiskFull())
    with pytest.raises(OSError, match="No space left on device"):
        save_arrays(path, {k: v + 1 for k, v in PARAMS.items()}, world_size=2, step=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # no .step-1.saving
    assert Checkpoint(path).manifest.step == 1
    with pytest.raises(OSError):  # a first save of a new name leaves nothing either
        monkeypatch.setattr(protocol, "fs", _DiskFull())
        save_arrays(tmp_path / "step-2", PARAMS, world_size=2, step=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def _complete(path: pathlib.Path, step: int) -> None:
    save_arrays(path, PARAMS, step=step)


def test_leftovers_are_found_and_cleared_without_losing_a_checkpoint(tmp_path):
    _complete(tmp_path / "step-1", 1)
    (tmp_path / ".step-2.saving").mkdir()  # a save killed before its commit
    (tmp_path / ".step-2.saving" / "rank-00000-of-00001.safetensors.part").write_bytes(b"half")
    _complete(tmp_path / ".step-1.previous", 0)  # killed in step 9: step-1 is in place, this is stale
    _complete(tmp_path / ".step-3.previous", 3)  # killed between the two renames: step-3 is missing
    _complete(tmp_path / ".step-4.previous", 4)  # beside a step-4 that is no checkpoint: left for the user
    (tmp_path / "step-4").mkdir()
    found = {x.path.name: x.action for x in leftovers(tmp_path)}
    assert found == {".step-1.previous": "remove", ".step-2.saving": "remove", ".step-3.previous": "restore",
                     ".step-4.previous": "keep"}
    assert "only complete copy" in str(next(x for x in leftovers(tmp_path) if x.action == "keep"))
    cleared = {p.name for p in clear_leftovers(tmp_path)}
    assert cleared == {".step-1.previous", ".step-2.saving", ".step-3.previous"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-4.previous", "step-1", "step-3", "step-4"]
    assert Checkpoint(tmp_path / "step-3").manifest.step == 3 and Checkpoint(tmp_path / "step-1").manifest.step == 1
