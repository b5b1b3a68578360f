"""The HTML report of `poise demo`: measured training runs beside their simulated replays.
Run folders are read by `poise.report.runs`, tables built by `poise.report.tables`.

    runs = {p: MeasuredRun.load(f"poise-out/train-{p}") for p in ("static", "auto")}
    page = write_demo_report(DemoData(runs=runs, sims=[...], replays=[...]), "poise-out")

`MeasuredRun.load` reads what `poise train` writes into its folder (`config.yaml`,
`metrics.jsonl`, `summary.json`, `trace.npz`). `write_demo_report` draws the plots as PNG files
next to `report.html` and writes the page atomically: loss curves and their largest difference,
measured step time and tokens/s per policy, measured time by phase, device-load heatmaps over
time, and per simulated cluster the time breakdown per policy and the table. `HtmlPage` is the
small page builder underneath (escaped text, tables, figures, one inline style sheet).
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poise.report.runs import MeasuredRun, agreement_sentence, loss_agreement
from poise.report.tables import (
    MEASURED_COLUMNS,
    REPLAY_COLUMNS,
    SIM_COLUMNS,
    breakdown_table,
    measured_rows,
    replay_rows,
    sim_rows,
)
from poise.util.atomic import atomic_write_text

if TYPE_CHECKING:
    from poise.report.figure_workers import FigureWorkers

# ------------------------------------------------------------------------------- page builder
_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto;
       max-width: 70em; padding: 0 1.2em; color: #1d1d1f; line-height: 1.45; }
h1 { font-size: 1.7em; margin-bottom: 0.2em; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { border: 1px solid #d0d0d0; padding: 0.25em 0.7em; }
th { background: #f2f2f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
caption { text-align: left; font-weight: 600; padding-bottom: 0.3em; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #e0e0e0; }
figcaption { font-size: 0.9em; color: #555; }
.note { color: #555; font-size: 0.92em; }
.ok { color: #176317; font-weight: 600; }
.bad { color: #a31515; font-weight: 600; }
code { background: #f4f4f6; padding: 0 0.2em; }
"""


class HtmlPage:
    """A self-contained HTML page built from escaped parts."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []

    def heading(self, text: str, level: int = 2, anchor: str | None = None) -> None:
        ident = f' id="{html.escape(anchor)}"' if anchor else ""
        self.parts.append(f"<h{level}{ident}>{html.escape(text)}</h{level}>")

    def paragraph(self, text: str, cls: str | None = None) -> None:
        """`text` is escaped; `code` spans in backticks become `<code>`."""
        escaped = html.escape(text)
        pieces = escaped.split("`")
        body = "".join(p if i % 2 == 0 else f"<code>{p}</code>" for i, p in enumerate(pieces))
        klass = f' class="{cls}"' if cls else ""
        self.parts.append(f"<p{klass}>{body}</p>")

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        caption: str | None = None,
        numeric_from: int = 1,
    ) -> None:
        """Columns from index `numeric_from` on are right-aligned."""
        out = ["<table>"]
        if caption:
            out.append(f"<caption>{html.escape(caption)}</caption>")
        out.append("<tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in columns) + "</tr>")
        for row in rows:
            cells = []
            for i, v in enumerate(row):
                cls = ' class="num"' if i >= numeric_from else ""
                cells.append(f"<td{cls}>{html.escape(str(v))}</td>")
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</table>")
        self.parts.append("\n".join(out))

    def figure(self, src: str, caption: str) -> None:
        self.parts.append(
            f'<figure><img src="{html.escape(src)}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )

    def render(self) -> str:
        body = "\n".join(self.parts)
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(self.title)}</title>\n<style>{_CSS}</style>\n</head>\n"
            f"<body>\n<h1>{html.escape(self.title)}</h1>\n{body}\n</body>\n</html>\n"
        )

    def write(self, path: str | Path) -> None:
        atomic_write_text(path, self.render())


# ------------------------------------------------------------------------------- demo report
@dataclass
class SimSection:
    """One simulated replay for the report: `key` names its files, `seconds` its wall time."""

    key: str
    title: str
    result: Any  # poise.sim.simulator.SimResult
    seconds: float
    note: str = ""


@dataclass
class ReplaySection:
    """A trace replayed through every policy (`runs[policy]`: `poise.sim.simulator.PolicyRun`)."""

    key: str
    title: str
    runs: dict[str, Any]
    note: str = ""


@dataclass
class MeasuredSummary:
    """The measured part in one line: static and auto tokens/s over the steps after the
    warm-up, their ratio, the ideal (`poise.report.ideal`) and the verdict of
    `poise.report.ideal.judge`; `text`: what it means, in short paragraphs; `lines`: the
    console's summary (at most 3); `gain_accounting`: where the ideal's gain went, step by step
    (`poise.report.gain_accounting`), None where not reckoned."""

    static_tok_s: float
    auto_tok_s: float
    speedup: float
    ideal_speedup: float
    verdict: dict[str, Any]
    measured_steps: int
    expert_us_per_token: float
    text: str = ""
    gain_accounting: dict[str, Any] | None = None
    lines: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "static_tok_s": round(self.static_tok_s, 1),
            "auto_tok_s": round(self.auto_tok_s, 1),
            "speedup": round(self.speedup, 4),
            "ideal_speedup": round(self.ideal_speedup, 4),
            "gain_fraction": self.verdict.get("gain_fraction"),
            "target_met": self.verdict.get("target_met"),
            "judged_gain": self.verdict.get("judged_gain"),
            "rule": self.verdict.get("rule"),
            "measured_steps": self.measured_steps,
            "expert_us_per_token": round(self.expert_us_per_token, 3),
            "gain_accounting": self.gain_accounting,
        }


@dataclass
class DemoData:
    """Everything the demo's page shows. `settings`: label -> value lines for the first table;
    `notes`: extra paragraphs under it; `summary`: static, auto and the ideal in one table;
    `sim_intro`: paragraphs before the simulated tables; `wall_s`: what took how long."""

    runs: dict[str, MeasuredRun]
    sims: list[SimSection] = field(default_factory=list)
    replays: list[ReplaySection] = field(default_factory=list)
    settings: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    wall_s: dict[str, float] = field(default_factory=dict)
    summary: MeasuredSummary | None = None
    sim_intro: list[str] = field(default_factory=list)
    replay_intro: str = ""


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


LOSS_PNG = "demo-loss.png"
SPEED_PNG = "demo-speed.png"
PHASES_PNG = "demo-phases.png"
LOAD_PNG = "demo-load.png"


def _measured_loads(runs: dict[str, MeasuredRun]) -> dict[str, Any]:
    """`[S, L, D]` tokens each rank computed, per run that recorded them."""
    return {n: r.device_tokens for n, r in runs.items() if r.device_tokens.ndim == 3}


def draw_measured_figures(
    runs: dict[str, MeasuredRun], out: str | Path, figures: FigureWorkers
) -> None:
    """Set the measured runs' figures drawing into `out` (`LOSS_PNG`, `SPEED_PNG`,
    `PHASES_PNG`, `LOAD_PNG`): what `write_demo_report` shows of `runs`, so that a caller
    with workers can start them before the rest of its data is ready."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(runs)
    figures.draw(
        "loss_curves_plot",
        out / LOSS_PNG,
        {n: (r.steps, r.losses) for n, r in runs.items()},
        title="training loss, " + " vs ".join(names),
    )
    figures.draw(
        "train_speed_plot",
        out / SPEED_PNG,
        {n: r.step_s for n, r in runs.items()},
        {n: r.tokens_per_s for n, r in runs.items()},
        title="measured training speed",
    )
    figures.draw(
        "breakdown_plot",
        out / PHASES_PNG,
        {n: r.phase_means() for n, r in runs.items()},
        title="measured time by phase (rank 0, mean per step)",
        step_s={n: float(r.step_s[r.warm()].mean()) for n, r in runs.items()},
    )
    loads = _measured_loads(runs)
    if loads:
        figures.draw(
            "layer_load_heatmaps",
            out / LOAD_PNG,
            loads,
            title="tokens each rank computed, per layer and step",
        )


def write_demo_report(
    data: DemoData, out: str | Path, figures: FigureWorkers | None = None
) -> Path:
    """Draw the plots (PNG files in `out`; with `figures`' workers, beside this page's writing)
    and write `out/report.html` atomically once they are all drawn; returns its path."""
    from poise.report.figure_workers import FigureWorkers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = figures if figures is not None else FigureWorkers(0)
    draw = figures.draw
    runs = data.runs
    draw_measured_figures(runs, out, figures)  # nothing where the caller set them drawing
    names = list(runs)
    page = HtmlPage("Poise demo: static against balanced expert parallelism")
    page.paragraph(
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}. Two training runs of the same model "
        "from the same seed on the same data, one with the static expert-parallel placement and "
        "one balanced live by Poise; their recorded routing traces replayed in the simulator on "
        "large modelled clusters."
    )
    if data.settings:
        page.table(("setting", "value"), list(data.settings.items()), numeric_from=99)
    for note in data.notes:
        page.paragraph(note, cls="note")

    # Loss curves.
    page.heading("Loss curves", anchor="loss")
    page.figure(LOSS_PNG, "Training loss per step; below, the absolute difference between runs.")
    if len(names) >= 2:
        ag = loss_agreement(runs[names[0]], runs[names[1]])
        verdict = "ok" if ag.agrees else "bad" if ag.judged else None
        page.paragraph(agreement_sentence(ag, names[0], names[1]), cls=verdict)
        page.paragraph(f"Maximum loss difference: {ag.max_diff:.3e} over {ag.steps} steps.")

    # Speed.
    page.heading("Measured step time and tokens/s", anchor="speed")
    if data.summary is not None:
        m = data.summary
        gain = m.verdict.get("gain_fraction")
        page.table(
            ("static tok/s", "auto tok/s", "auto / static", "ideal", "share of the gain"),
            [
                (
                    f"{m.static_tok_s:,.0f}",
                    f"{m.auto_tok_s:,.0f}",
                    f"{m.speedup:.3f}x",
                    f"{m.ideal_speedup:.3f}x",
                    "" if gain is None else f"{gain:.2f}",
                )
            ],
            caption=f"measured, the {m.measured_steps} steps after the warm-up",
        )
        for text in m.text.split("\n\n") if m.text else []:
            page.paragraph(text)
        account = m.gain_accounting
        if account is not None and account.get("achieved") is not None:
            from poise.report.gain_accounting import accounting_rows

            page.table(
                ("where the ideal's gain went", "share", "steps"), accounting_rows(account),
                caption=f"of the ideal's {account['ideal_gain_ms']:.0f} ms a step",
            )  # fmt: skip
    page.table(MEASURED_COLUMNS, measured_rows(runs), caption="measured on this machine")
    page.figure(SPEED_PNG, "Step time per step (left) and median tokens/s (right) per policy.")
    page.figure(PHASES_PNG, "Where a measured step's time goes, by phase of the training loop.")
    moe_rows = []
    for n, r in runs.items():
        moe_rows.append(
            [
                n,
                *(
                    f"{r.moe_phase_mean(k) * 1e3:.1f}"
                    for k in ("gate", "dispatch", "experts", "combine", "transfers", "plan")
                ),
            ]
        )
    page.table(
        ("policy", "gate", "dispatch", "experts", "combine", "transfers", "plan"),
        moe_rows,
        caption="inside the MoE layers and the balancer, rank 0, ms per step "
        "(gate, dispatch, experts, combine: forward pass only)",
    )

    # Heatmaps.
    if _measured_loads(runs):
        page.heading("Device load over time (measured)", anchor="load")
        page.figure(
            LOAD_PNG,
            "Each rank's expert load per MoE layer and step, as a ratio to the layer's mean "
            "(1.0 is balanced); the slowest rank sets each layer's time.",
        )

    # Simulated clusters.
    if data.sims:
        page.heading("Simulated clusters", anchor="sim")
    for text in data.sim_intro:
        page.paragraph(text)
    for sec in data.sims:
        res = sec.result
        page.heading(sec.title, level=3)
        page.paragraph(
            f"{res.cluster.num_devices:,} devices, model {res.spec.name} "
            f"({res.spec.experts} experts top-{res.spec.top_k}, {res.spec.moe_layers} MoE "
            f"layers), {res.steps} steps, schedule {res.schedule.name}, re-plan every "
            f"{res.replan_every}, predictor {res.predictor.name}; {res.scaling}. "
            f"Simulated in {sec.seconds:.1f} s."
        )
        if sec.note:
            page.paragraph(sec.note, cls="note")
        page.table(SIM_COLUMNS, sim_rows(res), caption=f"{sec.title}: mean over steps")
        columns, rows = breakdown_table(res)
        page.table(columns, rows, caption=f"{sec.title}: step time by phase, ms per step (mean)")
        order = [row["policy"] for row in res.summary_rows()]
        png = f"demo-sim-{_slug(sec.key)}.png"
        draw(
            "breakdown_plot",
            out / png,
            {k: res.runs[k].phase_totals() for k in order},
            title=f"{sec.title}: time by phase",
            step_s={k: res.runs[k].mean_step_s for k in order},
        )
        page.figure(
            png,
            f"Simulated seconds of work per step by phase on {res.cluster.name} "
            "(the mark is the step time under the schedule).",
        )

    # Trace replays.
    if data.replays:
        page.heading("Trace replays", anchor="replay")
        if data.replay_intro:
            page.paragraph(data.replay_intro)
    for rep in data.replays:
        page.heading(rep.title, level=3)
        if rep.note:
            page.paragraph(rep.note, cls="note")
        page.table(REPLAY_COLUMNS, replay_rows(rep.runs))
        shown = {k: rep.runs[k].device_load for k in ("static", "auto") if k in rep.runs}
        if shown:
            png = f"demo-replay-{_slug(rep.key)}.png"
            draw(
                "device_load_heatmaps",
                out / png,
                shown,
                title=f"{rep.title}: device load per step",
            )
            page.figure(png, "Modelled device load per step (all layers summed), static and auto.")

    if data.wall_s:
        page.heading("Wall time", anchor="time")
        page.table(("part", "seconds"), [(k, f"{v:.1f}") for k, v in data.wall_s.items()])
    files = [f"{n}: {r.path}" for n, r in runs.items()]
    page.paragraph(
        "Run folders (config.yaml, metrics.jsonl, trace.npz, summary.json): " + "; ".join(files),
        cls="note",
    )
    figures.wait()
    path = out / "report.html"
    page.write(path)
    return path


__all__ = [
    "DemoData",
    "HtmlPage",
    "MeasuredSummary",
    "ReplaySection",
    "SimSection",
    "draw_measured_figures",
    "write_demo_report",
]
