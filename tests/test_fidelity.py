"""The fidelity rows and summary (`poise.sim.scenarios.fidelity`), on hand-made table rows."""

from __future__ import annotations

import dataclasses
import math

import pytest

from poise.sim.scenarios import fidelity
from poise.sim.scenarios.core import Check, Row, ScenarioResult
from poise.sim.scenarios.fidelity import (
    FACTOR,
    auto_line,
    fidelity_row,
    markdown,
    nearest_end,
    published_bounds,
    same_side,
    side,
    stale_reasons,
    summarise,
)


def _row(comparison: str, ours: float, published: float | None, text: str = "") -> Row:
    return Row(
        scenario="fastermoe",
        setup="",
        comparison=comparison,
        ours=ours,
        auto=ours,
        published=published,
        published_text=text or f"{published}x",
        source="Fig. 13",
        cases=["MoE-GPT-S"],
    )


def test_no_gain_never_matches_a_published_gain() -> None:
    """1.00x against "1.05-1.45x": within a factor 1.5 of either end, but no gain where the paper
    shows one, so it does not match (scored against the upper end, 1.00 / 1.45 = 0.69, it did)."""
    row = fidelity_row("cross-dc-1000", "H", _row("S_ED fixed", 1.0007, 1.45, "1.05-1.45×"))
    assert row is not None and row.ratio == pytest.approx(1.0007 / 1.05)
    assert row.within and not row.direction_ok and not row.matches
    # The same holds for a single published number: 1.00 against 1.03.
    single = fidelity_row("hybridep", "H", _row("x", 1.003, 1.03))
    assert single is not None and single.within and not single.matches


def test_a_range_is_scored_against_its_nearest_end() -> None:
    assert published_bounds(1.45, "1.05-1.45×") == (1.05, 1.45)
    assert published_bounds(3.76, "1.31–3.76×") == (1.31, 3.76)
    assert published_bounds(1.88, "up to 1.88×") == (1.88, 1.88)
    assert nearest_end(1.2, 1.05, 1.45) == 1.2 and nearest_end(2.0, 1.05, 1.45) == 1.45
    inside = fidelity_row("x", "P", _row("r", 1.2, 1.45, "1.05-1.45×"))
    assert inside is not None and inside.ratio == 1.0 and inside.matches
    # 2.3 against 1.05-1.45: 2.3 / 1.45 = 1.59, outside the factor.
    above = fidelity_row("x", "P", _row("r", 2.3, 1.45, "1.05-1.45×"))
    assert above is not None and above.ratio == pytest.approx(2.3 / 1.45)
    assert not above.within and above.direction_ok and not above.matches


def test_ratio_band_and_direction_by_hand() -> None:
    # 1.2 / 1.6 = 0.75: inside [1/1.5, 1.5], both gains.
    near = fidelity_row("fastermoe", "FasterMoE", _row("smart", 1.2, 1.6))
    assert near is not None and near.ratio == pytest.approx(0.75)
    assert near.within and near.direction_ok and near.matches and near.reason is None
    # 1.15 against 0.96: a gain where the paper measured a loss.
    wrong = fidelity_row("pro-prophet", "P", _row("FasterMoE", 1.15, 0.96))
    assert wrong is not None and wrong.within and not wrong.direction_ok and not wrong.matches
    # The band's edges belong to it.
    edge = fidelity_row("fastermoe", "FasterMoE", _row("x", 1.5 * FACTOR, 1.5))
    assert edge is not None and edge.within


def test_sides_of_one() -> None:
    assert side(1.004) == 0 and side(0.996) == 0 and side(1.02) == 1 and side(0.96) == -1
    assert same_side(1.4, 1.4, 2.0) and same_side(0.9, 0.9, 0.5) and same_side(1.0, 1.0, 1.003)
    assert not same_side(1.4, 1.4, 0.9) and not same_side(1.3, 1.3, 1.0)
    assert not same_side(0.9, 1.2, 1.1)  # a range across 1.0 names no side


def test_rows_without_a_published_number_are_left_out() -> None:
    assert fidelity_row("fastermoe", "FasterMoE", _row("x", 1.2, None)) is None
    assert fidelity_row("fastermoe", "FasterMoE", _row("x", math.nan, 1.2)) is None


def test_a_reason_belongs_to_its_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reason is found by the row's scenario, comparison and cases exactly: a row of the same
    comparison on other cases does not inherit it, and a reason outliving its row's mismatch is
    stale."""
    monkeypatch.setattr(fidelity, "REASONS", {("fastermoe", "smart", "MoE-GPT-S"): "because"})
    off = fidelity_row("fastermoe", "F", _row("smart", 3.0, 1.4))
    other = fidelity_row(
        "fastermoe", "F", dataclasses.replace(_row("smart", 3.0, 1.4), cases=["MoE-GPT-L"])
    )
    good = fidelity_row("fastermoe", "F", _row("smart", 1.4, 1.4))
    assert off is not None and off.reason == "because"
    assert other is not None and other.reason is None
    assert good is not None and good.reason is None
    assert stale_reasons([off, good]) == [("fastermoe", "smart", "MoE-GPT-S")]


def test_summary_counts_paper_and_assumed_set_ups_apart() -> None:
    rows = [
        fidelity_row("a", "P", _row("r1", 2.0, 1.0)),  # log2 1, no match (1.0: no side)
        fidelity_row("a", "P", _row("r2", 1.2, 1.2)),  # log2 0, match
        fidelity_row("a", "P", _row("r3", 0.5, 2.0)),  # log2 2, other side
        fidelity_row("b", "S", _row("r4", 1.6, 1.6), "assumed", "the cluster"),  # match
    ]
    got = summarise([r for r in rows if r is not None])
    assert got["paper"] == {
        "rows": 3,
        "match": 1,
        "match_share": pytest.approx(1 / 3, abs=1e-4),
        "median_abs_log2_ratio": 1.0,
        "wrong_direction": 2,
        "unexplained": 2,
    }
    assert got["assumed"]["rows"] == 1 and got["assumed"]["match"] == 1
    table = markdown([r for r in rows if r is not None], got)
    assert "1 of 3 rows whose set-up follows the paper match it" in table
    assert "1 of 1 rows on assumed set-ups" in table and "**b**: the cluster" in table
    assert "**no**: outside the factor, other side of 1.0" in table  # r3, both ways off


def _check(
    case: str, charged: tuple[float, float], priced: tuple[float, float], count: bool
) -> Check:
    """auto's and the fastest other policy's mean step seconds, charged and priced."""
    return Check(
        scenario="s",
        case=case,
        schedule="sync",
        count_planning=count,
        auto_charged_s=charged[0],
        best_charged="eplb",
        best_charged_s=charged[1],
        auto_priced_s=priced[0],
        best_priced="vexpert",
        best_priced_s=priced[1],
        auto_planning_s=0.0,
        auto_chosen=[],
    )


def test_the_auto_line_counts_slower_runs_in_each_scenarios_own_column() -> None:
    """Each run is judged in its figures' column: a scenario that counts planning by its
    charged time (here slower, 1.2x, though faster priced), else by the priced time (here a
    tie, 1.0, not slower, though slower charged); the worst run is the highest such ratio."""
    charged = _check("a", (1.2, 1.0), (0.9, 1.0), count=True)
    priced = _check("b", (3.0, 1.0), (2.0, 2.0), count=False)
    faster = _check("c", (0.5, 1.0), (0.5, 1.0), count=False)
    res = ScenarioResult(None, [], [charged, priced, faster], {}, 0.0, True)  # type: ignore[arg-type]
    line = auto_line([res])
    assert (line["runs"], line["slower"]) == (3, 1)
    assert line["worst"]["case"] == "a" and line["worst"]["column"] == "charged"
    assert line["worst"]["ratio"] == pytest.approx(1.2) and line["worst"]["best"] == "eplb"
    assert auto_line([])["worst"] is None and auto_line([])["runs"] == 0


def test_hybridep_reasons_work_out_table_v_by_hand() -> None:
    """Each HybridEP reason carries its own row's Table V times and the byte check worked out by
    hand: from 96 to 192 MB Tutel adds 20.35 - 12.65 = 7.70 s (2 DCs) and 28.46 - 18.59 = 9.87 s
    (4 DCs), where one 10 Gb/s link a DC carrying 4 all-to-alls x 12 layers x 8 GPUs x 96 MB x
    (G - 1) / G needs 4 * 12 * 8 * 96e6 * 0.5 / 1.25e9 = 14.7 s (2 DCs) and x 0.75: 22.1 s."""
    two = fidelity.REASONS[("hybridep", fidelity._HYBRIDEP, "2 DCs x 8 A800, 6 MB")]
    four = fidelity.REASONS[("hybridep", fidelity._HYBRIDEP, "4 DCs x 8 A800, 192 MB")]
    assert "Tutel at 2.52 s, FasterMoE at 2.58 s and HybridEP at 2.48 s" in two
    assert "Tutel adds 7.70 s" in two and "needs 14.7 s" in two and "about 0.5 of" in two
    assert "from 2.48 to 3.78 s" in two and "furthest above" in two  # 2.48 s of 2.52 s
    assert "Tutel at 28.46 s" in four and "HybridEP at 5.20 s" in four
    assert "Tutel adds 9.87 s" in four and "needs 22.1 s" in four and "about 0.4 of" in four
    assert "furthest above" not in four
    # The row that matches (2 DCs, 192 MB) has no reason to go stale.
    assert ("hybridep", fidelity._HYBRIDEP, "2 DCs x 8 A800, 192 MB") not in fidelity.REASONS
