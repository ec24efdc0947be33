"""The guides (docs/guides/*.md) run top to bottom, and every torchrun script of every docs page
runs under torchrun.

A guide's blocks run as test_docs_snippets.py runs a reference page's (tests/docs/_snippets.py),
most of them as one program (``<!-- snippet: continue -->``). Each torchrun script
(``<!-- snippet: torchrun N -->``) of any page is launched as the page says, by
``torchrun --standalone --nproc_per_node=N`` (gloo on the host): the script is the thing tested,
so it gets torchrun's processes and environment and makes its own process group, as a reader's
launch does. The scripts of the same N share one launch, one after another, each with a store of
its own and nothing of the script before it left in the process (tests/docs/_torchrun.py says
why that is safe); a failing one fails its own test, naming its page and line.
"""

from __future__ import annotations

import pytest

from tests.docs._snippets import DOCS, blocks, pages
from tests.docs._torchrun import run_scripts

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
def test_guide_runs_top_to_bottom(page, tmp_path, page_runner):
    failed, missing = page_runner.run(DOCS / "guides" / page, tmp_path)
    assert not failed, "\n".join(failed)
    assert not missing, missing


def _scripts() -> list[tuple[str, str, int]]:
    """``(page:line, source, processes)`` of every torchrun script of every page."""
    out = []
    for page in pages(DOCS, recursive=True):
        launched = []
        blocks(page, launched)
        where = page.relative_to(DOCS).as_posix()
        out += [(f"{where}:{line}", source, nproc) for line, source, nproc in launched]
    return out


SCRIPTS = _scripts()


@pytest.fixture(scope="module")
def torchrun_outcomes(tmp_path_factory):
    """Every script's outcome, from launches shared by the scripts (tests/docs/_torchrun.py)."""
    return run_scripts(SCRIPTS, tmp_path_factory.mktemp("torchrun"))


@pytest.mark.parametrize("where", [where for where, _, _ in SCRIPTS])
def test_torchrun_script_runs(where, torchrun_outcomes):
    """A page's torchrun script, launched as the page says: N processes, gloo, one host; it must
    exit 0 on every rank."""
    assert torchrun_outcomes[where] is None, torchrun_outcomes[where]
