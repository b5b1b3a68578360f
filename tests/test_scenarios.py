"""`poise.sim.scenarios` and `poise scenarios`: the papers' setups in reduced (--quick) form."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from poise.cli import main
from poise.core.errors import ConfigError
from poise.sim.scenarios import (
    HYBRIDEP_PUBLISHED,
    PROPHET_TABLE_IV,
    PROPHET_TABLE_V,
    SCENARIOS,
    Scenario,
    ScenarioResult,
    build_trace,
    get_scenario,
    hybridep_spec,
    markdown_table,
    paired_gap_se,
    run_scenario,
)
from poise.sim.scenarios.fidelity import fidelity_rows
from poise.sim.scenarios.papers import REPLAY_STEPS
from poise.sim.scenarios.replay import timed_dense_params
from poise.sim.simulator import simulate

TOL = 1e-9  # auto "never slower": equal plans price equal up to float summation order
# The 200-step full forms (19-39 re-planning windows): auto may trail the best rival by forecast
# error alone; with links as capacities the largest gap measured was 8.7e-7 of the step
# (pro-prophet, 8 GPUs, GPT-DM, k=1, sync, against vexpert). A gap beyond FULL_TOL must be
# forecast error by the measure `poise scenarios` reports: within `t_critical` standard errors of
# the paired gap over re-planning windows (`Check.gap_in_se`), and under QUICK_TOL. On HybridEP's
# 2-datacentre cases (drift at rate 0.05, re-planned every 5 steps) auto keeps some layers'
# placement where `hybrid` re-places them every window; it trails `hybrid` by 0.6-2.3e-4 of the
# step there, 0.19-0.89 standard errors: the drift outruns the forecast that priced the
# migration, which auto declined and `hybrid`, re-placing without a cost check, made.
FULL_TOL = 1e-5
# The quick forms replay 20 steps: one re-planning window after the warm-up, so a single
# forecast decides the comparison. Gaps measured with links as capacities: 0.47% (flexmoe,
# sync), 0.18% and 0.03% (pro-prophet): forecast error, not a wrong choice (on the loads it
# plans on, auto is never above any candidate: tests/test_policy_properties.py).
QUICK_TOL = 1e-2

QUICK = [name for name in SCENARIOS if name != "cross-dc-1000"]


def small_cross_dc() -> Scenario:
    """The 1,000-datacentre scenario on 25 datacentres (200 devices): same code path, seconds."""
    s = SCENARIOS["cross-dc-1000"]
    cases = tuple(dataclasses.replace(c, cluster="cross-dc-1000:25") for c in s.cases)
    return dataclasses.replace(s, cases=cases)


def check_result(res: ScenarioResult) -> None:
    assert res.rows, "every scenario yields at least one figure"
    for row in res.rows:
        assert math.isfinite(row.ours) and row.ours > 0, row
        assert math.isfinite(row.auto) and row.auto > 0, row
        assert row.source.startswith("paper-figures.md §"), row.source
        assert row.published_text
    if res.scenario.name == "parm":  # Parm's grid: no replay means, only rows
        # `auto` is the oracle (the faster of S1 and S2 per layer), so its min and max speedups
        # are at least the automatic choice's.
        for row in res.rows:
            assert row.auto >= row.ours * (1 - TOL), row
        return
    if res.scenario.name == "smartmoe":  # the pool's layout against FasterMoE's EP replay
        for row in res.rows:
            (case,) = row.cases
            m = res.means[case]
            (pick,) = [v for k, v in m["layout"].items() if k.endswith("(pool's pick)")]
            ep = m["pipelined(W/2)"]
            assert "auto" in ep and len(ep) >= 3
            assert row.ours == pytest.approx(ep["shadow"] / pick)
            assert row.auto == pytest.approx(ep["shadow"] / ep["auto"])
        return
    for case, by_schedule in res.means.items():
        for schedule, means in by_schedule.items():
            assert "auto" in means and len(means) >= 3, (case, schedule)
            assert all(math.isfinite(v) and v > 0 for v in means.values())
    # Figures are recomputed from the mean step times they report.
    for row in res.rows:
        f = next(
            f
            for f in res.scenario.figures
            if f.label == row.comparison and row.cases[0] in (f.cases or row.cases)
        )
        for case in row.cases:
            m = res.means[case]
            base = np.mean([m[s][p] for s, p in f.baselines])
            assert row.per_case[case] == pytest.approx(base / m[f.system[0]][f.system[1]])
            assert row.per_case_auto[case] == pytest.approx(base / m[f.system[0]]["auto"])


def auto_slower(res: ScenarioResult, tol: float = TOL) -> set[tuple[str, str]]:
    """Runs where auto's mean step time exceeds the fastest other policy's by more than `tol`,
    on the cost model's time (planning wall time is machine noise: reported in `checks` and the
    table, not asserted)."""
    return {
        (c.case, c.schedule) for c in res.checks if c.auto_priced_s > c.best_priced_s * (1 + tol)
    }


@pytest.mark.parametrize("name", QUICK)
def test_each_scenario_quick_form(name: str) -> None:
    res = run_scenario(SCENARIOS[name], quick=True)
    check_result(res)
    assert not auto_slower(res, QUICK_TOL)
    # Every published row that the quick form computes as the full form does (the same cases)
    # matches its paper, or carries the reason recorded for it (benchmarks/fidelity.py prints
    # the full rows).
    labels = [c.label for c in res.scenario.cases]
    full = {f.label: ", ".join(c for c in labels if not f.cases or c in f.cases)
            for f in res.scenario.figures}  # fmt: skip
    for row in fidelity_rows([res]):
        if row.cases == full.get(row.comparison):
            assert row.matches or row.reason, row
    assert len(res.checks) == len(res.scenario.cases_for(True)) * len(res.scenario.runs)
    assert res.wall_s < 20


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICK)
def test_each_scenario_full_form_auto_is_never_slower(name: str) -> None:
    """The issue's line on the full forms (200-step replays; `poise scenarios` runs them in
    about 5 minutes): `auto` is not slower than any other policy in any run beyond forecast
    error: one part in 100,000 (`FULL_TOL`), or, where more, within `t_critical` standard errors
    of the paired gap over re-planning windows (in the figures' column, as `poise scenarios`
    reports it) and under `QUICK_TOL` (the comment at `FULL_TOL`)."""
    from poise.runtime.control.evidence import t_critical as clock_z

    scenario = SCENARIOS[name]
    res = run_scenario(scenario)
    check_result(res)
    windows = -(-(REPLAY_STEPS - scenario.warmup_steps) // scenario.replan_every)
    z = clock_z(windows - 1)
    slower = [c for c in res.checks if (c.case, c.schedule) in auto_slower(res, FULL_TOL)]
    beyond = [
        (c.case, c.schedule, c.ratio_priced, c.gap_in_se)
        for c in slower
        if c.gap_in_se is None or c.gap_in_se > z or c.ratio_priced > 1 + QUICK_TOL
    ]
    assert not beyond


def test_cross_dc_reduced() -> None:
    res = run_scenario(small_cross_dc(), quick=True)
    check_result(res)
    assert not auto_slower(res)
    assert not res.scenario.count_planning  # stated in the setup line
    assert "planning not charged" in markdown_table([res])
    # §V-G's two curves: a fixed expert domain (4 of the 25 DCs) gains no more than the free
    # cut, and neither can be slower than static (each layer keeps static's where gathering
    # prices above it on the even split it is planned on, before training).
    ours = {row.comparison: row.ours for row in res.rows}
    fixed, free = ours["HybridEP vs EP (S_ED fixed)"], ours["HybridEP vs EP (p fixed)"]
    assert 1.0 - 1e-9 <= fixed <= free + 1e-9


@pytest.mark.slow
def test_cross_dc_1000_quick_form() -> None:
    res = run_scenario(SCENARIOS["cross-dc-1000"], quick=True)
    check_result(res)
    assert not auto_slower(res)
    assert res.means["1000 DCs x 8 H100"]["hybrid"]["static"] > 0


def test_auto_keeps_room_for_vexpert_after_the_step_zero_tie() -> None:
    """The largest loss of auto before ties went to the fewest copies, in quick form: at step 0
    the uniform forecast made every placement price alike, auto kept eplb's replica-filled
    placement, and its vexpert candidate (a local search from the plan in force) had no free slot
    left. With the tie going to the placement with the fewest copies, auto is not slower than
    vexpert."""
    s = dataclasses.replace(SCENARIOS["fastermoe"], quick_cases=("MoE-GPT-L",))
    res = run_scenario(s, quick=True)
    check = {c.schedule: c for c in res.checks}["pipelined(W/2)"]
    assert check.auto_priced_s <= check.best_priced_s * (1 + TOL)
    case = s.cases_for(True)[0]
    trace, _ = build_trace(case, True, None)
    result = simulate(
        trace,
        case.get_cluster(),
        case.spec,
        ["vexpert", "auto"],
        "pipelined(4)",
        s.replan_every,
        s.predictor,
        count_planning=False,
        dense_params=timed_dense_params(s, case.spec),  # None: the MoE layers alone
    )
    w = s.warmup_steps
    auto, vexpert = (result.runs[n].step_s[w:].mean() for n in ("auto", "vexpert"))
    assert auto <= vexpert * (1 + TOL)


def test_registry_carries_the_published_tables() -> None:
    assert list(SCENARIOS) == [
        "fastermoe",
        "pro-prophet",
        "smartmoe",
        "flexmoe",
        "hybridep",
        "cross-dc-1000",
        "parm",
    ]
    pp = SCENARIOS["pro-prophet"]
    assert len(pp.cases) == len(PROPHET_TABLE_IV) + len(PROPHET_TABLE_V) == 18
    assert {f.published for f in pp.figures} >= {1.98, 2.62, 0.96, 1.94}
    he = SCENARIOS["hybridep"]
    assert [f.published for f in he.figures] == [
        v for row in HYBRIDEP_PUBLISHED.values() for v in row.values()
    ]
    for s in SCENARIOS.values():
        if s.name == "parm":  # not a trace replay (Parm's schedule grid): no cases or runs
            assert s.figures and not s.cases and not s.runs and s.runner is not None
            continue
        if s.name == "smartmoe":  # layouts priced by its runner beside an EP replay
            assert s.runner is not None and len(s.figures) == len(s.cases) == 2
            assert [f.published for f in s.figures] == [1.88, 1.765]
            continue
        assert s.figures and s.cases and s.runs
        labels = {c.label for c in s.cases}
        assert set(s.quick_cases) <= labels
        for f in s.figures:
            assert set(f.cases) <= labels and f.aggregate in ("one", "max", "mean")
            scheds = {r.name for r in s.runs}
            assert f.system[0] in scheds and all(b[0] in scheds for b in f.baselines)


def test_hybridep_sizes_follow_table_v() -> None:
    spec = hybridep_spec(6)
    assert spec.expert_bytes == pytest.approx(0.36e6, rel=0.002)
    dispatched = spec.tokens_per_device * spec.top_k * spec.token_bytes
    assert dispatched == pytest.approx(6e6, rel=1e-3)
    assert hybridep_spec(192).tokens_per_device == pytest.approx(32 * spec.tokens_per_device, 1e-3)


def test_smartmoe_trace_uses_the_sample(smartmoe_dir: Path) -> None:
    from poise.sim.scenarios.smartmoe import RECIPE, case_counts, layout_cases

    sixteen, thirty_two = layout_cases()
    case = dataclasses.replace(thirty_two.case, trace=RECIPE)
    trace, note = build_trace(case, False, smartmoe_dir.parent)
    assert trace.counts.shape == (20, 16, 16, 32)  # 2 snapshots x 10, 16 layers, 16 ranks
    assert trace.meta["iterations"] == [1001] * 10 + [5001] * 10
    assert "SmartMoE-AE sample" in note and "NOT FOUND" not in note
    # The 16-GPU case: 32 experts folded in pairs to 16, counts doubled to 16,384 tokens per GPU
    # (the sample has 8,192 per rank); every token-to-expert assignment is kept.
    counts, note = case_counts(sixteen, False, smartmoe_dir.parent)
    assert counts.shape == (20, 16, 16, 16) and "folded in pairs" in note
    assert counts.sum() == 2 * trace.counts.sum()
    assert np.array_equal(counts[..., 3], 2 * trace.counts[..., 6:8].sum(axis=-1))
    assert counts[0, 0].sum() == 16 * 16_384 * 2  # 16 GPUs x tokens x top-2
    fallback, note = case_counts(sixteen, False, None)
    assert fallback.shape == counts.shape and "NOT FOUND" in note


def test_unknown_scenario_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown scenario"):
        get_scenario("nope")


def test_cli_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main(["scenarios", "--only", "smartmoe", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| scenario | setup | system vs baseline | ours | auto | published | source |" in printed
    assert "SmartMoE (pool's layout) vs FasterMoE" in printed and "1.88" in printed
    assert (out / "scenarios.md").read_text() == printed
    data = json.loads((out / "scenarios.json").read_text())
    (s,) = data["scenarios"]
    assert s["name"] == "smartmoe" and s["quick"] and len(s["rows"]) == 1  # 16 GPUs
    assert all(math.isfinite(r["ours"]) for r in s["rows"])
    assert {c["schedule"] for c in s["checks"]} == {"pipelined(W/2)"}


def test_cli_unknown_scenario_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scenarios", "--only", "fastermoe", "nope", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("poise: error: nope")
    assert "unknown scenario" in lines[0] and captured.out == ""
    assert not (tmp_path / "scenarios.md").exists()


def test_paired_gap_se_uses_replanning_windows_as_samples() -> None:
    # After 2 warm-up steps the differences are [1, 3, 2, 2, 5, 1]; windows of 2 have means
    # [2, 2, 3]: standard deviation 1 / sqrt(3), standard error 1 / 3.
    a = np.array([9.0, 9.0, 1.0, 3.0, 2.0, 2.0, 5.0, 1.0]) + 10.0
    b = np.full(8, 10.0)
    assert paired_gap_se(a, b, warmup=2, window=2) == pytest.approx(1.0 / 3.0)
    assert paired_gap_se(a, b, warmup=2, window=6) is None  # one window: no spread to measure


def test_the_timed_span_follows_the_paper() -> None:
    """FasterMoE's Fig. 13 times the MoE layers alone: its replays price no dense compute and no
    dense all-reduce; a paper that times whole steps pays both, the all-reduce of F_d / 2
    parameters per block (F_d the block's dense forward FLOPs per token) in every block."""
    from poise.sim.scenarios.replay import timed_spec

    faster = SCENARIOS["fastermoe"]
    spec = faster.cases[0].spec
    assert faster.timed == "moe"
    assert timed_spec(faster, spec).non_moe_flops_fwd == 0.0
    assert timed_dense_params(faster, spec) is None
    prophet = SCENARIOS["pro-prophet"]
    pspec = prophet.cases[0].spec
    assert prophet.timed == "step" and timed_spec(prophet, pspec) == pspec
    assert timed_dense_params(prophet, pspec) == pspec.moe_layers * 12 * pspec.d_model**2
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(faster, timed="iteration")
    assert info.value.field == "timed"


def test_cli_scenarios_plan_in_the_background_unless_inline(tmp_path, monkeypatch) -> None:
    """`poise scenarios` keeps each scenario's background planning (the default, as the
    runtime); `--inline-planning` charges planning on the critical path."""
    import poise.commands.scenarios as cmd

    seen: list[tuple[bool, str]] = []

    def fake(scenario, **kw):
        seen.append((scenario.background_planning, scenario.planning_note))
        raise SystemExit(0)

    monkeypatch.setattr(cmd, "run_scenario", fake)
    assert get_scenario("smartmoe").background_planning
    for extra in ([], ["--inline-planning"]):
        with pytest.raises(SystemExit):
            main(["scenarios", "--only", "smartmoe", "--quick", "--out", str(tmp_path), *extra])
    assert [b for b, _ in seen] == [True, False]
    assert "critical path" in seen[1][1]


def test_smart_scheduling_stays_under_fastermoes_ideal() -> None:
    """FasterMoE §5.5 (Fig. 12): the smart schedule's ideal is up to 1.71x per layer. Priced with
    dispatch and combine on the same links, Poise's smart scheduling alone stays under it; as
    independent stages (max(a, c, b)) it came out above (1.73x)."""
    res = run_scenario(SCENARIOS["fastermoe"], quick=True)
    (smart,) = [r for r in res.rows if r.comparison.startswith("smart scheduling alone")]
    assert 1.0 < smart.ours <= 1.71


def test_the_skew_sweep_sets_every_generated_trace() -> None:
    from poise.sim.scenarios.core import with_zipf_s

    swept = with_zipf_s(SCENARIOS["hybridep"], 1.5)
    assert all(dict(c.trace.params)["s"] == 1.5 for c in swept.cases)
    assert all(dict(c.trace.params)["s"] == 1.0 for c in SCENARIOS["hybridep"].cases)
    smart = SCENARIOS["smartmoe"]
    assert with_zipf_s(smart, 2.0).cases == smart.cases  # recorded routing: untouched
    with pytest.raises(ConfigError, match="must be > 0"):
        with_zipf_s(smart, 0.0)


def test_the_seed_shift_moves_every_generated_trace_and_changes_its_loads() -> None:
    from poise.sim.scenarios.core import with_seed_shift

    # HybridEP's generated cases with SmartMoE's recorded-routing ones beside them.
    smart = SCENARIOS["smartmoe"]
    hybridep = get_scenario("hybridep")
    sc = dataclasses.replace(hybridep, cases=hybridep.cases + smart.cases)
    assert {c.trace.kind for c in sc.cases} == {"generate", "smartmoe"}
    shifted = with_seed_shift(sc, 1000)
    assert len(shifted.cases) == len(sc.cases)
    for old, new in zip(sc.cases, shifted.cases, strict=True):
        if old.trace.kind == "generate":
            assert new.trace.seed == old.trace.seed + 1000
            assert new.trace == dataclasses.replace(old.trace, seed=old.trace.seed + 1000)
        else:
            assert new == old
    assert with_seed_shift(smart, 1000).cases == smart.cases  # recorded routing: untouched
    # Another draw: the same shape, different loads.
    i = next(i for i, c in enumerate(sc.cases) if c.trace.kind == "generate")
    before, _ = build_trace(sc.cases[i], quick=True, data=None)
    after, note = build_trace(shifted.cases[i], quick=True, data=None)
    assert after.counts.shape == before.counts.shape
    assert not np.array_equal(after.counts, before.counts)
    assert f"seed {sc.cases[i].trace.seed + 1000}" in note
    assert with_seed_shift(sc, 0) == sc
    with pytest.raises(ConfigError, match="must be >= 0"):
        with_seed_shift(sc, -1)
