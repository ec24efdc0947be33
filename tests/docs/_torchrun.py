"""Launching the docs pages' torchrun scripts (``<!-- snippet: torchrun N -->``) as their pages say:
``torchrun --standalone --nproc_per_node=N``, gloo on the host.

A launch costs three interpreters importing torch (the agent and two workers: ~5.5 s of CPU on
these cores before a script runs a line), so all scripts of the same N run in one launch, one
after another in the same worker processes, each as ``__main__`` in a folder of its own. What made
scripts run that way hang now and then was the store, not the scripts: torchrun's workers
rendezvous through the agent's store, and a process group made again after
``destroy_process_group`` gets the same name (torch resets its group count) and so the same keys
there, where a rank could read the previous group's addresses. So each script gets a store of its
own, hosted by rank 0 at a port it hands to the others through the agent's store (as a launch
that hosts the store on rank 0 rather than in the agent does), and between scripts what a script
can leave in the process is torn down: its default process group if it did not destroy it,
dynamo's compiled code and counters, its objects (collected while no group exists, as at a
reader's interpreter exit).

A script that fails ends the launch (torchrun stops the other ranks); it is reported with the
launch's output, and the scripts after it run in a new launch. A script that runs past the timeout
is killed, with its launch, and reported so.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tests.docs._snippets import _env

MARK = "@docs-script@"
MARKS = re.compile(rf"{re.escape(MARK)} (start|done|pid) (\d+) rank \d+")
SCRIPT_TIMEOUT_S = 170

# What each torchrun worker runs: ``launcher.py MARK script0.py script1.py ...``.
LAUNCHER = r"""
import datetime, gc, os, runpy, socket, sys
import torch.distributed as dist

mark, scripts = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
print(f"{mark} pid {os.getpid()} rank {rank}", flush=True)   # to kill it on a hang
agent_hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
launch_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=rank == 0 and not agent_hosted, timeout=datetime.timedelta(seconds=120))

def tear_down():
    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch._dynamo" in sys.modules:
        import torch._dynamo
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    gc.collect()

for k, script in enumerate(scripts):
    if rank == 0:   # the script's own store: rank 0 hosts it at a port free a moment ago
        with socket.socket() as s:
            s.bind(("", 0))
            launch_store.set(f"docs-script-{k}-port", str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = launch_store.get(f"docs-script-{k}-port").decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    os.chdir(os.path.dirname(script))
    sys.argv = [script]
    print(f"{mark} start {k} rank {rank}", flush=True)
    print(f"{mark} start {k} rank {rank}", file=sys.stderr, flush=True)   # where its errors begin
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    tear_down()
    print(f"{mark} done {k} rank {rank}", flush=True)
"""


def run_scripts(scripts: list[tuple[str, str, int]], folder: pathlib.Path,
                timeout_s: float = SCRIPT_TIMEOUT_S) -> dict[str, str | None]:
    """``{name: None if it exited 0 on every rank, else why}`` for ``(name, source, processes)``
    scripts, those of the same process count in one launch (again after one that fails)."""
    outcomes: dict[str, str | None] = {}
    for nproc in sorted({n for _, _, n in scripts}):
        todo = [(name, source) for name, source, n in scripts if n == nproc]
        while todo:
            launch = folder / f"launch-{len(outcomes)}"
            ran = _launch(todo, nproc, launch, timeout_s)
            outcomes.update(ran)
            todo = todo[len(ran):]
    return outcomes


def _launch(scripts: list[tuple[str, str]], nproc: int, folder: pathlib.Path,
            timeout_s: float) -> dict[str, str | None]:
    """One torchrun launch of ``scripts`` in order: the outcomes of those that finished, and of the
    first that did not (at least one)."""
    paths = []
    for k, (_, source) in enumerate(scripts):
        (folder / str(k)).mkdir(parents=True)
        paths.append(folder / str(k) / "train.py")
        paths[-1].write_text(source)
    launcher = folder / "launcher.py"
    launcher.write_text(LAUNCHER)
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", str(launcher), MARK, *map(str, paths)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=folder, env=_env(),
                                start_new_session=True)
        done, output, ended = _watch(proc, timeout_s)
        stderr.seek(0)
        errors = stderr.read().decode(errors="replace")
    if ended and all(done.get(k, 0) == nproc for k in range(len(scripts))):   # at the workers' exit
        return {name: f"{name}: {ended} after {len(scripts)} scripts returned on every rank (this one "
                      f"among them), as the workers exited\n{errors[-5000:]}" for name, _ in scripts}
    outcomes = {}
    for k, (name, _) in enumerate(scripts):
        if done.get(k, 0) == nproc:
            outcomes[name] = None
        else:
            errors = errors[max(0, errors.find(f"{MARK} start {k} ")):]   # its own, and torchrun's after them
            outcomes[name] = (f"{name}: {ended or 'torchrun exited 0'}, not every rank finished it\n"
                              f"{''.join(output)[-3000:]}\n{errors[-5000:]}")
            break
    return outcomes


def _watch(proc: subprocess.Popen, timeout_s: float) -> tuple[dict[int, int], list[str], str]:
    """Follows a launch to its end: ``({script: ranks done}, the output of the last script started,
    why it ended if not with exit code 0)``; kills it, workers included, when a script runs past
    ``timeout_s``."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
    done, output, current, workers = {}, [], 0, []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            for pid in workers:   # torchrun starts them in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return done, output, f"killed: no end within {timeout_s} s"
        if line is None:
            code = proc.wait()
            return done, output, f"torchrun exited {code}" if code else ""
        if MARKS.sub("", line).strip():
            output.append(MARKS.sub("", line))   # the ranks' writes may share a line
        for event, k in MARKS.findall(line):
            if event == "pid":
                workers.append(int(k))
            elif event == "done":
                done[int(k)] = done.get(int(k), 0) + 1
            elif int(k) > current:   # the next script: its own output and time
                current, output, deadline = int(k), [], time.monotonic() + timeout_s
