"""hybrid.parity on a user's own small pair (tests/parity/_pairs.py's regression net in torch and
flax): the ``python -m hybrid parity`` command, what it refuses and how, and errors of the user's
own code raised where the user can read them. Split from test_harness.py along its seam (the GPT
pair and the twin MLP stay there).

Worlds: the CLI's run (stage 0, through ``hp.run``) and the rank that fails start their own: what
they do with their world is the subject. The CLI runs ``hybrid.cli.main`` in this process (a fresh
interpreter importing torch and JAX was most of each call's time), but for
``test_the_cli_runs_as_a_process``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import subprocess
import sys

import pytest

import hybrid.parity as hp
from tests._xla import QUICK_CODEGEN_FLAGS
from tests.parity._pairs import tiny_data, tiny_flax, tiny_torch_failing_on_rank_1, tiny_torch_unreduced_loss

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_an_error_on_a_torch_rank_is_raised_here_with_its_traceback():
    setup = hp.prepare(tiny_torch_failing_on_rank_1, tiny_flax, tiny_data, steps=2)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed:.*FloatingPointError: rank 1's data loader") as e:
        hp.train_torch(setup, world_size=2, timeout_s=120)
    # rank 0 fails too (its peer left mid-collective) and exits non-zero, but it said why: not a silent death
    assert "without reporting" not in str(e.value)


def test_a_loss_that_is_no_scalar_is_refused_before_anything_trains():
    """prepare runs torch's loss once (to observe its gradient-ready order): the harness's own
    message, here, before a rank is spawned."""
    with pytest.raises(TypeError, match=r"the torch loss_fn must return a scalar tensor, got Tensor \(8, 1\)"):
        hp.prepare(tiny_torch_unreduced_loss, tiny_flax, tiny_data, steps=2)


def _cli_process(*args, cwd=ROOT):
    """``python -m hybrid parity ARGS`` in a fresh interpreter, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": QUICK_CODEGEN_FLAGS, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hybrid", "parity", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=170)


def _cli(*args):
    """``python -m hybrid parity ARGS`` as :func:`_cli_process` reports it (exit code, stdout,
    stderr), run in this process through ``hybrid.cli.main``: a fresh interpreter importing torch
    and JAX was most of each call's time, and only :func:`test_the_cli_runs_as_a_process` makes
    the process its subject. ``sys.path`` is restored (the command puts the working directory first)."""
    from hybrid import cli

    out, err, path = io.StringIO(), io.StringIO(), list(sys.path)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["parity", *args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    finally:
        sys.path[:] = path
    return subprocess.CompletedProcess(["parity", *args], code or 0, out.getvalue(), err.getvalue())


def test_the_cli_runs_as_a_process():
    """``python -m hybrid parity`` in a fresh interpreter: its exit code and its message on stderr
    (the other CLI tests call the same ``hybrid.cli.main`` in this process)."""
    here = "tests.parity._pairs"
    proc = _cli_process("--torch", f"{here}:tiny_torch", "--jax", f"{here}:tiny_flax", "--data", f"{here}:tiny_data",
                        "--steps", "0")
    assert proc.returncode == 2 and "hybrid parity: --steps must be at least 1, got 0" in proc.stderr, proc.stderr


def test_cli_on_a_users_pair(tmp_path):
    """Stage 0: DDP with torch.optim.SGD against bucketed_all_reduce then optax's sgd (stages 1 and
    2 run above)."""
    here = "tests.parity._pairs"
    proc = _cli("--torch", f"{here}:tiny_torch", "--jax", f"{here}:tiny_flax", "--data", f"{here}:tiny_data",
                "--steps", "4", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--stage", "0",
                "--param-tolerance", "out.*=1e-3,1e-4", "--plot", str(tmp_path / "p.png"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = hp.ParityReport.from_json(proc.stdout)
    assert report.ok and report.plans_match and len(report.losses[0]) == 4
    assert report.tolerance.per_tensor == (("out.*", 1e-3, 1e-4),)
    assert [name for name, *_ in report.params] == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--devices", "-2"], "--devices must be at least 1, got -2"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--stage", "4"], "--stage must be 0, 1, 2 or 3, got 4"),
    (["--optimizer", "lamb"], "optimizer must be one of ('sgd', 'adam', 'adamw'), got 'lamb'"),
    (["--mapping", "tests.parity._pairs:VOCAB"], "must name a hybrid.core.ParamMapping (or a function returning one), got int"),
    (["--torch", "tests.parity._pairs:nothing"], "--torch 'tests.parity._pairs:nothing': "
                                                  "'tests.parity._pairs' has no 'nothing'"),
    (["--tolerance", "1e-5,1e-6"], "--tolerance wants 4 comma-separated numbers, got '1e-5,1e-6'"),
    (["--tolerance", "1e-5,1e-6,-1,0"], "Tolerance.param_rtol must be a finite number >= 0, got -1.0"),
    (["--param-tolerance", "out.bias"], "--param-tolerance wants PATTERN=RTOL,ATOL, got 'out.bias'"),
    (["--param-tolerance", "out.bias=1e-3"], "--param-tolerance out.bias wants 2 comma-separated numbers"),
    # a typo is found before anything trains, against torch's names
    (["--param-tolerance", "out.bais=1e-3,1e-4"], "patterns ['out.bais'] match no tensor of the pair"),
])
def test_cli_refuses_bad_options_by_name(args, message):
    here = "tests.parity._pairs"
    base = {"--torch": f"{here}:tiny_torch", "--jax": f"{here}:tiny_flax", "--data": f"{here}:tiny_data"}
    base.update(dict(zip(args[::2], args[1::2])))
    proc = _cli(*[x for kv in base.items() for x in kv])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
