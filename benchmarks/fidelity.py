"""Fidelity: every published figure the scenarios reproduce, beside Poise's, one JSON line each.

Runs every scenario of `poise scenarios` (`--quick`: their reduced forms) and prints, per
published row, `scenario`, `paper`, `comparison`, `cases`, `source`, `published`, `poise`, `ratio`
(poise / the published figure or its range's nearest end), `within` (a factor 1.5),
`direction_ok` (the same side of 1.0), `matches` (both), `setup` ("paper" or "assumed", with
`assumed`: what) and `reason` (recorded in `poise.sim.scenarios.fidelity.REASONS` for that row,
where it does not match); then one summary line, the rows on the paper's set-ups apart from the
assumed ones: `{"summary": true, "paper": {"rows", "match", "match_share",
"median_abs_log2_ratio", "wrong_direction", "unexplained"}, "assumed": {...}, "stale_reasons":
[...]}` (reasons recorded for rows that now match).

`--write-doc docs/scenarios.md` replaces the parts of that file between the markers
`<!-- fidelity:start -->` and `<!-- fidelity:end -->` (the row-by-row table) and
`<!-- results:start -->` and `<!-- results:end -->` (what `poise scenarios` prints: the
comparison table, `auto` against every other policy per run, the setups) with those of this
run, so that both come from one run of one model.

`--zipf-s S`: the generated traces' Zipf skew (default 1, `DRIFT`), for a sweep of the rows built
on generated traces (`with_zipf_s`); the summary line names it.

`--seed-shift K`: every generated trace's seed moved by K (default 0: the scenarios' own seeds;
`with_seed_shift`), for a seed sweep: whether the rows, and `auto` being the fastest policy, hold
on other draws of the generated traces; recorded routing is replayed as it is. The summary line
names it (`"seed_shift"`). `--write-doc` takes the default skew and seeds only.

The last line sums up `auto` against the fastest other policy over every run (one case under one
schedule) of every scenario, in the column the scenario's figures use (planning time charged when
it counts planning, else not: `Check.ratio`; `fidelity.auto_line`): `{"bench": "fidelity-auto",
"runs": N, "slower": M, "worst": {"scenario", "case", "run", "ratio", "best", "column",
"gap_in_se"}}`, M the runs where auto's mean step time is above the fastest other policy's,
`worst` the run with the highest ratio auto / fastest other (null without runs).

Run from the repository root: .venv/bin/python benchmarks/fidelity.py [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from poise.sim.scenarios import SCENARIOS, get_scenario, run_scenario
from poise.sim.scenarios.core import DRIFT, with_seed_shift, with_zipf_s
from poise.sim.scenarios.fidelity import (
    auto_line,
    fidelity_rows,
    markdown,
    stale_reasons,
    summarise,
)
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
    p.add_argument("--zipf-s", type=float, default=None, help="generated traces' Zipf skew")
    p.add_argument(
        "--seed-shift", type=int, default=0, metavar="K", help="added to generated traces' seeds"
    )
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
    if args.write_doc and args.zipf_s is not None:
        sys.exit("fidelity: --write-doc takes the default skew only")
    if args.seed_shift < 0:
        sys.exit("fidelity: --seed-shift must be >= 0")
    if args.write_doc and args.seed_shift != 0:
        sys.exit("fidelity: --write-doc takes the default seeds only")
    names = args.only or list(SCENARIOS)
    scenarios = [get_scenario(n) for n in names]
    if args.zipf_s is not None:
        scenarios = [with_zipf_s(s, args.zipf_s) for s in scenarios]
    if args.seed_shift != 0:
        scenarios = [with_seed_shift(s, args.seed_shift) for s in scenarios]
    results = [run_scenario(s, quick=args.quick, data=args.data) for s in scenarios]
    rows = fidelity_rows(results)
    for row in rows:
        print(json.dumps({"bench": "fidelity", **row.as_dict()}), flush=True)
    summary = summarise(rows)
    stale = [list(k) for k in stale_reasons(rows)]
    extra = {
        "stale_reasons": stale,
        "quick": args.quick,
        "zipf_s": args.zipf_s or DRIFT["s"],
        "seed_shift": args.seed_shift,
    }
    print(json.dumps({**summary, **extra}), flush=True)
    if args.write_doc:
        write_doc(Path(args.write_doc), markdown(rows, summary), markdown_table(results))
    print(json.dumps(auto_line(results)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
