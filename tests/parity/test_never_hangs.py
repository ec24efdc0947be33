"""A parity run ends within seconds whatever a rank does, and the docs' first example runs as users
run it: saved verbatim as a file, ``python file.py``, no XLA_FLAGS and no ``__main__`` guard.

Before: a spawned torch rank re-ran the user's script (multiprocessing's spawn imports ``__main__``
again), so a script calling ``hp.run`` at module level died in every process on JAX's device count;
a rank that died before reporting left a bare exit code, and one side's failure waited for the
other side to finish. The bounds below are liveness bounds, not timings (a rank's interpreter
starts and imports torch in 2-5 s on a quiet 2-core machine, 30 s under a loaded one): each is
well under what the run would take if it waited (the other side's whole run, the 120 s timeout).
The messages are the point: the dead rank named first, with its exit code and stderr.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

import hybrid.parity as hp
from tests._xla import QUICK_CODEGEN_FLAGS
from tests.parity._pairs import tiny_data, tiny_flax, tiny_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIVENESS_S = 90


def test_the_docs_first_example_runs_as_a_script(tmp_path):
    text = (ROOT / "docs" / "parity.md").read_text()
    example = re.search(r"## An example on your own pair.*?```python\n(.*?)```", text, re.S).group(1)
    assert "__main__" not in example and "XLA_FLAGS" not in example  # as users copy it
    (tmp_path / "my_pair.py").write_text(example)
    # no device count, as from a fresh shell; compiled as the suite compiles (tests/_xla.py)
    env = {**os.environ, "XLA_FLAGS": QUICK_CODEGEN_FLAGS, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "my_pair.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("parity ok: jax, 2 devices against torch, 2 ranks, steps 0..5"), proc.stdout
    assert (tmp_path / "parity.png").stat().st_size > 10_000


def _vanishing(tmp_path):
    """A factory in a module that is gone by the time the ranks start (an edited or moved file)."""
    (tmp_path / "vanishing_pair.py").write_text(
        "from tests.parity._pairs import tiny_torch\n\ndef factory():\n    return tiny_torch()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import vanishing_pair
        setup = hp.prepare("vanishing_pair:factory", tiny_flax, tiny_data, steps=2)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("vanishing_pair", None)
    (tmp_path / "vanishing_pair.py").unlink()
    del vanishing_pair
    return setup


def test_a_rank_that_cannot_import_the_pair_ends_the_run_with_its_traceback(tmp_path):
    setup = _vanishing(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank \d of 2 failed:.*No module named 'vanishing_pair'"):
        hp.train_torch(setup, world_size=2, timeout_s=120)
    assert time.monotonic() - t0 < LIVENESS_S


def dying_torch(how: str):
    """The tiny pair whose loss ends rank 1 the hard way, with nothing reported."""
    import signal

    import torch.distributed as dist
    net, loss = tiny_torch()

    def doomed(net, batch):
        if dist.is_initialized() and dist.get_rank() == 1:
            if how == "exit":
                os._exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        return loss(net, batch)  # rank 0 goes on into the backward's all-reduce, which rank 1 never joins
    return net, doomed


@pytest.mark.parametrize("how, said", [("exit", "exit code 7"), ("kill", "killed by SIGKILL")])
def test_a_rank_that_dies_without_a_word_ends_the_run_within_seconds(how, said):
    setup = hp.prepare(lambda: dying_torch(how), tiny_flax, tiny_data, steps=2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2 died \({said}\) without reporting; the end of its stderr"):
        hp.train_torch(setup, world_size=2, timeout_s=120)
    seconds = time.monotonic() - t0
    print(f"\nrank 1 {said}: the run ended after {seconds:.1f} s (the ranks' start included)")
    assert seconds < LIVENESS_S


def slow_torch():
    import time as clock
    net, loss = tiny_torch()

    def slow(net, batch):
        clock.sleep(0.5)
        return loss(net, batch)
    return net, slow


def broken_flax():
    params, _ = tiny_flax()

    def loss(p, batch):
        raise ArithmeticError("the JAX half's loss is wrong")
    return params, loss


def test_a_failing_jax_side_stops_the_torch_ranks():
    """400 torch steps of half a second each would take 200 s; the JAX side fails at once and the
    run ends with its error, the torch ranks stopped."""
    t0 = time.monotonic()
    with pytest.raises(ArithmeticError, match="the JAX half's loss is wrong"):
        hp.run(slow_torch, broken_flax, tiny_data, steps=400, world_size=2, num_devices=2, timeout_s=300)
    assert time.monotonic() - t0 < LIVENESS_S
