"""Every fenced ```python block of every reference page (docs/*.md) runs, on the pinned versions,
and every link between the pages resolves.

How blocks run, and the markers that change it (continue, torchrun N, skip with a reason):
tests/docs/_snippets.py. The guides (docs/guides/) and every page's torchrun scripts run in
test_docs_guides.py, so that two test workers share the docs. Pages added later are picked up by
the globs.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.docs._snippets import DOCS, ROOT, blocks, pages

REFERENCE = pages(DOCS)
ALL_PAGES = pages(DOCS, recursive=True)


def test_pages_have_blocks():
    assert REFERENCE and sum(len(blocks(p)[0]) for p in ALL_PAGES) >= 8


@pytest.mark.parametrize("page", [p.name for p in REFERENCE])
def test_page_blocks_run(page, tmp_path, page_runner):
    run, skipped = blocks(DOCS / page)
    for line, reason in skipped:
        assert re.fullmatch(r"\(.{8,}\)", reason), f"{page}:{line}: a skipped block must say why, in parentheses"
    if not run:
        pytest.skip(f"{page} has no python block to run")
    failed, missing = page_runner.run(DOCS / page, tmp_path)
    assert not failed, "\n".join(failed)
    assert not missing, missing


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MENTION = re.compile(r"\bdocs/[\w./-]+\.md\b")
SECTION = re.compile(r'\b(docs/[\w./-]+\.md), "([^"]+)"')   # docs/jax.md, "The first mistake"


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


def leads(page: pathlib.Path) -> list[str]:
    """The titles a reader can find a section of a page by: its headings, and the bold leads of its
    paragraphs and list items (``- **State in files: ...**``), outside code fences."""
    out, fence = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (line.startswith("#") or re.match(r"\s*(?:- )?\*\*", line)):
            out.append(re.sub(r"^\s*(?:#+|- )?\s*(?:\*\*)?", "", line))
    return out


def broken_mentions(text: str) -> list[str]:
    """Every ``docs/NAME.md`` a text names exists, and every section it names by title there
    (``docs/NAME.md, "Title"``) is a heading or bold lead of that page starting with the title."""
    text = " ".join(text.replace("``", "`").split())
    broken = [f"{name}: no such file" for name in MENTION.findall(text) if not (ROOT / name).exists()]
    for name, title in SECTION.findall(text):
        if (ROOT / name).exists() and not any(lead.startswith(title) for lead in leads(ROOT / name)):
            broken.append(f'{name}, "{title}": no such heading')
    return broken


@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in ALL_PAGES] + ["../README.md"])
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
    broken += broken_mentions(path.read_text())
    assert not broken, f"{page}: " + "; ".join(broken)


def test_code_names_pages_that_exist():
    """The pages and sections hybrid's docstrings, messages and the CHANGELOG send a reader to exist
    (a split or renamed page must not leave ``docs/NAME.md, "Title"`` pointing at nothing)."""
    sources = sorted((ROOT / "hybrid").rglob("*.py")) + [ROOT / "CHANGELOG.md"]
    broken = [f"{src.relative_to(ROOT)}: {b}" for src in sources for b in broken_mentions(src.read_text())]
    assert not broken, "; ".join(broken)


@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in ALL_PAGES] + ["../README.md"])
def test_pages_speak_to_readers(page):
    """No issue numbers a reader cannot look up (``(issue 35)``; an upstream project's issue, named
    with its repository, is fine), and no reference page past about 400 lines (450 allowed before
    it must be split along its seams; the dated runs too, in docs/benchmarks/)."""
    text = (DOCS / page).read_text()
    internal = [m.group(0) for m in re.finditer(r"(?<![\w/])(?:[Ii]ssue)s? \d+(?:\.\d+)?", text)
                if not re.search(r"[\w-]+/[\w-]+ $", text[max(0, m.start() - 40):m.start()])]
    assert not internal, f"{page}: issue numbers in user docs: {internal}"
    lines = text.count("\n")
    assert page == "../README.md" or lines <= 450, \
        f"{page} has {lines} lines: split it along its seams (docs/index.md lists the pages)"
