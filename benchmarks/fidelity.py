"""Fidelity: every published figure the scenarios reproduce, beside Poise's, one JSON line each.

Runs every scenario of `poise scenarios` (`--quick`: their reduced forms) and prints, per
published row, `scenario`, `paper`, `comparison`, `cases`, `source` (table / figure), `published`,
`poise`, `ratio` (poise / published), `direction_ok`, `within` (a factor 1.5) and `explained`
(the modelling reason recorded in `poise.sim.scenarios.fidelity.EXPLANATIONS` for a row outside
the factor or pointing the other way, or null); then one summary line:
`{"summary": true, "rows": N, "within_1_5": n, "median_abs_log2_ratio": x, "wrong_direction": k,
"wrong_direction_unexplained": k2}`.

`--write-doc docs/scenarios.md` replaces the part of that file between the markers
`<!-- fidelity:start -->` and `<!-- fidelity:end -->` with the table generated from this run.

Run from the repository root: .venv/bin/python benchmarks/fidelity.py [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from poise.sim.scenarios import SCENARIOS, get_scenario, run_scenario
from poise.sim.scenarios.fidelity import fidelity_rows, markdown, summarise
from poise.util.atomic import atomic_write_text

START, END = "<!-- fidelity:start -->", "<!-- fidelity:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the scenarios' reduced forms")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"known: {', '.join(SCENARIOS)}")
    p.add_argument("--data", default=None, help="folder with smartmoe-ae-sample/")
    p.add_argument("--write-doc", metavar="PATH", help="regenerate the marked part of this file")
    return p.parse_args(argv)


def write_doc(path: Path, table: str) -> None:
    """Replace the text between the fidelity markers of `path` with `table`."""
    text = path.read_text()
    if START not in text or END not in text:
        sys.exit(f"fidelity: {path} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_text(path, f"{head}{START}\n{table}\n{END}{tail}")


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
        write_doc(Path(args.write_doc), markdown(rows, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
