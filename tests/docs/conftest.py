"""The docs tests' shared interpreter for pages (tests/docs/_snippets.py's PageRunner)."""

import pytest

from tests.docs._snippets import PageRunner


@pytest.fixture(scope="module")
def page_runner():
    """One interpreter runs every page of a test module, page after page, each from a clean start."""
    runner = PageRunner()
    yield runner
    runner.close()
