"""One exception family for everything Poise refuses.

Every error a user can cause by bad input is a `PoiseError`. The CLI turns it into one line on
stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class PoiseError(Exception):
    """Base class. `source` names the file (or object) and `field` the offending entry."""

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = ": ".join(part for part in (self.source, self.field) if part)
        return f"{where}: {self.message}" if where else self.message


class ConfigError(PoiseError):
    """A cluster, model or run configuration that is malformed or impossible."""


class TraceError(PoiseError):
    """A routing trace that cannot be read or does not validate."""


class PlanError(PoiseError):
    """A placement, assignment or plan that breaks an invariant, or a policy that cannot plan."""
