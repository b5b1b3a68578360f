"""The SmartMoE scenario: its side is the layout SmartMoE's offline pool picks, priced with the
same work per step as FasterMoE's EP replay, and its quick form stays fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poise.layouts.pool import Layout
from poise.layouts.price import price_layout
from poise.sim.scenarios import SCENARIOS, run_scenario
from poise.sim.scenarios.smartmoe import (
    case_counts,
    compare,
    fold_experts,
    layout_cases,
    layout_settings,
)


def test_fold_experts_keeps_every_assignment() -> None:
    counts = np.arange(2 * 3 * 8).reshape(2, 3, 8)
    folded = fold_experts(counts, 4)
    assert folded.shape == (2, 3, 4) and folded.sum() == counts.sum()
    assert folded[1, 2, 3] == counts[1, 2, 6] + counts[1, 2, 7]


def test_smartmoe_side_is_the_pools_argmin_with_a_hybrid_layout(smartmoe_dir: Path) -> None:
    """The SmartMoE side is the pool's cheapest layout, not a hand-written one: a pipeline or
    expert-data-parallel copies (pp > 1 or edp > 1), and no cheaper than two layouts priced here
    by hand on the same loads: plain EP (FasterMoE's layout, one expert per GPU) and the
    layout SmartMoE's own pool chose in the artifact's log (pp4 x ep2 x edp2)."""
    scenario = SCENARIOS["smartmoe"]
    lc = layout_cases()[0]  # 16 GPUs: the 1.88x case
    counts, _ = case_counts(lc, True, smartmoe_dir.parent)
    got = compare(lc, counts, scenario)
    pick = got.chosen.layout
    assert pick == got.ranked[0].layout
    assert pick.pp > 1 or pick.edp > 1
    cluster, spec, settings = lc.case.get_cluster(), lc.case.spec, layout_settings()
    for pp, ep in ((1, 16), (lc.paper_pp, lc.paper_ep)):
        alternative = Layout(16, spec.experts, spec.moe_layers, pp, ep)
        if alternative == pick:
            continue
        price = price_layout(alternative, cluster, spec, counts, settings)
        assert got.ranked[0].step_s <= price.step_s
    # The row is FasterMoE's replayed step over the pick's price on the same measured steps.
    assert got.speedup == pytest.approx(got.policies_s["shadow"] / got.chosen.step_s)
    assert got.chosen.micro_batches == pick.pp * spec.tokens_per_device // 4096


def test_quick_form_is_fast_and_states_its_pick(smartmoe_dir: Path) -> None:
    res = run_scenario(SCENARIOS["smartmoe"], quick=True, data=smartmoe_dir.parent)
    assert res.wall_s < 10
    (row,) = res.rows
    assert row.cases == ["16 GPUs"] and row.ours > 1.0  # the paper's direction
    (note,) = res.trace_notes.values()
    assert "the pool picks" in note and "SmartMoE's own choice pp4-ep2-edp2" in note
