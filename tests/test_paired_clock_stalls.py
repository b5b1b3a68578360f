"""The paired clock leaves out a probe whose neighbours straddle a stall of the machine.

By hand on `tests.test_runtime_balancer._replica_case` (every step routes the same counts, so
the static layout's busy seconds are one constant, 27,840 ns, and a step's residual is its
period less that constant): the steps run under the replicas have periods 1 ms plus
(0, 2, -1, 1, 0, -2, 1, 0, -1, 2) us. Their successive differences are (2, -3, 2, -1, -2, 3,
-1, -1, 3) us, median -1 us, median absolute deviation from it 2 us, so the step-to-step
spread is 1.4826 x 2 = 2.9652 us and a neighbours' difference goes beyond 3.5 x 2.9652 =
10.378 us from -1 us.

Six probes, each 5 us slower than a clean neighbour (the replicas save 5 us a step):
0. neighbours 1 ms and 1 ms: d = 5 us;
1. the step after stalled by 200 us: |200 + 1| > 10.378, left out (it alone reads -95 us);
2. the step before stalled by 150 us: |-150 + 1| > 10.378, left out (-70 us);
3. neighbours 1 ms and 1 ms - 11 us: |-11 + 1| < 10.378, kept (though 11 us from 0), d = 5 +
   5.5 = 10.5 us;
4. one neighbour only (1 ms): nothing to compare it with, kept, d = 5 us;
5. like 0: d = 5 us.
Kept d = (5, 10.5, 5, 5) us: saving 6.375 us, standard error std(d) / 2 = 2.75 / 2 = 1.375 us.
All six would read (5 - 95 - 70 + 10.5 + 5 + 5) / 6 = -23.25 us: the replicas measured slower
than static, the stall's doing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.test_runtime_balancer import _replica_case, _replica_job

US = 1e-6
STEADY_US = np.array([0, 2, -1, 1, 0, -2, 1, 0, -1, 2], dtype=float)


def _rows(periods_s: np.ndarray) -> np.ndarray:
    from poise.runtime.selfcal import fit as selfcal

    out = np.zeros((len(periods_s), len(selfcal.MEASURED)))
    out[:, selfcal.PERIOD] = periods_s
    return out


def _stalled_probes(counts: np.ndarray):
    from poise.runtime.paired_clock import Probes

    busy = 27_840e-9  # the static layout's busy seconds on `counts` (_replica_case)
    neighbours = [(0, 0), (0, 200), (150, 0), (0, -11), (0,), (0, 0)]  # us over 1 ms
    n = len(neighbours)
    flat = np.array([t for pair in neighbours for t in pair], dtype=float)
    pair_of = np.repeat(np.arange(n), [len(p) for p in neighbours])
    return Probes(
        np.stack([counts] * n), _rows(np.full(n, 1e-3 + busy + 5 * US)),
        np.stack([counts] * len(flat)), _rows(1e-3 + busy + flat * US), pair_of,
    )  # fmt: skip


def _steady(counts: np.ndarray, offsets_us: np.ndarray = STEADY_US):
    busy = 27_840e-9
    return np.stack([counts] * len(offsets_us)), _rows(1e-3 + busy + offsets_us * US)


def test_a_probe_beside_a_stall_is_left_out_by_hand() -> None:
    from poise.runtime.paired_clock import paired_clock, steady_probes

    cost, static, _, counts = _replica_case()
    probes = _stalled_probes(counts)
    saving, _ = paired_clock(cost, static, probes)
    assert saving == pytest.approx(-139.5 / 6 * US, abs=1e-12)  # the stall read as a cost
    kept = steady_probes(cost, static, probes, *_steady(counts))
    assert len(kept) == 4
    assert kept.pair_of.tolist() == [0, 0, 1, 1, 2, 3, 3]  # re-indexed, neighbours kept with them
    saving, se = paired_clock(cost, static, kept)
    assert saving == pytest.approx(6.375 * US, abs=1e-12)
    assert se == pytest.approx(1.375 * US, rel=1e-9)


def test_too_few_or_too_even_steady_steps_leave_every_probe() -> None:
    """Five steady steps give four differences, under `MIN_STEADY_DIFFS`; steps of one period
    have no spread to measure a stall against. Either way no probe is judged."""
    from poise.runtime.paired_clock import MIN_STEADY_DIFFS, steady_probes

    cost, static, _, counts = _replica_case()
    probes = _stalled_probes(counts)
    few = _steady(counts, STEADY_US[:MIN_STEADY_DIFFS])
    assert len(steady_probes(cost, static, probes, *few)) == len(probes)
    even = _steady(counts, np.zeros(10))
    assert len(steady_probes(cost, static, probes, *even)) == len(probes)


def test_the_planning_job_judges_the_plan_on_the_steady_probes() -> None:
    """`run_job` with the steady steps as the job's balanced rows: the verdict's clock is the
    four kept probes' 6.375 +- 1.375 us, conclusive (6.375 - 3.182 x 1.375 > 0, t with 3 degrees
    of freedom), so the replica plan pays; the replicas are priced from that clock too (its
    ceiling, 10.75 us, is above what the model says they save, 4,160 - 512 ns: `k_replica` 1).
    Judged on all six probes the clock would read the stall: -23.25 us a step."""
    from poise.runtime.planning_job import run_job
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import plan_pays

    _, _, _, counts = _replica_case()
    probes = _stalled_probes(counts)
    steady_counts, steady = _steady(counts)
    rows = np.zeros((len(steady), 1 + len(selfcal.MEASURED)))
    rows[:, 0] = np.arange(1, len(steady) + 1)
    rows[:, 1:] = steady
    job = replace(_replica_job(probes), balanced_counts=steady_counts, balanced_rows=rows)
    result = run_job(job)
    paid = result.paid
    assert paid is not None and paid.probes == 4
    assert paid.stalled_probes == 2 and paid.as_dict()["stalled_probes"] == 2  # as logged
    assert paid.wall_saving_s == pytest.approx(6.375 * US, abs=1e-12)
    assert paid.wall_se_s == pytest.approx(1.375 * US, rel=1e-9)
    assert paid.wall_saving_s - paid.z * paid.wall_se_s > 0  # the clock alone says it pays
    assert plan_pays(paid) and result.fit.k_replica == 1.0
    unfiltered = run_job(_replica_job(probes))  # no steady rows to measure a stall against
    assert unfiltered.paid is not None and unfiltered.paid.probes == 6
    assert unfiltered.paid.stalled_probes == 0
    assert unfiltered.paid.wall_saving_s == pytest.approx(-139.5 / 6 * US, abs=1e-12)
