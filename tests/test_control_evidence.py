"""Evidence on the plan in force (`poise.runtime.control.evidence`) and the paired clock it reads
(`poise.runtime.control.clock`), by hand on `tests.helpers.replica_case`: static's busy seconds
are 27,840 ns a step, the replica plan's 23,680 ns with 512 ns of Trans + Agg."""

from __future__ import annotations

import numpy as np
import pytest

from poise.runtime.control.clock import (
    MIN_STEADY_DIFFS,
    Probes,
    paired_clock,
    replica_scale,
    steady_probes,
)
from poise.runtime.control.evidence import (
    MAX_PROBES,
    MIN_PROBES,
    clock_evidence,
    judge,
    model_evidence,
    probe_due,
    t_critical,
)
from poise.runtime.control.job import run_job
from poise.runtime.selfcal import fit as selfcal
from tests.helpers import measured_rows, probes_reading, replica_case, replica_job

US = 1e-6
BUSY = 27_840e-9  # static's busy seconds on `replica_case`'s counts


def test_critical_values_are_students_t() -> None:
    assert t_critical(3) == 3.182 and t_critical(9) == 2.262
    assert t_critical(0) == t_critical(100) == 2.0


def test_the_paired_clock_sees_through_the_machines_drift() -> None:
    """Four probe steps, each 5 us slower than its neighbours (the replicas save 5 us a step),
    while the machine's speed drifts by 0, +100, -80 and +50 us from one probe to the next:
    d = (5, 5 + 1, 5 - 1, 5) us -> saving 5 us, standard error std(d) / 2 = 0.408 us; the
    model predicts 27,840 - 23,680 - 512 = 3,648 ns for the same comparison."""
    cost, static, replica, counts = replica_case()
    drift = np.array([0.0, 100e-6, -80e-6, 50e-6])
    jitter = np.array([0.0, 1e-6, -1e-6, 0.0])
    n = len(drift)
    probes = Probes(
        np.stack([counts] * n), measured_rows(1e-3 + BUSY + drift + 5 * US + jitter),
        np.stack([counts] * 2 * n), measured_rows(np.repeat(1e-3 + BUSY + drift, 2)),
        np.repeat(np.arange(n), 2),
    )  # fmt: skip
    saving, se = paired_clock(cost, static, probes)
    assert saving == pytest.approx(5 * US, abs=1e-12)
    assert se == pytest.approx(float(np.std(5 * US + jitter, ddof=1) / 2), rel=1e-9)
    ev = clock_evidence(cost, static, replica, probes)
    assert (ev.source, ev.saving_s, ev.se_s, ev.dof, ev.probes) == ("clock", saving, se, 3, 4)
    assert ev.predicted_s == pytest.approx(3_648e-9) and ev.conclusive and not ev.refutes
    # probes 5 us *faster* than their neighbours: the replicas cost 5 us, conclusively
    slower = Probes(probes.counts, measured_rows(1e-3 + BUSY + drift - 5 * US + jitter),
                    probes.pair_counts, probes.pair_measured, probes.pair_of)  # fmt: skip
    assert clock_evidence(cost, static, replica, slower).refutes
    # fewer than MIN_PROBES, or a plan without replicas: no clock
    few = probes.subset(np.arange(n) < MIN_PROBES - 1)
    assert clock_evidence(cost, static, replica, few) is None
    assert clock_evidence(cost, static, static, probes) is None


def test_the_models_counterfactual_by_hand() -> None:
    """Four steps run under the replica plan, each measuring 1,000, 1,200, 1,400 and 1,600 ns of
    exposed transfers: saving 4,160 - 1,300 = 2,860 ns a step, standard error
    std(200 ns steps) / 2 = 129.1 ns, 3 degrees of freedom."""
    cost, static, replica, counts = replica_case()
    steps = np.stack([counts] * 4)
    rows = measured_rows(np.full(4, 1e-3))
    rows[:, selfcal.TRANSFERS] = [1_000e-9, 1_200e-9, 1_400e-9, 1_600e-9]
    ev = model_evidence(cost, static, replica, steps, rows)
    assert ev.source == "model" and ev.steps == 4 and ev.dof == 3
    assert ev.saving_s == pytest.approx(2_860e-9)
    assert ev.se_s == pytest.approx(np.std([1000, 1200, 1400, 1600], ddof=1) / 2 * 1e-9)
    assert ev.conclusive and ev.predicted_s is None
    assert model_evidence(cost, static, replica, steps[:0], rows[:0]) is None


def test_the_clock_decides_where_it_is_conclusive_and_the_model_otherwise() -> None:
    cost, static, replica, counts = replica_case()
    steps = np.stack([counts] * 4)
    rows = measured_rows(np.full(4, 1e-3))
    sure = probes_reading(counts, 2e-6 + np.array([0, 1e-8, -1e-8, 0]))
    assert judge(cost, static, replica, replica, steps, rows, sure).source == "clock"
    # a clock within its noise: the model decides, the clock's reading reported beside it
    unsure = probes_reading(counts, np.array([-5e-6, 9e-6, -5e-6, 9e-6]))
    ev = judge(cost, static, replica, replica, steps, rows, unsure, stalled=1)
    assert ev.source == "model" and ev.saving_s == pytest.approx(4_160e-9)
    assert ev.probes == 4 and ev.clock_s == pytest.approx(2e-6) and ev.stalled_probes == 1
    assert ev.modelled_clock_s == pytest.approx(3_648e-9)
    assert judge(cost, static, replica, replica, steps, rows, None).probes == 0
    assert judge(cost, static, replica, replica, steps[:0], rows[:0], None) is None


def test_probes_come_on_their_cadence_from_the_plans_switch() -> None:
    """Every 5 steps from the switch at offset 2, once a settled step ran: a plan adopted at 11
    is probed after 13, 18, 23 and 28, before the re-plan of 31 reads them; none once the
    clock settled, none past `MAX_PROBES`, none with probing off."""
    due = [s for s in range(11, 40) if probe_due(s, 11, 5, 0, False)]
    assert due == [13, 18, 23, 28, 33, 38]
    assert [s for s in range(0, 20) if probe_due(s, 0, 5, 0, False)] == [2, 7, 12, 17]
    assert not probe_due(13, 11, 5, 0, True)
    assert not probe_due(13, 11, 5, MAX_PROBES, False) and probe_due(
        13, 11, 5, MAX_PROBES - 1, False
    )
    assert not probe_due(13, 11, 0, 0, False)


# -------------------------------------------------------------------- a neighbour's stall
STEADY_US = np.array([0, 2, -1, 1, 0, -2, 1, 0, -1, 2], dtype=float)


def _stalled_probes(counts: np.ndarray) -> Probes:
    """Six probes, each 5 us slower than a clean neighbour (the replicas save 5 us a step), the
    steady steps' periods 1 ms plus `STEADY_US`: their successive differences (2, -3, 2, -1,
    -2, 3, -1, -1, 3) us have median -1 us and median absolute deviation 2 us, so a neighbours'
    difference beyond 3.5 x 1.4826 x 2 = 10.378 us from -1 us is a stall.
    0. neighbours 1 ms and 1 ms: d = 5 us;
    1. the step after stalled by 200 us: |200 + 1| > 10.378, left out;
    2. the step before stalled by 150 us: left out;
    3. neighbours 1 ms and 1 ms - 11 us: |-11 + 1| < 10.378, kept, d = 10.5 us;
    4. one neighbour only: nothing to compare with, kept, d = 5 us;
    5. like 0: d = 5 us.
    Kept: saving 6.375 us, standard error std(d) / 2 = 1.375 us; all six would read -23.25 us."""
    neighbours = [(0, 0), (0, 200), (150, 0), (0, -11), (0,), (0, 0)]  # us over 1 ms
    n = len(neighbours)
    flat = np.array([t for pair in neighbours for t in pair], dtype=float)
    pair_of = np.repeat(np.arange(n), [len(p) for p in neighbours])
    return Probes(
        np.stack([counts] * n), measured_rows(np.full(n, 1e-3 + BUSY + 5 * US)),
        np.stack([counts] * len(flat)), measured_rows(1e-3 + BUSY + flat * US), pair_of,
    )  # fmt: skip


def _steady(counts: np.ndarray, offsets_us: np.ndarray = STEADY_US):
    return np.stack([counts] * len(offsets_us)), measured_rows(1e-3 + BUSY + offsets_us * US)


def test_a_probe_beside_a_stall_is_left_out_by_hand() -> None:
    cost, static, _, counts = replica_case()
    probes = _stalled_probes(counts)
    saving, _ = paired_clock(cost, static, probes)
    assert saving == pytest.approx(-139.5 / 6 * US, abs=1e-12)  # the stall read as a cost
    kept = steady_probes(cost, static, probes, *_steady(counts))
    assert len(kept) == 4
    assert kept.pair_of.tolist() == [0, 0, 1, 1, 2, 3, 3]  # re-indexed with their neighbours
    saving, se = paired_clock(cost, static, kept)
    assert saving == pytest.approx(6.375 * US, abs=1e-12)
    assert se == pytest.approx(1.375 * US, rel=1e-9)
    # too few steady steps, or steps without spread: no probe is judged
    few = _steady(counts, STEADY_US[:MIN_STEADY_DIFFS])
    assert len(steady_probes(cost, static, probes, *few)) == len(probes)
    even = _steady(counts, np.zeros(10))
    assert len(steady_probes(cost, static, probes, *even)) == len(probes)


def test_the_planning_job_judges_the_plan_on_the_steady_probes() -> None:
    """`run_job` with the steady steps as the steps run under the plan: the clock is the four
    kept probes' 6.375 +- 1.375 us, conclusive (t with 3 degrees of freedom), the two stalled
    ones counted; the replicas priced at its ceiling, above what the model says they save:
    `k_replica` 1. Without steady steps to measure a stall against, all six read the stall."""
    _, _, _, counts = replica_case()
    probes = _stalled_probes(counts)
    steady_counts, steady = _steady(counts)
    rows = np.concatenate([np.arange(1, 11)[:, None].astype(float), steady], axis=1)
    job = replica_job(probes, history=steady_counts, fit_counts=steady_counts, fit_rows=rows,
                      settled=np.ones(10, bool))  # fmt: skip
    ev = run_job(job).evidence
    assert ev.source == "clock" and ev.probes == 4 and ev.stalled_probes == 2
    assert ev.saving_s == pytest.approx(6.375 * US, abs=1e-12)
    assert ev.se_s == pytest.approx(1.375 * US, rel=1e-9) and ev.conclusive
    assert ev.as_dict()["stalled_probes"] == 2
    assert run_job(job).fit.k_replica == 1.0
    unfiltered = run_job(replica_job(probes)).evidence  # 6 steps of 1 ms: no spread
    assert unfiltered.probes == 6 and unfiltered.clock_s == pytest.approx(-139.5 / 6 * US)


# -------------------------------------------------------------------- replicas priced by it
def test_replicas_are_priced_at_what_the_paired_clock_measured_them_to_cost() -> None:
    """`replica_scale`: the replica saves B = 4,160 ns of busy, its Trans + Agg T = 512 ns; a
    clock of 2,112 ns means it cost 2,048 ns = 4 T; a clock above B - T leaves 1; one that
    measured it 5 us slower, (4,160 + 5,000) / 512."""
    cost, static, replica, counts = replica_case()

    def at(clock_s: float) -> Probes:
        return probes_reading(counts, np.full(4, clock_s))

    assert replica_scale(cost, replica, at(2_112e-9), 2_112e-9) == pytest.approx(4.0)
    assert replica_scale(cost, replica, at(4e-6), 4e-6) == 1.0
    assert replica_scale(cost, replica, at(-5e-6), -5e-6) == pytest.approx(9_160 / 512)
    assert replica_scale(cost, static, at(-5e-6), -5e-6) == 1.0  # no Trans to price


def test_replicas_are_priced_dearer_only_by_what_the_clock_shows_beyond_its_noise() -> None:
    """A calibrating job with 4 probes reading 1,912 and 2,312 ns in turn: mean 2,112 ns,
    standard error sqrt(4 x 200^2 / 3) / 2 = 115.47 ns; replicas priced at the clock's ceiling
    2,112 + 3.182 x 115.47 ns: k_replica = (4,160 - 2,479.4) / 512 = 3.28, and the fitted
    cluster's transfers that much dearer. A clock as wide as its mean proves nothing: 1. The
    next job without a clock keeps the fit's k_replica; with calibration off it is 1."""
    _, _, _, counts = replica_case()
    noisy = probes_reading(counts, np.array([1_912e-9, 2_312e-9] * 2))
    result = run_job(replica_job(noisy, calibrate=True))
    se = np.sqrt(4 * 200.0**2 / 3) / 2
    assert result.evidence.clock_se_s == pytest.approx(se * 1e-9)
    k = (4_160 - (2_112 + 3.182 * se)) / 512
    assert result.fit.k_replica == pytest.approx(k)
    prior = replica_job().prior
    assert result.cluster.host.transfer_scale == pytest.approx(k * prior.host.transfer_scale)
    wide = probes_reading(counts, np.array([1_112e-9, 3_112e-9] * 2))
    assert run_job(replica_job(wide)).fit.k_replica == 1.0
    again = run_job(replica_job(probes=None, previous=result.fit))
    assert again.fit.k_replica == pytest.approx(k)
    assert run_job(replica_job(noisy, calibrate=False)).fit.k_replica == 1.0
