"""Launching and waiting for groups of processes, as the multi-process tests do."""

import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests._xla import host_flags


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Modules the forkserver imports once; every rank forked from it starts with them loaded (a fresh
# interpreter importing torch is most of a small multi-process test's time on 2 cores).
PRELOAD = ["torch", "torch.distributed", "hybrid.torch"]


def forkserver_context():
    """The forkserver multiprocessing context, its server preloading :data:`PRELOAD`.

    forkserver rather than fork: the server is a fresh interpreter, so ranks do not inherit the
    threads (and held locks) that JAX or torch started in the test process.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def forkserver_ranks(target, args, num_reports: int, *, world: int = 2, wait_s: float = 90):
    """Start ``world`` ranks of ``target(*args, rank, port, queue)`` and collect ``num_reports``
    ``(rank, outcome, seconds)`` reports from the queue; returns ``(reports, processes)``.

    Ranks come from :func:`forkserver_context`. Ranks still alive after the reports are killed,
    so a hung rank never outlives its test.
    """
    ctx = forkserver_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(*args, r, port, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(num_reports):
            rank, outcome, seconds = out.get(timeout=wait_s)
            reports[rank] = (outcome, seconds)
    except queue.Empty:
        pytest.fail(f"only {reports} reported within {wait_s} s")
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
    return reports, procs


def report_outcome(rank: int, out, step) -> None:
    """Run ``step()`` and put ``(rank, outcome, seconds)`` on ``out``: "returned", or the error it
    raised as ``"Type: message"`` (what a fault test's survivor raises is the test's subject)."""
    t0 = time.monotonic()
    try:
        step()
        out.put((rank, "returned", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))


def finish(procs, what: str, *, timeout_s: float) -> list[str]:
    """Each process's output once all have exited; any still running at the timeout is killed,
    and a non-zero exit fails the test with that process's output."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{what} process {i} exited with {p.returncode}:\n{out[-4000:]}"
    return outs


def start_jax_job(script, num_processes: int, *args: str) -> list:
    """A jax.distributed job on 127.0.0.1: ``python SCRIPT PORT NUM_PROCESSES PROCESS_ID *ARGS``
    once per process, output captured, XLA_FLAGS left for the script to set (its device count)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this checkout's hybrid
    return [subprocess.Popen([sys.executable, str(script), str(port), str(num_processes), str(i), *map(str, args)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(num_processes)]


def join_jax_job(local_devices: int):
    """Make this process its part of a :func:`start_jax_job` job (``sys.argv``: ``SCRIPT PORT
    NUM_PROCESSES PROCESS_ID ...``): ``local_devices`` host CPU devices, gloo collectives, then
    ``jax.distributed.initialize``. Call first thing in the worker, before anything imports jax
    (the device count is read when jax starts); returns the jax module."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = host_flags(local_devices)  # compiled as the suite's own process compiles
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[1]}", num_processes=int(sys.argv[2]),
                               process_id=int(sys.argv[3]), initialization_timeout=60)
    return jax


def init_gloo(rank: int, port: int, *, world: int = 2, timeout_s: float = 30) -> None:
    """Make this process rank ``rank`` of a gloo group meeting on 127.0.0.1:``port``, with one
    torch thread (the ranks share the machine's cores)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


WORLD_TIMEOUT_S = 60  # as hybrid.demo's worlds: a rank that dies fails the others within this


def _world_rank(fn, args, kwargs, world_size, rank, port, out):
    """One rank: ``fn``'s value (rank 0's; the others report None) or the traceback."""
    import torch.distributed as dist

    from hybrid.demo import pin_torch_numerics

    try:
        init_gloo(rank, port, world=world_size, timeout_s=WORLD_TIMEOUT_S)
        pin_torch_numerics()
        value = fn(*args, **kwargs, progress=None)
        out.put((rank, ("value", value if rank == 0 else None), 0.0))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, ("error", traceback.format_exc()), 0.0))


def torch_world(fn, *args, world_size: int = 2, wait_s: float = 150, **kwargs):
    """``fn(*args, **kwargs, progress=None)`` on each rank of a gloo world of ``world_size`` ranks
    forked from :func:`forkserver_context` (torch imported once for the test run, where
    ``hybrid.demo.spawn_world`` starts fresh interpreters that import it: 2-3 s of CPU a rank);
    rank 0's value, as ``spawn_world`` returns it. Each rank runs what ``spawn_world``'s rank runs:
    gloo on 127.0.0.1, ``pin_torch_numerics()``, then ``fn``. A rank that raises fails the test with
    its traceback. ``fn`` travels by reference: a rank imports its module, so that module should not
    import jax at its top (every rank would).

    >>> from hybrid.demo import TrainConfig, train_torch
    >>> torch_world(train_torch, TrainConfig(num_steps=3), world_size=1).losses.shape
    (3,)
    """
    reports, _ = forkserver_ranks(_world_rank, (fn, args, kwargs, world_size), world_size, world=world_size, wait_s=wait_s)
    for rank, ((kind, value), _) in sorted(reports.items()):
        if kind == "error":
            pytest.fail(f"torch rank {rank} of {world_size} failed:\n{value}")
    return reports[0][0][1]
