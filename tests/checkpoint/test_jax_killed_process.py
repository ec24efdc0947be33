"""A multi-process JAX save that cannot finish: the other processes raise within the save's
timeout, naming the culprit (no hang), and the previous checkpoint stays intact and loadable."""

import re
import subprocess

import pytest

from hybrid.checkpoint import Checkpoint
from tests.checkpoint.test_jax_processes import _start

TIMEOUT_S = 3  # the save's timeout_s; jax.distributed's own heartbeat (100 s) is far off
CONFIG = dict(global_batch_size=48, num_steps=4)


def _outcomes(procs) -> dict[int, tuple[float, str]]:
    """Each process's ``(seconds, outcome)`` line, once all have exited (killed at 120 s)."""
    outs = []
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("a process neither returned nor raised within 120 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    found = {}
    for i, out in enumerate(outs):
        m = re.search(r"^outcome after ([0-9.]+) s: (.*)$", out, re.M)
        if m:
            found[i] = (float(m.group(1)), m.group(2))
        else:  # a process that did not report: its output says why (what the assertions then miss)
            print(f"process {i} exited with {procs[i].returncode} without reporting:\n{out[-3000:]}")
    return found


def test_killed_process_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    procs = _start(3, 1, {"config": CONFIG, "path": str(path), "timeout_s": TIMEOUT_S, "die_at": 1})
    outcomes = _outcomes(procs)
    assert procs[1].returncode == 17 and 1 not in outcomes  # killed mid-write
    for i in (0, 2):
        seconds, outcome = outcomes[i]
        print(f"process {i} raised after {seconds:.2f} s: {outcome[:300]}")
        assert outcome.startswith(f"RuntimeError: saving checkpoint {path}"), outcome
        assert f"process 1 did not report its files within timeout_s={TIMEOUT_S} s" in outcome, outcome
        assert "nothing was committed: the path holds the previous checkpoint" in outcome
        assert seconds < 2 * TIMEOUT_S, f"process {i} took {seconds:.1f} s to raise: {outcome}"
    # Process 2 raised with process 0's reason, not a timeout of its own.
    assert outcomes[2][1].startswith(f"RuntimeError: saving checkpoint {path}: process 0: RuntimeError: process 1 ")
    ckpt = Checkpoint(path)
    ckpt.verify()
    assert ckpt.manifest.step == 2 and ckpt.manifest.world_size == 3


def test_processes_that_disagree_are_refused_at_once(tmp_path):
    path = tmp_path / "ckpt"
    outcomes = _outcomes(_start(2, 1, {"config": CONFIG, "path": str(path), "mismatch": True}))
    assert sorted(outcomes) == [0, 1], "a process did not report (its output is printed above)"
    for i in (0, 1):
        seconds, outcome = outcomes[i]
        assert "process 1 wrote its files for another manifest than process 0's" in outcome, outcome
        # An error posted, not a deadline waited out: this save has the default timeout_s (60 s).
        # (A bound of TIMEOUT_S, 3 s, failed on a loaded machine: 5.5 s there, from posting.)
        assert seconds < 20, outcome
    assert outcomes[1][1].startswith(f"RuntimeError: saving checkpoint {path}: process 0: RuntimeError: ")
    assert not path.exists()
