"""Every fenced ```python block of every docs/*.md page runs, on the pinned versions.

Each page runs in one subprocess (4 host CPU devices for JAX, as tests/conftest.py sets), its
blocks one after another, each in a fresh namespace; a block written as a doctest (``>>>``) is
run as one. A block that cannot run here is preceded by a marker that says why, e.g.
``<!-- snippet: skip (needs several processes: torchrun) -->``; a marker without a reason fails.
Pages added later are picked up by the glob.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*snippet:\s*skip\s*(.*?)\s*-->\s*\n\s*$")

# Runs the blocks of one page: ``[(line, source), ...]`` as JSON on stdin, one report per block.
RUNNER = r"""
import doctest, json, sys, traceback
blocks = json.load(sys.stdin)
for line, source in blocks:
    try:
        if source.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(source, {}, f"line {line}", None, line)
            out = []
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            runner.run(test, out=out.append)
            error = "".join(out) if runner.failures else None
        else:
            exec(compile(source, f"<docs block at line {line}>", "exec"), {"__name__": "__main__"})
            error = None
    except BaseException:
        error = traceback.format_exc()
    print(json.dumps([line, error]), flush=True)
"""


def blocks(page: pathlib.Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(to run, skipped with their reasons)``: (first line of the code, source or reason)."""
    text = page.read_text()
    run, skipped = [], []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        marker = MARKER.search(text[:m.start()])
        if marker:
            skipped.append((line, marker.group(1)))
        else:
            run.append((line, m.group(1)))
    return run, skipped


def test_pages_have_blocks():
    assert PAGES and sum(len(blocks(p)[0]) for p in PAGES) >= 8


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_page_blocks_run(page, tmp_path):
    run, skipped = blocks(ROOT / "docs" / page)
    for line, reason in skipped:
        assert re.fullmatch(r"\(.{8,}\)", reason), f"{page}:{line}: a skipped block must say why, in parentheses"
    if not run:
        pytest.skip(f"{page} has no python block to run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(run), capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=170)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    failed = [f"{page}:{line}:\n{error}" for line, error in reports if error]
    assert not failed, "\n".join(failed)
    assert len(reports) == len(run), f"{page}: only {len(reports)} of {len(run)} blocks reported\n{proc.stderr[-3000:]}"
