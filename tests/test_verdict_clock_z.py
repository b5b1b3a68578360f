"""`poise.runtime.verdict.clock_z` and `Verdict.dof`: Student's t for the clock's standard
error, checked against the textbook table's values and the t distribution itself."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from poise.runtime.verdict import CLOCK_Z, T_975, Verdict, clock_z


def test_clock_z_is_students_t_for_the_clocks_degrees_of_freedom() -> None:
    # values of any printed t table (two-sided 95%)
    assert [clock_z(d) for d in (1, 2, 3, 4, 7, 10, 30)] == [
        12.706, 4.303, 3.182, 2.776, 2.365, 2.228, 2.042,
    ]  # fmt: skip
    assert clock_z(0) == clock_z(31) == clock_z(1000) == CLOCK_Z == 2.0
    assert all(a > b for a, b in pairwise(T_975))  # falls towards 1.96


@pytest.mark.parametrize("dof", [2, 3, 7])
def test_the_table_holds_95_percent_of_t_draws(dof: int) -> None:
    """A t variate is a normal over sqrt(chi2 / dof): 200,000 draws land inside the table's
    value 95% of the time (a fixed 2 would hold 81.6%, 86.1% and 91.4%)."""
    rng = np.random.default_rng(dof)
    n = 200_000
    t = rng.standard_normal(n) / np.sqrt(rng.chisquare(dof, n) / dof)
    inside = float(np.mean(np.abs(t) <= clock_z(dof)))
    assert inside == pytest.approx(0.95, abs=0.003)
    assert float(np.mean(np.abs(t) <= 2.0)) < 0.93


def test_a_verdicts_degrees_of_freedom() -> None:
    assert Verdict(1.0, 0.5, 10, 1e-3, 1e-3, probes=4).dof == 3  # paired: P - 1
    assert Verdict(1.0, 0.5, 10, 1e-3, 1e-3, probes=4).z == 3.182
    assert Verdict(1.0, 0.5, 10, 1e-3, 1e-3, wall_dof=5).dof == 5  # two samples' smaller - 1
    assert Verdict(1.0, 0.5, 10, 1e-3, 1e-3).dof == 0  # not known: `CLOCK_Z`
    assert Verdict(1.0, 0.5, 10, 1e-3, 1e-3).z == CLOCK_Z
    assert Verdict(1.0, 0.5, 10, 1e-3, 1e-3, probes=4).as_dict()["dof"] == 3
