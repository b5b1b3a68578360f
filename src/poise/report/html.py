"""The HTML report of `poise demo`: measured training runs beside their simulated replays.

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
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from poise.core.errors import ConfigError
from poise.util.atomic import atomic_write_text

# Two runs of the same seed that differ only in float summation order give the same loss to
# rounding at first (the training tests hold static and auto to 1e-5 per step over 30 steps);
# later, rounding differences grow through training (and can flip near-tied router choices), as
# between any two runs that sum in a different order.
LOSS_AGREEMENT_TOL = 1e-5
EARLY_STEPS = 30


# ------------------------------------------------------------------------------ measured runs
@dataclass
class MeasuredRun:
    """One `poise train` output folder. Arrays are per logged step `[S]` unless noted.

    `device_tokens[S, L, D]`: token-expert pairs each rank computed per MoE layer (under the plan
    in force); `phases[name][S]`: rank 0's seconds per step phase (data, forward, backward,
    grad_sync, balance, clip, optimizer); `moe_phases[name][S]`: rank 0's seconds inside the MoE
    layers and the balancer (gate, dispatch, experts, combine: forward only; transfers, plan);
    `bytes_moved[S]`: Trans + Agg + migration bytes (all ranks) at each step boundary."""

    policy: str
    path: Path
    steps: np.ndarray
    losses: np.ndarray
    step_s: np.ndarray
    tokens_per_step: int
    tokens_per_s: float
    device_tokens: np.ndarray
    phases: dict[str, np.ndarray]
    moe_phases: dict[str, np.ndarray]
    bytes_moved: np.ndarray
    plan_changes: int
    val: list[tuple[int, float]]
    config: dict[str, Any]
    world_size: int
    trace_path: Path | None

    @classmethod
    def load(cls, path: str | Path) -> MeasuredRun:
        """Read a run folder; a missing or unreadable file is one `ConfigError` naming it."""
        path = Path(path)
        metrics = path / "metrics.jsonl"
        records = []
        try:
            for line in metrics.read_text().splitlines():
                if line.strip():
                    records.append(json.loads(line))
            summary = json.loads((path / "summary.json").read_text())
            config = yaml.safe_load((path / "config.yaml").read_text()) or {}
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(
                f"cannot read the training run: {exc}", source=str(path), field="run"
            ) from None
        if not records:
            raise ConfigError("no steps logged", source=str(metrics), field="metrics")
        phase_names = list(records[0].get("phases_s", {}))
        moe_names = sorted({k for r in records for k in r.get("moe_s", {})})
        trace = path / "trace.npz"
        return cls(
            policy=str(config.get("policy", summary.get("policy", path.name))),
            path=path,
            steps=np.array([r["step"] for r in records], dtype=np.int64),
            losses=np.array([r["loss"] for r in records], dtype=float),
            step_s=np.array([r["step_s"] for r in records], dtype=float),
            tokens_per_step=int(records[0].get("tokens", summary.get("tokens_per_step", 0))),
            tokens_per_s=float(summary.get("tokens_per_s", 0.0)),
            device_tokens=np.array([r.get("device_tokens", []) for r in records], dtype=float),
            phases={k: np.array([r["phases_s"].get(k, 0.0) for r in records]) for k in phase_names},
            moe_phases={
                k: np.array([r.get("moe_s", {}).get(k, 0.0) for r in records]) for k in moe_names
            },
            bytes_moved=np.array(
                [
                    r.get("trans_bytes", 0) + r.get("agg_bytes", 0) + r.get("migrate_bytes", 0)
                    for r in records
                ],
                dtype=float,
            ),
            plan_changes=int(summary.get("plan_changes", records[-1].get("plan_changes", 0))),
            val=[(int(s), float(v)) for s, v in summary.get("val", [])],
            config=config,
            world_size=int(summary.get("world_size", 1)),
            trace_path=trace if trace.is_file() else None,
        )

    def warm(self) -> slice:
        """The measured steps: the first `min(3, S // 4)` are warm-up (as `TrainResult`)."""
        return slice(min(3, len(self.step_s) // 4), None)

    @property
    def median_step_s(self) -> float:
        return float(np.median(self.step_s[self.warm()]))

    @property
    def max_over_mean(self) -> float:
        """Slowest rank's load over the mean rank load, averaged over layers and steps."""
        x = self.device_tokens
        if x.ndim != 3 or x.size == 0:
            return 1.0
        mean = x.mean(axis=2)
        return float(
            np.mean(np.divide(x.max(axis=2), mean, out=np.ones_like(mean), where=mean > 0))
        )

    def moe_phase_mean(self, name: str) -> float:
        """Mean seconds per measured step of one `moe_phases` entry (0 when not logged)."""
        series = self.moe_phases.get(name)
        return float(series[self.warm()].mean()) if series is not None else 0.0

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per measured step by phase (rank 0), `_s` suffixed for the plots."""
        w = self.warm()
        return {f"{k}_s": float(v[w].mean()) for k, v in self.phases.items()}


@dataclass(frozen=True)
class LossAgreement:
    """How two loss curves of the same seed compare at the steps both logged: the largest
    absolute difference over all of them (`max_diff`) and over the first `EARLY_STEPS`
    (`early_max`), the first step whose difference exceeds `LOSS_AGREEMENT_TOL`
    (`first_above`, None if none) and the last validation losses (NaN when not measured)."""

    steps: int
    max_diff: float
    max_step: int
    early_steps: int
    early_max: float
    first_above: int | None
    val: tuple[float, float]

    @property
    def agrees(self) -> bool:
        """Equal to rounding over the first steps (where summation order alone cannot have
        grown yet)."""
        return self.steps > 0 and self.early_max <= LOSS_AGREEMENT_TOL


def loss_agreement(a: MeasuredRun, b: MeasuredRun) -> LossAgreement:
    common, ia, ib = np.intersect1d(a.steps, b.steps, return_indices=True)
    nan = float("nan")
    va = a.val[-1][1] if a.val else nan
    vb = b.val[-1][1] if b.val else nan
    if len(common) == 0:
        return LossAgreement(0, nan, 0, 0, nan, None, (va, vb))
    diff = np.abs(a.losses[ia] - b.losses[ib])
    early = int(np.sum(common <= common[0] + EARLY_STEPS - 1))
    above = np.flatnonzero(diff > LOSS_AGREEMENT_TOL)
    return LossAgreement(
        steps=len(common),
        max_diff=float(diff.max()),
        max_step=int(common[int(diff.argmax())]),
        early_steps=early,
        early_max=float(diff[:early].max()),
        first_above=int(common[above[0]]) if len(above) else None,
        val=(va, vb),
    )


def agreement_sentence(ag: LossAgreement, a: str, b: str) -> str:
    """The report's statement about two loss curves of the same seed."""
    if ag.steps == 0:
        return f"The {a} and {b} runs share no logged step, so their losses cannot be compared."
    head = (
        f"The {a} and {b} loss curves agree to float summation order: over the first "
        f"{ag.early_steps} steps the largest difference is {ag.early_max:.2e} nats/byte "
        f"(fp32 rounding of the loss)."
    )
    if not ag.agrees:
        return (
            f"The {a} and {b} loss curves differ by {ag.early_max:.2e} nats/byte within the first "
            f"{ag.early_steps} steps, more than float summation order explains (tolerance "
            f"{LOSS_AGREEMENT_TOL:.0e}): something changed the training. Largest difference "
            f"{ag.max_diff:.2e} (step {ag.max_step})."
        )
    if ag.first_above is None:
        tail = (
            f" The largest difference over all {ag.steps} steps is {ag.max_diff:.2e}. Balancing "
            f"moves and replicates experts but never changes the mathematics of training; only "
            f"the order in which expert outputs and gradients are summed differs."
        )
    else:
        tail = (
            f" Only the order in which expert outputs and gradients are summed differs, and "
            f"training amplifies such rounding differences (they can flip near-tied router "
            f"choices): they first exceed {LOSS_AGREEMENT_TOL:.0e} at step {ag.first_above}, "
            f"and the largest difference over all {ag.steps} steps is {ag.max_diff:.2e} "
            f"(step {ag.max_step})."
        )
    if np.isfinite(ag.val[0]) and np.isfinite(ag.val[1]):
        tail += f" Final validation loss: {ag.val[0]:.4f} ({a}) and {ag.val[1]:.4f} ({b})."
    return head + tail


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
    `poise.report.ideal.judge`; `text`: what it means, in words."""

    static_tok_s: float
    auto_tok_s: float
    speedup: float
    ideal_speedup: float
    verdict: dict[str, Any]
    measured_steps: int
    expert_us_per_token: float
    text: str = ""

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


SIM_COLUMNS = (
    "policy",
    "step time (ms)",
    "vs static",
    "device max/mean",
    "GB moved/step",
    "planning ms/step",
    "planner ms/layer",
)


def sim_rows(result: Any) -> list[list[str]]:
    """Rows of `SIM_COLUMNS` for a `SimResult`, fastest policy first (the `poise simulate`
    table, the demo's and the report's)."""
    rows = []
    for row in result.summary_rows():
        speedup = row["speedup_vs_static"]
        rows.append(
            [
                row["policy"],
                f"{row['mean_step_s'] * 1e3:,.2f}",
                "" if speedup is None else f"{speedup:.2f}x",
                f"{row['max_over_mean']:.2f}",
                f"{row['bytes_moved_per_step'] / 1e9:,.3f}",
                f"{row['planning_s_per_step'] * 1e3:.2f}",
                f"{row['plan_ms_per_layer']:.2f}",
            ]
        )
    return rows


# The step's work by phase for the breakdown tables: label -> the `PolicyRun.phase_totals` keys
# it sums (seconds of work per step; dispatch and combine count forward and backward). Every
# key `phase_totals` returns is in exactly one group (tests/test_demo.py checks).
BREAKDOWN_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-to-all", ("dispatch_s", "combine_s")),
    ("expert compute", ("expert_fwd_s", "expert_bwd_s")),
    ("dense compute", ("non_moe_fwd_s", "non_moe_bwd_s")),
    ("dispatcher host", ("dispatch_host_fwd_s", "dispatch_host_bwd_s")),
    ("Trans/Agg", ("trans_s", "agg_s")),
    ("migration", ("migrate_s",)),
    ("dense all-reduce", ("grad_allreduce_s",)),
    ("counts, clip, optimizer", ("counts_s", "clip_s", "optimizer_s")),
    ("planning", ("planning_s",)),
)
# Shown even when zero for every policy; the other groups only where some policy has them.
BREAKDOWN_ALWAYS = (
    "all-to-all",
    "expert compute",
    "dense compute",
    "Trans/Agg",
    "migration",
    "dense all-reduce",
    "planning",
)
STEP_LABEL = "step"
OVERLAP_LABEL = "overlapped"  # step time minus the work: < 0 under an overlapping schedule


def step_breakdown(result: Any) -> dict[str, dict[str, float]]:
    """Per policy of a `SimResult`, fastest first: its mean step time (`STEP_LABEL`) and its
    work per step by phase (`BREAKDOWN_GROUPS`), seconds. Under the `sync` schedule the phases
    add up to the step time; an overlapping schedule hides part of the work, given as a negative
    `OVERLAP_LABEL` (step time minus the work). Groups that are zero for every policy and not in
    `BREAKDOWN_ALWAYS` are left out, and so is `OVERLAP_LABEL` when nothing overlaps."""
    order = [row["policy"] for row in result.summary_rows()]
    out: dict[str, dict[str, float]] = {}
    for k in order:
        totals = result.runs[k].phase_totals()
        step = result.runs[k].mean_step_s
        work = {label: sum(totals[n] for n in names) for label, names in BREAKDOWN_GROUPS}
        out[k] = {STEP_LABEL: step, **work, OVERLAP_LABEL: step - sum(work.values())}
    unused = {
        label
        for label, _ in BREAKDOWN_GROUPS
        if label not in BREAKDOWN_ALWAYS and all(out[k][label] == 0 for k in order)
    }
    if all(abs(out[k][OVERLAP_LABEL]) <= 1e-9 * out[k][STEP_LABEL] for k in order):
        unused.add(OVERLAP_LABEL)
    return {k: {n: v for n, v in row.items() if n not in unused} for k, row in out.items()}


def breakdown_table(result: Any) -> tuple[list[str], list[list[str]]]:
    """`step_breakdown` of a `SimResult` as `(columns, rows)`: one row per policy, fastest
    first, ms per step."""
    parts = step_breakdown(result)
    labels = list(next(iter(parts.values())))
    columns = ["policy", *(f"{label} (ms)" for label in labels)]
    rows = [[k, *(f"{row[n] * 1e3:,.2f}" for n in labels)] for k, row in parts.items()]
    return columns, rows


def breakdown_by_phase(result: Any, policies: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """`step_breakdown` of a `SimResult` turned on its side for a narrow console:
    `(columns, rows)` with one row per phase and one column per policy of `policies` (those the
    result has), ms per step."""
    parts = step_breakdown(result)
    names = [k for k in dict.fromkeys(policies) if k in parts]
    labels = list(next(iter(parts.values())))
    columns = ["ms per step", *names]
    rows = [[label, *(f"{parts[k][label] * 1e3:,.2f}" for k in names)] for label in labels]
    return columns, rows


REPLAY_COLUMNS = (
    "policy",
    "device max/mean",
    "step time (ms)",
    "speedup",
    "GB moved/step",
    "planner ms/layer",
)


def replay_rows(runs: dict[str, Any]) -> list[list[str]]:
    """Rows of `REPLAY_COLUMNS` for `PolicyRun`s, fastest first."""
    static = runs["static"].mean_step_s if "static" in runs else None
    rows = []
    for name, r in sorted(runs.items(), key=lambda kv: kv[1].mean_step_s):
        rows.append(
            [
                name,
                f"{r.max_over_mean.mean():.2f}",
                f"{r.mean_step_s * 1e3:,.1f}",
                f"{static / r.mean_step_s:.2f}x" if static else "",
                f"{np.mean(r.bytes_moved) / 1e9:.3f}",
                f"{r.plan_ms_per_layer:.2f}",
            ]
        )
    return rows


MEASURED_COLUMNS = (
    "policy",
    "steps",
    "final loss",
    "val loss",
    "median step (ms)",
    "tokens/s",
    "vs static",
    "rank max/mean",
    "plan changes",
    "MB moved/step",
)


def measured_rows(runs: dict[str, MeasuredRun]) -> list[list[str]]:
    """Rows of `MEASURED_COLUMNS`, in the order of `runs`."""
    base = runs["static"].tokens_per_s if "static" in runs else None
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                str(len(r.steps)),
                f"{r.losses[-1]:.4f}",
                f"{r.val[-1][1]:.4f}" if r.val else "",
                f"{r.median_step_s * 1e3:,.1f}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.tokens_per_s / base:.3f}x" if base else "",
                f"{r.max_over_mean:.3f}",
                str(r.plan_changes),
                f"{r.bytes_moved.mean() / 1e6:.2f}",
            ]
        )
    return rows


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def write_demo_report(data: DemoData, out: str | Path) -> Path:
    """Draw the plots (PNG files in `out`) and write `out/report.html` atomically; returns its
    path."""
    from poise.report.plots import (
        breakdown_plot,
        device_load_heatmaps,
        layer_load_heatmaps,
        loss_curves_plot,
        train_speed_plot,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = data.runs
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
    loss_png = "demo-loss.png"
    loss_curves_plot(
        {n: (r.steps, r.losses) for n, r in runs.items()},
        out / loss_png,
        "training loss, " + " vs ".join(names),
    )
    page.figure(loss_png, "Training loss per step; below, the absolute difference between runs.")
    if len(names) >= 2:
        ag = loss_agreement(runs[names[0]], runs[names[1]])
        page.paragraph(agreement_sentence(ag, names[0], names[1]), cls="ok" if ag.agrees else "bad")
        page.paragraph(f"Maximum loss difference: {ag.max_diff:.3e} over {ag.steps} steps.")

    # Speed.
    page.heading("Measured step time and tokens/s", anchor="speed")
    if data.summary is not None:
        m = data.summary
        gain = m.verdict.get("gain_fraction")
        page.table(
            ("static tok/s", "auto tok/s", "auto / static", "ideal", "share of the gain", "met"),
            [
                (
                    f"{m.static_tok_s:,.0f}",
                    f"{m.auto_tok_s:,.0f}",
                    f"{m.speedup:.3f}x",
                    f"{m.ideal_speedup:.3f}x",
                    "" if gain is None else f"{gain:.2f}",
                    "yes" if m.verdict.get("target_met") else "no",
                )
            ],
            caption=f"measured, the {m.measured_steps} steps after the warm-up; "
            f"judged: {m.verdict.get('rule', '')}",
        )
        if m.text:
            page.paragraph(m.text)
    page.table(MEASURED_COLUMNS, measured_rows(runs), caption="measured on this machine")
    speed_png = "demo-speed.png"
    train_speed_plot(
        {n: r.step_s for n, r in runs.items()},
        {n: r.tokens_per_s for n, r in runs.items()},
        out / speed_png,
        "measured training speed",
    )
    page.figure(speed_png, "Step time per step (left) and median tokens/s (right) per policy.")
    phases_png = "demo-phases.png"
    breakdown_plot(
        {n: r.phase_means() for n, r in runs.items()},
        out / phases_png,
        "measured time by phase (rank 0, mean per step)",
        {n: float(r.step_s[r.warm()].mean()) for n, r in runs.items()},
    )
    page.figure(phases_png, "Where a measured step's time goes, by phase of the training loop.")
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
    loads = {n: r.device_tokens for n, r in runs.items() if r.device_tokens.ndim == 3}
    if loads:
        page.heading("Device load over time (measured)", anchor="load")
        heat_png = "demo-load.png"
        layer_load_heatmaps(loads, out / heat_png, "tokens each rank computed, per layer and step")
        page.figure(
            heat_png,
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
        breakdown_plot(
            {k: res.runs[k].phase_totals() for k in order},
            out / png,
            f"{sec.title}: time by phase",
            {k: res.runs[k].mean_step_s for k in order},
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
            device_load_heatmaps(shown, out / png, f"{rep.title}: device load per step")
            page.figure(png, "Modelled device load per step (all layers summed), static and auto.")

    if data.wall_s:
        page.heading("Wall time", anchor="time")
        page.table(("part", "seconds"), [(k, f"{v:.1f}") for k, v in data.wall_s.items()])
    files = [f"{n}: {r.path}" for n, r in runs.items()]
    page.paragraph(
        "Run folders (config.yaml, metrics.jsonl, trace.npz, summary.json): " + "; ".join(files),
        cls="note",
    )
    path = out / "report.html"
    page.write(path)
    return path


__all__ = [
    "EARLY_STEPS",
    "LOSS_AGREEMENT_TOL",
    "DemoData",
    "HtmlPage",
    "LossAgreement",
    "MeasuredRun",
    "MeasuredSummary",
    "ReplaySection",
    "SimSection",
    "agreement_sentence",
    "loss_agreement",
    "measured_rows",
    "replay_rows",
    "sim_rows",
    "write_demo_report",
]
