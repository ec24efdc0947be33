"""zero stage 2 and bucketed_all_reduce through jax.distributed: 2 processes on CPU with gloo collectives."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._procs import finish, free_port

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


@pytest.mark.parametrize("local_devices", [2, 1])
def test_two_processes(local_devices):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])
    procs = [subprocess.Popen([sys.executable, str(HERE / "_jax_mp_worker.py"), str(port), str(i),
                               str(local_devices), "5"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for out in finish(procs, "jax.distributed", timeout_s=150):
        for what in ("zero stage 2", "bucketed_all_reduce"):
            assert f"{what}: {2 * local_devices} devices, {local_devices} local, 5 steps equal the reference" in out, out
