"""The save protocol under crash injection, as file-system people test theirs.

A save is stopped right before each of its file-system operations in turn (and, across two
consecutive saves, before each pair of operations), as if the process were killed there: nothing
after the crash runs. Then the newest *committed* checkpoint (the last save whose staging
directory was renamed to PATH, its commit point) must load, verified, with its own values; and a
further save must succeed and leave no hidden leftovers. Run for PATH as a plain directory and as
a symbolic link (``latest -> step-dir``), which must stay a link.
"""

import os
import warnings

import numpy as np
import pytest

import hybrid.checkpoint._protocol as protocol
import hybrid.checkpoint._write as write_module
from hybrid.checkpoint import Checkpoint, save_arrays


class Crash(BaseException):
    """The process stops here: not an Exception, so no handler in the code under test runs."""


class CrashingFileSystem(protocol.FileSystem):
    """Counts operations, crashes before operation number ``crash_at``, notes each commit."""

    def __init__(self):
        self.ops, self.crash_at, self.step, self.committed = 0, None, None, None

    def before(self, op, path):
        if self.ops == self.crash_at or (op, path.name) == self.crash_at:
            raise Crash(f"crash before {op} {path}")
        self.ops += 1
        if op == "rename" and path.name.endswith(".saving"):
            self.committed = self.step  # the rename below cannot fail: this save is now PATH


class _Serial:
    """A ThreadPoolExecutor stand-in that runs rank files one after the other, so that operation
    number k is the same operation in every run."""

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items):
        return [fn(i) for i in items]


def _params(step):
    return {"w": np.full((3, 4), step, np.float32), "b": np.arange(5, dtype=np.float32) + step}


@pytest.fixture
def crashing(monkeypatch):
    fs = CrashingFileSystem()
    monkeypatch.setattr(protocol, "fs", fs)
    monkeypatch.setattr(write_module.concurrent.futures, "ThreadPoolExecutor", _Serial)
    # A crash here is an exception before an operation, never lost power: what an fsync makes
    # durable is not what these tests can see. The crash matrix makes ~5,800 fsyncs per case (a
    # few ms each to this disk, much of its time); each stays an operation a crash stops before.
    monkeypatch.setattr(protocol.os, "fsync", lambda fd: None)
    return fs


def _save(fs, path, step, crash_at=None):
    """Save ``step``; returns how many operations ran (the save's count when it did not crash)."""
    fs.ops, fs.crash_at, fs.step = 0, crash_at, step
    try:
        save_arrays(path, _params(step), world_size=2, step=step)
    except Crash:
        pass
    return fs.ops


def _fresh(tmp_path, name, linked):
    """An initial committed checkpoint at step 0, at ``tmp_path/name/ckpt`` or behind a link to it."""
    root = tmp_path / name
    root.mkdir()
    path = root / "latest" if linked else root / "ckpt"
    if linked:
        (root / "step-dir").mkdir()
        path.symlink_to(root / "step-dir")
    return root, path


def _check(fs, root, path, linked, scenario):
    expected = fs.committed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an interrupted swap reads .previous, saying so
        ckpt = Checkpoint(path)
    assert ckpt.manifest.step == expected, scenario
    ckpt.verify()
    for name, value in ckpt.tensors("params").items():
        np.testing.assert_array_equal(value, _params(expected)[name], err_msg=str(scenario))
    _save(fs, path, 99)
    assert Checkpoint(path).manifest.step == 99, scenario
    assert sorted(p.name for p in root.iterdir()) == (["latest", "step-dir"] if linked else ["ckpt"]), scenario
    assert path.is_symlink() == linked, scenario


@pytest.mark.parametrize("linked", [False, True], ids=["directory", "symlink"])
def test_a_crash_before_any_operation_of_one_or_two_saves_keeps_the_newest_committed_checkpoint(
        tmp_path, crashing, linked):
    fs = crashing
    root, path = _fresh(tmp_path, "count", linked)
    _save(fs, path, 0)
    num_ops = _save(fs, path, 1)  # a save over an existing checkpoint
    scenarios = 0
    for k1 in range(num_ops + 1):  # k1 == num_ops: the first save completes
        root, path = _fresh(tmp_path, f"single-{k1}", linked)
        _save(fs, path, 0)
        _save(fs, path, 1, crash_at=k1 if k1 < num_ops else None)
        _check(fs, root, path, linked, (k1,))
        scenarios += 1
        # What the second save meets depends on where the first stopped: count its operations.
        _, probe = _fresh(tmp_path, f"probe-{k1}", linked)
        _save(fs, probe, 0)
        _save(fs, probe, 1, crash_at=k1 if k1 < num_ops else None)
        num_ops_2 = _save(fs, probe, 2)
        for k2 in range(num_ops_2):
            root, path = _fresh(tmp_path, f"pair-{k1}-{k2}", linked)
            _save(fs, path, 0)
            _save(fs, path, 1, crash_at=k1 if k1 < num_ops else None)
            _save(fs, path, 2, crash_at=k2)
            _check(fs, root, path, linked, (k1, k2))
            scenarios += 1
    # The figure the docs quote: operations per save, and the scenarios run.
    print(f"{num_ops} operations per save, {scenarios} crash scenarios ({'symlink' if linked else 'directory'})")
    assert num_ops >= 15 and scenarios > num_ops ** 2


def test_two_crashes_in_a_row_keep_a_checkpoint(tmp_path, crashing):
    """The sequence that lost everything before: the first save stops between the two renames of
    its swap, the second right before its own swap (after it cleared what it found)."""
    fs = crashing
    path = tmp_path / "ckpt"
    _save(fs, path, 0)
    _save(fs, path, 1)
    commit = ("rename", ".ckpt.saving")
    _save(fs, path, 2, crash_at=commit)
    assert not path.exists() and (tmp_path / ".ckpt.previous").exists()
    with pytest.warns(UserWarning, match="interrupted while swapping"):
        assert Checkpoint(path).manifest.step == 1
    _save(fs, path, 3, crash_at=commit)  # the old protocol had cleared .previous by now: all lost
    with pytest.warns(UserWarning, match="interrupted while swapping"):
        assert Checkpoint(path).manifest.step == 1


def test_saving_through_a_link_writes_where_it_points(tmp_path):
    """``latest -> step-01000``: every save writes step-01000 (atomically), the link stays a link."""
    (tmp_path / "step-01000").mkdir()
    link = tmp_path / "latest"
    link.symlink_to("step-01000")
    for step in range(3):
        save_arrays(link, _params(step), world_size=2, step=step)
        assert link.is_symlink() and os.readlink(link) == "step-01000"
        assert Checkpoint(link).manifest.step == step
        assert Checkpoint(tmp_path / "step-01000").manifest.step == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-01000"]
    # A link to a link, and a dangling link (its target is created).
    (tmp_path / "newest").symlink_to("latest")
    save_arrays(tmp_path / "newest", _params(7), step=7)
    assert Checkpoint(tmp_path / "step-01000").manifest.step == 7
    (tmp_path / "next").symlink_to("step-02000")
    save_arrays(tmp_path / "next", _params(8), step=8)
    assert (tmp_path / "next").is_symlink() and Checkpoint(tmp_path / "step-02000").manifest.step == 8


def _committed_with_previous(tmp_path, monkeypatch, *, old_files, world_size):
    """Step 1 committed over step 0 (``old_files`` files) with step 9 not yet run: ``(PATH, .previous)``."""
    path = tmp_path / "ckpt"
    save_arrays(path, _params(0), world_size=old_files, step=0)
    with monkeypatch.context() as m:
        m.setattr(write_module, "remove_previous_part", lambda *a, **k: None)
        save_arrays(path, _params(1), world_size=world_size, step=1)
    prev = tmp_path / ".ckpt.previous"
    assert len(list(prev.glob("rank-*"))) == old_files
    return path, prev


@pytest.mark.parametrize("order", [(0, 1), (1, 0), (2, 0, 1)])
def test_the_replaced_checkpoint_goes_with_whichever_rank_finishes_last(tmp_path, order, monkeypatch):
    """Step 9 has no barrier: each rank removes its part of ``.previous`` (3 old files, the
    ranks of ``order``), and whichever finishes last removes the directory, in any order."""
    path, prev = _committed_with_previous(tmp_path, monkeypatch, old_files=3, world_size=len(order))
    for rank in order:
        assert prev.exists()
        protocol.remove_previous_part(path, rank, len(order))
        assert Checkpoint(path).manifest.step == 1
    assert not prev.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_rank_that_saves_again_before_a_straggler_removed_its_files(tmp_path, monkeypatch):
    """Rank 0 returns and begins the next save (clearing ``.previous``) while rank 1 has not yet
    removed its old file: neither trips over the other, and the next save commits."""
    path, prev = _committed_with_previous(tmp_path, monkeypatch, old_files=2, world_size=2)
    protocol.remove_previous_part(path, 0, 2)
    protocol.begin_save(path)  # rank 0's next save removes rank 1's leftover for it
    protocol.remove_previous_part(path, 1, 2)  # the straggler finds nothing to remove
    assert not prev.exists()
    save_arrays(path, _params(2), world_size=2, step=2)
    assert Checkpoint(path).manifest.step == 2


def test_a_straggler_removing_the_emptied_directory_first(tmp_path, monkeypatch):
    """Rank 0's next save empties ``.previous``, and the straggler's step 9 removes the emptied
    directory right before rank 0 does: rank 0's save goes on."""
    path, prev = _committed_with_previous(tmp_path, monkeypatch, old_files=2, world_size=2)

    class StragglerFirst(protocol.FileSystem):
        straggled = False

        def before(self, op, p):
            if op == "rmdir" and p == prev and not self.straggled:
                self.straggled = True
                protocol.remove_previous_part(path, 1, 2)  # the straggler: nothing left but the directory

    monkeypatch.setattr(protocol, "fs", StragglerFirst())
    save_arrays(path, _params(2), world_size=2, step=2)
    assert Checkpoint(path).manifest.step == 2 and not prev.exists()
