"""Reading the ```python blocks of the docs pages and running them (shared by the docs tests).

A page's blocks run one after another, each in a fresh namespace, in an interpreter with 4 host
CPU devices for JAX (as tests/conftest.py sets); a block written as a doctest (``>>>``) is run as
one. Markers in an HTML comment on the line before a block change that:

- ``<!-- snippet: continue -->``: the block runs in the namespace the block before it left (a guide
  that runs top to bottom, one program in several blocks);
- ``<!-- snippet: torchrun N -->``: the block is a script for N processes, launched under torchrun
  (gloo on the host) and required to exit 0 on every rank (tests/docs/_torchrun.py);
- ``<!-- snippet: skip (reason) -->``: the block is not run; the reason is required.

One interpreter (:class:`PageRunner`) runs page after page: a fresh interpreter importing torch
and jax is 2-4 s of CPU on these cores, more than most pages' blocks take. Each page starts from
nothing of the page before: a fresh namespace, its own working directory, the environment,
``sys.path`` and warning filters as they were, and what a page can leave in the process torn down
after it (a default process group still initialized, dynamo's compiled code and counters,
matplotlib's figures). An interpreter that dies or hangs fails that page alone (its stderr shown);
the next page gets a new one.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tests._xla import host_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*snippet:\s*skip\s*(.*?)\s*-->\s*\n\s*$")
TORCHRUN = re.compile(r"<!--\s*snippet:\s*torchrun\s+(\d+)\s*-->\s*\n\s*$")
CONTINUE = re.compile(r"<!--\s*snippet:\s*continue\s*-->\s*\n\s*$")
REPORT = "@docs-report@"   # a block's own output may be anything, a printed list included
DONE = "@docs-page-done@"
PAGE_TIMEOUT_S = 170

# Reads pages from its stdin, one JSON line each (``[working directory, token, [(line, source,
# continues), ...]]``), and runs their blocks: one report per block, then DONE, each on a line of its
# own and followed by the page's token (new for each page, so that no output, a late child's
# included, can pass for them). A block that continues shares the namespace of the block before
# it. The blocks' own stdin is /dev/null, so that nothing they start can read the next page.
RUNNER = r"""
import doctest, gc, json, os, sys, traceback, warnings
REPORT, DONE = sys.argv[1:3]

def run_page(token, blocks):
    namespace = {}
    for line, source, continues in blocks:
        if not continues:
            namespace = {"__name__": "__main__"}
        try:
            if source.lstrip().startswith(">>>"):
                test = doctest.DocTestParser().get_doctest(source, namespace, f"line {line}", None, line)
                out = []
                runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
                runner.run(test, out=out.append, clear_globs=False)
                namespace.update(test.globs)   # DocTest ran on a copy: keep its names for a continuation
                error = "".join(out) if runner.failures else None
            else:
                exec(compile(source, f"<docs block at line {line}>", "exec"), namespace)
                error = None
        except BaseException:
            error = traceback.format_exc()
        print("\n" + REPORT + token + json.dumps([line, error]), flush=True)

def tear_down():
    # What a page can leave in the process that a fresh interpreter would not have.
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if "torch._dynamo" in sys.modules:
        import torch._dynamo
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
    gc.collect()

pages = os.fdopen(os.dup(0), "r")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
sys.stdin = open(os.devnull)
environ, path, filters = dict(os.environ), list(sys.path), list(warnings.filters)
for job in pages:
    cwd, token, blocks = json.loads(job)
    os.chdir(cwd)
    try:
        run_page(token, blocks)
    finally:
        tear_down()
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        warnings.filters[:] = filters
    print("\n" + DONE + token, flush=True)
os._exit(0)   # no more pages: nothing to finalize that a test reads
"""


def pages(folder: pathlib.Path, recursive: bool = False) -> list[pathlib.Path]:
    return sorted(folder.rglob("*.md") if recursive else folder.glob("*.md"))


def blocks(page: pathlib.Path, launched: list | None = None):
    """``(to run, skipped with their reasons)``: (first line of the code, source, whether it
    continues the block before it) or (first line, reason). Scripts for torchrun are appended to
    ``launched`` as (first line, source, processes)."""
    text = page.read_text()
    run, skipped = [], []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        before = text[:m.start()]
        marker, torchrun = MARKER.search(before), TORCHRUN.search(before)
        if marker:
            skipped.append((line, marker.group(1)))
        elif torchrun:
            if launched is not None:
                launched.append((line, m.group(1), int(torchrun.group(1))))
        else:
            run.append((line, m.group(1), bool(CONTINUE.search(before))))
    return run, skipped


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "XLA_FLAGS": host_flags(4), "JAX_PLATFORMS": "cpu",
            "OMP_NUM_THREADS": "1"}


class PageRunner:
    """The interpreter that runs pages' blocks, page after page (started at the first page, and
    again after one that died or hung). :meth:`close` ends it."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None

    def _start(self, cwd: pathlib.Path) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-c", RUNNER, REPORT, DONE], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=_env(),
                                      cwd=cwd, start_new_session=True)   # its own group: a hang is killed whole
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc.stdout, self._lines), daemon=True).start()

    @staticmethod
    def _read(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    def _stderr_since(self, offset: int) -> str:
        """What the interpreter wrote to stderr from ``offset`` on (read without moving the file's
        offset, which the interpreter shares)."""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, size - offset, offset).decode(errors="replace")

    def run(self, page: pathlib.Path, tmp_path: pathlib.Path, timeout_s: float = PAGE_TIMEOUT_S):
        """Runs a page's blocks in ``tmp_path``; ``(failures, why some did not report)``, both
        empty when all ran. A failure names the page and the block's first line."""
        run, skipped = blocks(page)
        name = page.relative_to(DOCS).as_posix()
        for line, reason in skipped:
            assert re.fullmatch(r"\(.{8,}\)", reason), f"{name}:{line}: a skipped block must say why, in parentheses"
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start(tmp_path)
        start, token = os.fstat(self._stderr.fileno()).st_size, secrets.token_hex(8)
        try:
            self._proc.stdin.write(json.dumps([str(tmp_path), token, run]) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:   # it died since the last page ended: the output below says why
            pass
        reports, why, deadline = [], "", time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                why = f"(no end within {timeout_s} s: killed)"
                os.killpg(self._proc.pid, signal.SIGKILL)
                break
            if line is None:
                why = f"(the interpreter exited with {self._proc.wait()})"
                break
            if line.startswith(REPORT + token):
                reports.append(json.loads(line[len(REPORT + token):]))
            elif line.startswith(DONE + token):
                break
        failed = [f"{name}:{line}:\n{error}" for line, error in reports if error]
        missing = "" if len(reports) == len(run) and not why else \
            f"{name}: {len(reports)} of {len(run)} blocks reported {why}\n{self._stderr_since(start)[-3000:]}"
        if why:
            self.close()
        return failed, missing

    def close(self) -> None:
        """Ends the interpreter: told there are no more pages, or killed after 30 s."""
        if self._proc is None:
            return
        try:
            self._proc.stdin.close()   # no more pages: it returns
        except BrokenPipeError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._stderr.close()
        self._proc = None
