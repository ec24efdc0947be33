"""The guides (docs/guides/*.md) run top to bottom, and every torchrun script of every docs page
runs under torchrun.

A guide's blocks run as test_docs_snippets.py runs a reference page's (tests/docs/_snippets.py),
most of them as one program (``<!-- snippet: continue -->``). Each torchrun script
(``<!-- snippet: torchrun N -->``) of any page is launched as the page says, by
``torchrun --standalone --nproc_per_node=N`` (gloo on the host): the script is the thing tested,
so it gets the processes a reader's launch gives it, not a shared world.
"""

from __future__ import annotations

import pytest

from tests.docs._snippets import DOCS, blocks, pages, run_page, run_torchrun

GUIDES = pages(DOCS / "guides")


def test_every_reader_has_a_guide():
    """docs/index.md's six ways in each have a guide page, and each guide runs something."""
    assert len(GUIDES) >= 6
    index = (DOCS / "index.md").read_text()
    for guide in GUIDES:
        assert f"guides/{guide.name}" in index, f"docs/index.md does not send anyone to {guide.name}"
        run, _ = blocks(guide)
        launched = []
        blocks(guide, launched)
        assert run or launched, f"{guide.name} runs no block"


@pytest.mark.parametrize("page", [p.name for p in GUIDES])
def test_guide_runs_top_to_bottom(page, tmp_path):
    failed, missing = run_page(DOCS / "guides" / page, tmp_path)
    assert not failed, "\n".join(failed)
    assert not missing, missing


def _scripts():
    out = []
    for page in pages(DOCS, recursive=True):
        launched = []
        blocks(page, launched)
        where = page.relative_to(DOCS).as_posix()
        out += [pytest.param(source, nproc, id=f"{where}:{line}") for line, source, nproc in launched]
    return out


@pytest.mark.parametrize("source,nproc", _scripts())
def test_torchrun_script_runs(source, nproc, tmp_path):
    """A page's torchrun script, launched as the page says: N processes, gloo, one host."""
    proc = run_torchrun(source, nproc, tmp_path)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
