"""`poise`: the command line. Each subcommand lives in `poise/commands/<name>.py` and provides
`add_parser(subparsers)` and `run(args) -> int`. Bad input (`PoiseError`) becomes one line on
stderr and exit status 2; no traceback. A reader of the console output that closes early
(`poise simulate ... | head -1`) ends the output quietly: the commands write their files before
they print, and a broken pipe on stdout ends the command with status 0, no traceback."""

from __future__ import annotations

import errno
import importlib
import os
import sys

from poise import __version__
from poise.core.errors import PoiseError
from poise.util.argparsing import PoiseParser
from poise.util.atomic import NotReplacedError
from poise.util.heap import retain_freed_memory

COMMANDS = ("calibrate", "demo", "layouts", "plan", "scenarios", "simulate", "trace", "train")


def build_parser() -> PoiseParser:
    parser = PoiseParser(
        prog="poise",
        description="Expert-parallel MoE training that stays balanced under skewed, drifting load.",
    )
    parser.add_argument("--version", action="version", version=f"poise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"poise.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad flag (one line, status 2)
        return exc.code if isinstance(exc.code, int) else 2
    retain_freed_memory()  # planning's temporaries reuse the heap (`poise.util.heap`)
    _broken_pipes_raise()
    code = 0
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # inside: a pipe closed early breaks here, not at exit
        return code
    except (PoiseError, NotReplacedError) as exc:  # before OSError: NotReplacedError is one
        print(f"poise: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_closed(code)
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return _stdout_closed(code)
        raise
    except KeyboardInterrupt:
        print("poise: interrupted", file=sys.stderr)
        return 130


def _broken_pipes_raise() -> None:
    """Rich's consoles end the process with status 1 and no word when stdout's reader has
    gone (`Console.on_broken_pipe`, documented to be overridden): make them raise
    `BrokenPipeError` instead, which `main` ends quietly with the command's status."""
    from rich.console import Console

    def on_broken_pipe(self: Console) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "stdout's reader has gone")

    Console.on_broken_pipe = on_broken_pipe  # type: ignore[method-assign]


def _stdout_closed(code: int) -> int:
    """The reader of stdout went away: send what is left (and the flush at exit) to
    /dev/null, so that Python does not report the broken pipe, and end with the command's
    status, 0 when it broke off while printing (the commands write their files before they
    print)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (tests, embedding)
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
