"""The command lines' parser: one-line errors, defaults shown in `--help`, checked numbers.

Shared by `poise` (`poise.cli`, `poise.commands`) and `python -m poise.train`, hence here, below
both in the layers.

`PoiseParser` reports a bad flag as one line on stderr naming the option, with exit status 2 (as
a `PoiseError` is reported), instead of argparse's usage block. Its help formatter appends the
default of every option whose help does not already state it. `int_in` and `float_in` are
argparse `type=` functions that check a range and say what is allowed.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

MAX_INT = 2**62  # beyond this an integer option is nonsense (and overflows int64 arithmetic)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or "%(default)" in text:
            return text
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            return text
        if isinstance(action, argparse._VersionAction | argparse._HelpAction):
            return text
        default = action.default
        if default is None:
            shown = "none"
        elif isinstance(default, list):
            shown = "none" if not default else ", ".join(map(str, default))
        else:
            shown = str(default)
        return f"{text} (default: {shown})".strip()


class PoiseParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line on stderr and exit status 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        sys.stderr.write(f"poise: error: {text} (see {self.prog} --help)\n")
        raise SystemExit(2)


def int_in(lo: int | None = None, hi: int | None = None) -> argparse._ActionType:
    """An argparse type: an integer in `[lo, hi]` (`hi` defaults to `MAX_INT`)."""
    top = MAX_INT if hi is None else hi
    allowed = f"an integer {_range(lo, hi)}".strip()

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if (lo is not None and value < lo) or value > top:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(lo: float | None = None, hi: float | None = None) -> argparse._ActionType:
    """An argparse type: a finite number in `[lo, hi]`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (
            not math.isfinite(value)
            or (lo is not None and value < lo)
            or (hi is not None and value > hi)
        ):
            raise argparse.ArgumentTypeError(f"must be a number {_range(lo, hi)}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return ""
