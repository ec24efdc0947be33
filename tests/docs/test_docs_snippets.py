"""Every fenced ```python block of every docs/**/*.md page runs, on the pinned versions.

Each page runs in one subprocess (4 host CPU devices for JAX, as tests/conftest.py sets), its
blocks one after another, each in a fresh namespace; a block written as a doctest (``>>>``) is
run as one. A block preceded by ``<!-- snippet: torchrun N -->`` is a script for N processes: it
is saved to a file and launched with ``torchrun --standalone --nproc_per_node=N`` (gloo on the
host), and must exit 0. A block preceded by ``<!-- snippet: continue -->`` runs in the namespace the block
before it left (a guide that runs top to bottom, one program in several blocks). A block that
cannot run here is preceded by a marker that says why, e.g.
``<!-- snippet: skip (needs several processes: torchrun) -->``; a marker without a reason fails.
Pages added later, in docs/ or any folder under it (docs/guides/), are picked up by the glob.
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
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
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
    print(json.dumps([line, error]), flush=True)
"""


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


def test_pages_have_blocks():
    assert PAGES and sum(len(blocks(p)[0]) for p in PAGES) >= 8


@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in PAGES])
def test_page_blocks_run(page, tmp_path):
    run, skipped = blocks(DOCS / page)
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


def _torchrun_blocks():
    out = []
    for p in PAGES:
        launched = []
        blocks(p, launched)
        out += [pytest.param(p, line, source, n, id=f"{p.relative_to(DOCS).as_posix()}:{line}")
                for line, source, n in launched]
    return out


@pytest.mark.parametrize("page,line,source,nproc", _torchrun_blocks())
def test_torchrun_blocks_run(page, line, source, nproc, tmp_path):
    """A page's torchrun script, launched as the page says: N processes, gloo, one host."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=170)
    assert proc.returncode == 0, f"{page.name}:{line}: torchrun exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MENTION = re.compile(r"\bdocs/[\w./-]+\.md\b")


def slugs(page: pathlib.Path) -> set[str]:
    """The anchors a page's headings get (GitHub's rule: lower case, punctuation dropped, spaces to
    hyphens), outside code fences."""
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in PAGES] + ["../README.md"])
def test_links_resolve(page):
    """Every relative link of a page (and of the README) names a file that exists, and a heading of
    it where it names one; every ``docs/NAME.md`` a page mentions exists (a split page must not
    leave a reader at a name that is gone)."""
    path = (DOCS / page).resolve()
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M))  # prose only
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"{target}: no heading with that anchor")
    broken += [f"{name}: no such file" for name in MENTION.findall(path.read_text()) if not (ROOT / name).exists()]
    assert not broken, f"{page}: " + "; ".join(broken)
