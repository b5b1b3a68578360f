"""The fidelity rows and summary (`poise.sim.scenarios.fidelity`), on hand-made table rows."""

from __future__ import annotations

import dataclasses
import math

import pytest

from poise.sim.scenarios.core import Row
from poise.sim.scenarios.fidelity import (
    FACTOR,
    explanation,
    fidelity_row,
    markdown,
    outside_range,
    published_range,
    same_direction,
    summarise,
)


def _row(comparison: str, ours: float, published: float | None) -> Row:
    return Row(
        scenario="fastermoe",
        setup="",
        comparison=comparison,
        ours=ours,
        auto=ours,
        published=published,
        published_text=f"{published}x",
        source="Fig. 13",
        cases=["MoE-GPT-S"],
    )


def test_ratio_band_and_direction_by_hand() -> None:
    # 1.2 / 1.6 = 0.75: inside [1/1.5, 1.5], both speed-ups.
    near = fidelity_row("fastermoe", "FasterMoE", _row("smart scheduling alone", 1.2, 1.6))
    assert near is not None and near.ratio == pytest.approx(0.75)
    assert near.within and near.direction_ok and near.explained is None
    # 0.5 against 1.95: a slow-down where the paper measured a speed-up, ratio 0.256.
    off = fidelity_row(
        "fastermoe", "FasterMoE", _row("dynamic shadowing alone vs FastMoE", 0.5, 1.95)
    )
    assert off is not None and off.ratio == pytest.approx(0.5 / 1.95)
    assert not off.within and not off.direction_ok
    assert off.explained is not None and "MoE layers alone" in off.explained
    # The band's edges belong to it.
    edge = fidelity_row("fastermoe", "FasterMoE", _row("x", 1.5 * FACTOR, 1.5))
    assert edge is not None and edge.within


def test_rows_without_a_published_number_are_left_out() -> None:
    assert fidelity_row("fastermoe", "FasterMoE", _row("x", 1.2, None)) is None
    assert fidelity_row("fastermoe", "FasterMoE", _row("x", math.nan, 1.2)) is None


def test_same_direction_counts_one_as_neutral() -> None:
    assert same_direction(1.4, 2.0) and same_direction(0.9, 0.5)
    assert not same_direction(1.4, 0.9) and not same_direction(0.9, 1.4)
    assert same_direction(1.0, 0.7) and same_direction(1.3, 1.0)


def test_explanation_takes_the_longest_matching_prefix() -> None:
    assert explanation("flexmoe", "FlexMoE vs FasterMoE") != explanation(
        "flexmoe", "FlexMoE vs DeepSpeed-MoE"
    )
    assert explanation("cross-dc-1000", "anything") is not None  # the empty prefix
    assert explanation("no-such-scenario", "x") is None


def test_summary_by_hand() -> None:
    rows = [
        fidelity_row("fastermoe", "F", _row("smart scheduling alone", 2.0, 1.0)),  # log2 1
        fidelity_row("fastermoe", "F", _row("smart scheduling alone", 1.0, 1.0)),  # log2 0
        fidelity_row("fastermoe", "F", _row("dynamic shadowing alone", 0.5, 2.0)),  # 2, wrong
        fidelity_row("smartmoe", "S", _row("unexplained", 0.8, 1.6)),  # log2 1, wrong
    ]
    got = summarise([r for r in rows if r is not None])
    assert got == {
        "summary": True,
        "rows": 4,
        "within_1_5": 1,
        "median_abs_log2_ratio": 1.0,
        "wrong_direction": 2,
        "wrong_direction_unexplained": 1,
    }
    table = markdown([r for r in rows if r is not None], got)
    assert "**opposite**" in table and "1 of 4 rows within a factor 1.5" in table


def test_a_row_below_its_published_range_carries_its_reason() -> None:
    """HybridEP's 1,000-DC "S_ED fixed" row: 1.00x against "1.05-1.45×" is inside the factor 1.5
    of 1.45 (0.69) but below the range: the row carries its recorded reason, and the table
    says so."""
    assert published_range("1.05-1.45×") == (1.05, 1.45)
    assert published_range("1.31–3.76×") == (1.31, 3.76)
    assert published_range("up to 1.88×") is None and published_range("1.45×") is None
    assert outside_range("1.05-1.45×", 1.0007) and outside_range("1.05-1.45×", 1.5)
    assert not outside_range("1.05-1.45×", 1.2) and not outside_range("1.05-1.45×", 1.046)
    assert not outside_range("1.45×", 1.0)
    row = dataclasses.replace(
        _row("HybridEP vs EP (S_ED fixed)", 1.0007, 1.45),
        scenario="cross-dc-1000",
        published_text="1.05-1.45×",
    )
    f = fidelity_row("cross-dc-1000", "HybridEP", row)
    assert f is not None and f.within and f.direction_ok
    assert f.explained == explanation("cross-dc-1000", "HybridEP vs EP (S_ED fixed)")
    assert "S_ED" in f.explained
    table = markdown([f], summarise([f]))
    assert "(outside the published range)" in table and "S_ED is not given" in table
    inside = fidelity_row("cross-dc-1000", "HybridEP", dataclasses.replace(row, ours=1.3))
    assert inside is not None and inside.explained is None
