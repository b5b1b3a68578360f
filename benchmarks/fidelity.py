"""Fidelity: every published figure the scenarios reproduce, beside Poise's, one JSON line each.

Runs every scenario of `poise scenarios` (`--quick`: their reduced forms) and prints, per
published row, `scenario`, `paper`, `comparison`, `cases`, `source` (table / figure), `published`,
`poise`, `ratio` (poise / published), `direction_ok`, `within` (a factor 1.5) and `explained`
(the modelling reason recorded in `poise.sim.scenarios.fidelity.EXPLANATIONS` for a row outside
the factor or pointing the other way, or null); then one summary line:
`{"summary": true, "rows": N, "within_1_5": n, "median_abs_log2_ratio": x, "wrong_direction": k,
"wrong_direction_unexplained": k2}`.

`--write-doc docs/scenarios.md` replaces the parts of that file between the markers
`<!-- fidelity:start -->` and `<!-- fidelity:end -->` (the row-by-row table) and
`<!-- results:start -->` and `<!-- results:end -->` (what `poise scenarios` prints: the
comparison table, `auto` against every other policy per run, the setups) with those of this
run, so that both come from one run of one model.

Run from the repository root: .venv/bin/python benchmarks/fidelity.py [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from poise.sim.scenarios import SCENARIOS, get_scenario, run_scenario
from poise.sim.scenarios.fidelity import fidelity_rows, markdown, summarise
from poise.sim.scenarios.report import markdown_table
from poise.util.atomic import atomic_write_text

FIDELITY = ("<!-- fidelity:start -->", "<!-- fidelity:end -->")
RESULTS = ("<!-- results:start -->", "<!-- results:end -->")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the scenarios' reduced forms")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"known: {', '.join(SCENARIOS)}")
    p.add_argument("--data", default=None, help="folder with smartmoe-ae-sample/")
    p.add_argument("--write-doc", metavar="PATH", help="regenerate the marked part of this file")
    return p.parse_args(argv)


def replaced(text: str, markers: tuple[str, str], body: str, path: Path) -> str:
    """`text` with the part between `markers` replaced by `body`."""
    start, end = markers
    if start not in text or end not in text:
        sys.exit(f"fidelity: {path} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def write_doc(path: Path, fidelity_table: str, results_text: str) -> None:
    """Replace the marked fidelity and results parts of `path` (one atomic write)."""
    text = replaced(path.read_text(), FIDELITY, fidelity_table, path)
    atomic_write_text(path, replaced(text, RESULTS, results_text, path))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.only or list(SCENARIOS)
    results = [run_scenario(get_scenario(n), quick=args.quick, data=args.data) for n in names]
    rows = fidelity_rows(results)
    for row in rows:
        print(json.dumps({"bench": "fidelity", **row.as_dict()}), flush=True)
    summary = summarise(rows)
    print(json.dumps({**summary, "quick": args.quick}), flush=True)
    if args.write_doc:
        write_doc(Path(args.write_doc), markdown(rows, summary), markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
