"""The face stays a reference: the README is a first page, docs/benchmarks.md a list of current
figures, and the source says what and why rather than which run on which date."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README_MAX_LINES = 250
BENCHMARKS_MAX_LINES = 700
PARAGRAPH_MAX_LINES = 10
SNIPPET_BY_LINE = 80  # the library snippet (`The layer in your model`) starts before it
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def paragraphs(text: str) -> list[list[str]]:
    """Runs of prose lines: code blocks, tables, headings and list items left out (a list item
    and its continuation lines count as one paragraph)."""
    out: list[list[str]] = []
    current: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            current = _close(out, current)
            continue
        blank = not line.strip()
        if fenced or blank or line.startswith(("#", "|")):
            current = _close(out, current)
            continue
        if line.lstrip().startswith(("- ", "* ")) or re.match(r"\s*\d+\. ", line):
            current = _close(out, current)
        current.append(line)
    _close(out, current)
    return out


def _close(out: list[list[str]], current: list[str]) -> list[str]:
    if current:
        out.append(current)
    return []


def test_the_readme_is_a_first_page() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    long = [p[0][:60] for p in paragraphs(text) if len(p) > PARAGRAPH_MAX_LINES]
    assert not long, long
    snippet = next(i for i, line in enumerate(lines) if line.startswith("## The layer in your"))
    assert snippet < SNIPPET_BY_LINE, snippet
    assert lines[2].strip() and "make demo" in text[:2000] and "make test" in text[:2000]


def test_the_benchmarks_page_is_a_reference() -> None:
    lines = BENCHMARKS.read_text().splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, len(lines)


def test_the_source_cites_no_dated_run() -> None:
    """No date in any docstring or comment of `src/`: a figure and its date go in
    docs/benchmarks.md, the source says what and why."""
    dated = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "src").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DATE.search(line)
    ]
    assert not dated, dated


def test_the_paragraph_reader_counts_prose_only() -> None:
    """The reference for the bounds above: a heading, a code block and a table are no prose;
    a list item starts a paragraph of its own."""
    text = "# T\n\na\nb\n\n```\nx\ny\n```\n| t |\n- one\n  two\n- three\n"
    assert paragraphs(text) == [["a", "b"], ["- one", "  two"], ["- three"]]
