"""Reading the ```python blocks of the docs pages and running them (shared by the docs tests).

A page's blocks run in one subprocess (4 host CPU devices for JAX, as tests/conftest.py sets),
one after another, each in a fresh namespace; a block written as a doctest (``>>>``) is run as
one. Markers in an HTML comment on the line before a block change that:

- ``<!-- snippet: continue -->``: the block runs in the namespace the block before it left (a guide
  that runs top to bottom, one program in several blocks);
- ``<!-- snippet: torchrun N -->``: the block is a script for N processes, launched under torchrun
  (gloo on the host) and required to exit 0 on every rank;
- ``<!-- snippet: skip (reason) -->``: the block is not run; the reason is required.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*snippet:\s*skip\s*(.*?)\s*-->\s*\n\s*$")
TORCHRUN = re.compile(r"<!--\s*snippet:\s*torchrun\s+(\d+)\s*-->\s*\n\s*$")
CONTINUE = re.compile(r"<!--\s*snippet:\s*continue\s*-->\s*\n\s*$")

# Runs the blocks of one page: ``[(line, source, continues), ...]`` as JSON on stdin, one report
# per block; a block that continues shares the namespace of the block before it.
RUNNER = r"""
import doctest, json, sys, traceback
blocks = json.load(sys.stdin)
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
    print("\n@docs-report@" + json.dumps([line, error]), flush=True)   # on a line of its own
"""
REPORT = "@docs-report@"   # a block's own output may be anything, a printed list included

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
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
            "OMP_NUM_THREADS": "1"}


def run_page(page: pathlib.Path, tmp_path: pathlib.Path) -> tuple[list[str], str]:
    """Runs a page's blocks; ``(failures, why some did not report)``, both empty when all ran."""
    run, skipped = blocks(page)
    name = page.relative_to(DOCS).as_posix()
    for line, reason in skipped:
        assert re.fullmatch(r"\(.{8,}\)", reason), f"{name}:{line}: a skipped block must say why, in parentheses"
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(run), capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=170)
    reports = [json.loads(line[len(REPORT):]) for line in proc.stdout.splitlines() if line.startswith(REPORT)]
    failed = [f"{name}:{line}:\n{error}" for line, error in reports if error]
    missing = "" if len(reports) == len(run) else \
        f"{name}: only {len(reports)} of {len(run)} blocks reported\n{proc.stderr[-3000:]}"
    return failed, missing


def run_torchrun(source: str, nproc: int, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """Launches a script as its page says: ``torchrun --standalone --nproc_per_node=N script.py``.
    One launch per script: scripts run one after another in the same processes hung now and then
    (a process group made again after ``destroy_process_group``), so each gets fresh processes."""
    script = tmp_path / "train.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=170)
