"""One exception family for everything Poise refuses.

Every error a user can cause by bad input is a `PoiseError`. The CLI turns it into one line on
stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

MAX_MESSAGE_CHARS = 400  # a message quoting a bad value is cut here: one readable line


class PoiseError(Exception):
    """Base class. `source` names the file (or object) and `field` the offending entry."""

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """`source: field: message` on one line: line breaks inside the message (a quoted
        multi-line value) become spaces, and a message longer than `MAX_MESSAGE_CHARS` is cut
        with an ellipsis."""
        message = _cut(" ".join(self.message.split()))
        where = ": ".join(_printable(part) for part in (self.source, self.field) if part)
        return f"{where}: {message}" if where else message


def _cut(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _printable(name: str) -> str:
    """A file or field name as written, or quoted (`repr`) when it holds a line break or another
    unprintable character (a YAML key of "\\n" must not break the line)."""
    return _cut(name if name.isprintable() else repr(name))


class ConfigError(PoiseError):
    """A cluster, model or run configuration that is malformed or impossible."""


class TraceError(PoiseError):
    """A routing trace that cannot be read or does not validate."""


class PlanError(PoiseError):
    """A placement, assignment or plan that breaks an invariant, or a policy that cannot plan."""
