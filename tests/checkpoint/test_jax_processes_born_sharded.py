"""Stage-3 parameters born sharded across the processes of a jax.distributed job (issue 36, item 3):
2 processes of 2 devices; ``init_shards`` over the global mesh, a save, and a load into
``abstract_shards``: each process holds (and reads) only its devices' slices, bit for bit those
``shard_params`` cuts from the jitted init (``_jax_born_sharded_worker.py`` checks them)."""

from pathlib import Path

import pytest

from tests._procs import finish, start_jax_job

HERE = Path(__file__).parent


@pytest.mark.timeout(150)
def test_born_sharded_and_loaded_across_processes(tmp_path):
    outs = finish(start_jax_job(HERE / "_jax_born_sharded_worker.py", 2, str(tmp_path)), "born sharded",
                  timeout_s=120)
    for i, out in enumerate(outs):
        assert f"process {i}: ok" in out, out[-2000:]
