"""`poise`: the command line. Each subcommand lives in `poise/commands/<name>.py` and provides
`add_parser(subparsers)` and `run(args) -> int`. Bad input (`PoiseError`) becomes one line on
stderr and exit status 2; no traceback."""

from __future__ import annotations

import importlib
import sys

from poise import __version__
from poise.core.errors import PoiseError
from poise.util.argparsing import PoiseParser
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
    try:
        return int(args.run(args) or 0)
    except PoiseError as exc:
        print(f"poise: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("poise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
