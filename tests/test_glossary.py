"""The glossary's worked example runs as written (`poise.core.glossary`)."""

from __future__ import annotations

import doctest

from poise.core import glossary


def test_glossary_worked_example() -> None:
    result = doctest.testmod(glossary, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8
    assert result.failed == 0
