"""One process of a jax.distributed job that trains the twin model and saves or resumes a checkpoint.

    python _jax_mp_worker.py PORT NUM_PROCESSES PROCESS_ID LOCAL_DEVICES JOB_JSON

JOB_JSON, one of
- ``{"config": TrainConfig kwargs, "train": train_jax kwargs (resume, save_to, save_at), "out":
  .npz written by process 0}``, and ``"plain": PATH`` to save an unsharded optax state after,
  ``"born_sharded": DIR`` to run ``_jax_born_sharded.py``'s check after (in the same processes);
- ``{"config": ..., "path": PATH, "timeout_s": T, "die_at": P}``: train to step 2, save, train to
  4, then process P dies while writing its file during the save of step 4;
- ``{"config": ..., "path": PATH, "mismatch": true}``: each process saves another step.
In the last two each surviving process prints ``outcome after S s: ...`` and exits without
jax.distributed's shutdown barrier (a dead peer would hold it).
"""

import json
import os
import sys
import time

from tests._procs import join_jax_job  # before jax: it sets the device count jax starts with

jax = join_jax_job(int(sys.argv[4]))

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import hybrid.checkpoint._protocol as protocol  # noqa: E402
from hybrid.demo import TrainConfig, build_jax, train_jax, train_jax_steps  # noqa: E402
from hybrid.checkpoint import jax as ckpt  # noqa: E402
from hybrid.demo._jax_run import global_array, zero_layout  # noqa: E402
from hybrid.models import jax_params  # noqa: E402

JOB = json.loads(sys.argv[5])
MESH = Mesh(np.array(jax.devices()), ("dp",))  # process 0's devices first: device r is rank r


def train() -> None:
    result = train_jax(TrainConfig(**JOB["config"]), mesh=MESH, **JOB.get("train", {}))
    if jax.process_index() == 0:
        np.savez(JOB["out"], losses=result.losses, start_step=result.start_step,
                 **{f"param/{k}": v for k, v in result.params.items()})
    print(f"process {jax.process_index()}: trained {len(result.losses)} steps on {MESH.size} devices", flush=True)
    if "plain" in JOB:
        save_plain(JOB["plain"], result.params)
    if "born_sharded" in JOB:
        from tests.checkpoint._jax_born_sharded import born_sharded
        print(born_sharded(MESH, JOB["born_sharded"]), flush=True)


def save_plain(path: str, params: dict[str, np.ndarray]) -> None:
    """An unsharded adam state, replicated over the mesh of every process, cut into 3 files by 2
    processes, with buffers and run state; the test knows every value from the params."""
    def replicated(tree):
        return jax.tree_util.tree_map(lambda x: global_array(x, MESH, P()), tree)

    tree = replicated(jax_params(params))
    adam = optax.adam(1e-2).init(tree)
    mu, nu = ({k: f(v) for k, v in params.items()} for f in (lambda v: 2 * v, lambda v: v * v))
    adam = (adam[0]._replace(count=replicated(np.int32(7)), mu=replicated(jax_params(mu)),
                             nu=replicated(jax_params(nu))), *adam[1:])
    buffers = replicated({"bn": {"mean": np.full(3, 0.5, np.float32)}})
    ckpt.save(path, tree, adam, step=7, world_size=3, buffers=buffers, state={"epoch": 1})


class _DieWhileWriting(protocol.FileSystem):
    def before(self, op, path):
        if op == "write" and path.name.startswith("rank-"):
            os._exit(17)  # killed mid-write (the first chunk is on disk): no exception, no cleanup


def die_while_saving() -> None:
    config = TrainConfig(**JOB["config"])
    path, timeout_s = JOB["path"], JOB["timeout_s"]

    def save(run, step):
        return ckpt.save(path, run.params, run.state, step=step, timeout_s=timeout_s, **zero_layout(config))

    run, _ = train_jax_steps(build_jax(config, MESH), config, 0, 2)
    save(run, 2)
    run, _ = train_jax_steps(run, config, 2, 4)
    if jax.process_index() == JOB["die_at"]:
        protocol.fs = _DieWhileWriting()
    report_outcome(lambda: save(run, 4))


def mismatch() -> None:
    """Every process saves, process p at step 1 + p: process 0 refuses, the others hear why."""
    config = TrainConfig(**JOB["config"])
    run = build_jax(config, MESH)
    report_outcome(lambda: ckpt.save(JOB["path"], run.params, run.state, step=1 + jax.process_index(),
                                     **zero_layout(config)))


def report_outcome(save) -> None:
    """Print what ``save()`` did and how long it took, then leave at once."""
    t0 = time.monotonic()
    try:
        save()
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - what the survivors raise is the test's subject
        outcome = f"{type(e).__name__}: {e}"
    print(f"outcome after {time.monotonic() - t0:.2f} s: {outcome}", flush=True)
    _wait_for_reports()
    os._exit(0)  # a peer may be dead: jax.distributed's shutdown barrier would wait for it


def _wait_for_reports(deadline_s: float = 30.0) -> None:
    """Process 0 hosts the coordination service, through which the others hear why a save failed:
    leaving at once could cut off a process still reading that reason (JAX then terminates it
    before it reports). So every other process says it has reported, and process 0 waits for
    those expected to (all but one told to die), up to ``deadline_s``."""
    from hybrid.checkpoint.jax._processes import _client

    client = _client()
    if jax.process_index() != 0:
        client.key_value_set(f"test-reported/{jax.process_index()}", "1")
        return
    expected = {p for p in range(1, jax.process_count()) if p != JOB.get("die_at")}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if expected <= {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get("test-reported/")}:
            return
        time.sleep(0.05)


mismatch() if "mismatch" in JOB else die_while_saving() if "die_at" in JOB else train()
jax.distributed.shutdown()
