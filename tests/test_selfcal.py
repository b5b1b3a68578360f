"""Self-calibration (`poise.runtime.selfcal.fit`) and the per-step pricing it fits against
(`poise.cost.per_step`), by hand on small cases."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.cost import per_step
from poise.cost.model import CostModel
from poise.runtime.selfcal import fit as selfcal
from tests.helpers import replica_case


def test_per_step_pricing_matches_a_loop_over_the_steps() -> None:
    """`live_parts` and `predicted_phases` price all steps in one call (the steps' layers end to
    end); the reference prices each step on its own, as a simulator would: they must agree, on
    a plan with replicas, per-step token splitting, host costs and ranks that share cores."""
    import dataclasses

    from poise.cost.host import dispatch_rows
    from poise.runtime.plan_inputs import default_cluster
    from tests.helpers import toy_spec

    base = default_cluster(4)
    cluster = dataclasses.replace(base, host=dataclasses.replace(base.host, shared_cores=2.0))
    cluster = selfcal.scaled_cluster(cluster, 1.3, 5.0, 1e-7)  # fitted: host work per row too
    L, D, E = 3, 4, 8
    spec = toy_spec(experts=E, layers=L)
    cost = CostModel(cluster, spec)
    p = Placement.from_homes(np.tile(np.arange(E) % D, (L, 1)), D, 3)
    p.copies[0, 1, 0] = p.copies[2, 3, 5] = p.copies[2, 0, 6] = 1
    plan = Plan("r", p, Assignment.even(p).with_split(True), transfers_between(None, p, spec))
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 60, size=(5, L, D, E)).astype(float)  # [S, L, D, E]
    live = per_step.live_parts(cost, plan, counts)
    pred = per_step.predicted_phases(cost, plan, counts)
    pricer = cost.pricer(p, plan.assignment)
    for s, row in enumerate(counts):
        ph, device_load = pricer.phases(row)
        busy, transfers = per_step.busy_and_transfers(ph)
        assert live[s] == pytest.approx([busy, transfers], rel=1e-12)
        per_device = dispatch_rows(row, device_load)  # [L, D]; 4 ranks sharing 2 cores
        rows = np.maximum(per_device.max(axis=1), per_device.sum(axis=1) / 2.0).sum()
        expected = [ph.expert_fwd_s.sum(), (ph.dispatch_s + ph.combine_s).sum(),
                    (ph.trans_s + ph.agg_s).sum(), rows]  # fmt: skip
        assert pred[s] == pytest.approx(expected, rel=1e-12)
    assert live[:, 1].min() > 0 and ph.dispatch_host_fwd_s.sum() > 0  # every term is in play
    assert per_step.live_parts(cost, plan, counts[:0]).shape == (0, 2)


def test_self_calibration_fits_the_scales() -> None:

    assert selfcal.fit_scale(np.array([2.0, 4.0]), np.array([1.0, 2.0]), 0.0) == 2.0
    pulled = selfcal.fit_scale(np.array([2.0, 4.0]), np.array([1.0, 2.0]), 4.0)
    assert 1.0 < pulled < 2.0  # the preset's prior pulls towards 1
    assert selfcal.fit_scale(np.array([]), np.array([]), 4.0) == 1.0
    # one row for all ranks: the slowest rank's seconds, but the all-to-all's of the rank that
    # reached it last (rank 1 here, its experts 3 s; rank 0 waited 2 s more in it)
    per_rank = np.zeros((2, len(selfcal.MEASURED)))
    per_rank[:, selfcal.EXPERTS] = [1.0, 3.0]
    per_rank[:, selfcal.A2A] = [2.5, 0.5]
    # Agg and the boundary's collectives: rank 0 (backward 2 s shorter) waited in them for rank 1
    per_rank[:, selfcal.TRANSFERS] = [2.2, 0.2]
    per_rank[:, selfcal.BOUNDARY] = [0.1, 0.3]
    per_rank[:, selfcal.PERIOD] = [7.0, 7.1]
    row = selfcal.across_ranks(per_rank)
    assert row[selfcal.EXPERTS] == 3.0 and row[selfcal.A2A] == 0.5
    assert row[selfcal.TRANSFERS] == 0.2 and row[selfcal.BOUNDARY] == 0.1
    assert row[selfcal.PERIOD] == 7.1
    assert selfcal.exposed_transfers_s(row[None, :])[0] == pytest.approx(0.3)
    from tests.helpers import toy_cluster

    prior = toy_cluster(2, bw=1e9, flops=1e9, lat=1e-6)
    fitted = selfcal.scaled_cluster(prior, 2.0, 4.0, 1e-7)
    assert fitted.gemm_flops("fp32") == prior.gemm_flops("fp32") / 2
    assert fitted.host.transfer_scale == 4.0 and fitted.intra_node == prior.intra_node
    assert fitted.host.dispatch_fwd_s_per_row == fitted.host.dispatch_bwd_s_per_row == 1e-7


def test_self_calibration_fits_compute_transfers_and_dispatch_by_hand() -> None:
    """`replica_case`'s replica plan, modelled per step: expert forward 60 * 128 FLOP / 1e9 =
    7,680 ns (d0's 60 tokens), dispatch + combine 2 * 20 * 16 B / 1e9 = 640 ns, Trans + Agg
    512 ns, the busiest dispatcher 100 rows (d0: 40 routed + 60 computed; d1: 60 + 40). Steps
    measured at 2x the compute, 3x the transfers and the link plus 100 ns per row: without a
    prior the fit recovers exactly 2, 3 and 100 ns, and the fitted cluster prices the plan's
    transfers at 3 * 512 ns, its all-to-all at the link's 640 ns and its dispatcher at 100 ns
    per row."""
    from poise.runtime.selfcal.fit import A2A, BOUNDARY, EXPERTS, TRANSFERS

    cost, static, replica, counts = replica_case()
    steps = np.stack([counts, 2 * counts, 3 * counts])  # [S=3, L, D, E]
    scale = np.array([1.0, 2.0, 3.0])
    measured = np.zeros((3, len(selfcal.MEASURED)))
    measured[:, EXPERTS] = 2 * 7_680e-9 * scale
    measured[:, TRANSFERS] = 3 * 512e-9 - 100e-9  # Trans + Agg do not grow with tokens
    measured[:, BOUNDARY] = 100e-9
    measured[:, A2A] = (640e-9 + 100e-9 * 100) * scale
    fitted, fit = selfcal.fit_cluster(cost.cluster, cost, replica, steps, measured, prior_rows=0)
    assert fit.k_compute == pytest.approx(2.0)
    assert fit.k_transfer == pytest.approx(3.0)
    assert fit.dispatch_s_per_row == pytest.approx(100e-9)
    assert fitted.host.transfer_scale == pytest.approx(3.0)
    assert fitted.intra_node == cost.cluster.intra_node
    assert fitted.host.dispatch_fwd_s_per_row == pytest.approx(100e-9)
    phases, _ = CostModel(fitted, cost.spec).phases(replica.placement, replica.assignment, counts)
    assert float((phases.trans_s + phases.agg_s).sum()) == pytest.approx(3 * 512e-9)
    assert float((phases.dispatch_s + phases.combine_s).sum()) == pytest.approx(640e-9)
    assert float(phases.dispatch_host_fwd_s.sum()) == pytest.approx(100 * 100e-9)
    # A step whose boundary carried the switch is left out of the transfer fit; a plan without
    # replicas keeps the previous fit's k_transfer (and the prior pulls towards it).
    spiked = np.concatenate([measured, measured[-1:]])
    spiked[-1, BOUNDARY] = 1e-3
    _, fit2 = selfcal.fit_cluster(
        cost.cluster, cost, replica, np.concatenate([steps, steps[-1:]]), spiked,
        prior_rows=0, settled=np.array([True, True, True, False]),
    )  # fmt: skip
    assert fit2.k_transfer == pytest.approx(3.0)
    _, kept = selfcal.fit_cluster(cost.cluster, cost, static, steps, measured, previous=fit)
    assert kept.k_transfer == pytest.approx(3.0)


def test_device_compute_is_every_devices_expert_forward_by_hand() -> None:
    """`replica_case`: 128 FLOP a token at 1e9 FLOP/s. Static: d0 computes 30 tokens (e0:
    10 + 20), d1 70 -> 3,840 and 8,960 ns; the replica plan: d0 60 (its 30 e1-tokens stay),
    d1 40 -> 7,680 and 5,120 ns; summed over the layers of each step, the steps' counts scaled."""

    cost, static, replica, counts = replica_case()
    steps = np.stack([counts, 2 * counts])
    assert per_step.device_compute(cost, static, steps) == pytest.approx(
        np.array([[3_840e-9, 8_960e-9], [7_680e-9, 17_920e-9]])
    )
    assert per_step.device_compute(cost, replica, steps)[0] == pytest.approx([7_680e-9, 5_120e-9])
    # the slowest device's is the phase's expert forward
    phases, _ = cost.phases(replica.placement, replica.assignment, counts)
    assert float(phases.expert_fwd_s[0]) == pytest.approx(7_680e-9)


def test_marginal_compute_fit_ignores_per_call_seconds_and_drift() -> None:
    """Every rank's expert seconds = 2 x the model's for its rows + 3 s a step that no row
    accounts for + the machine's drift (a step's seconds all move alike): the marginal fit
    recovers k = 2 and the 3 s exactly, where a fit through the origin (the slowest rank's
    seconds over the model's) reads the fixed seconds as rows (k > 2). With noise the weight of
    each side follows its standard error: little spread between ranks leaves the centre nearly
    as it was; wide spread overrules it (inverse-variance weights, computed by hand here)."""

    rng = np.random.default_rng(0)
    m = rng.uniform(1.0, 10.0, size=(12, 3))  # [S, D] model seconds
    drift = rng.uniform(0.0, 2.0, size=(12, 1))
    y = 2.0 * m + 3.0 + drift
    k, se, fixed = selfcal.fit_marginal(y, m, centre=1.0, centre_se=float("inf"))
    assert k == pytest.approx(2.0) and se < 1e-6
    assert fixed == pytest.approx(3.0 + float(drift.mean()))
    through_origin = selfcal.fit_scale(y.max(axis=1), m.max(axis=1), 0.0)
    assert through_origin > 2.2
    # a centre known exactly wins; one not known at all leaves the data's slope
    assert selfcal.fit_marginal(y + rng.normal(0, 0.1, y.shape), m, 5.0, 1e-9)[0] == (
        pytest.approx(5.0)
    )
    # by hand: within-step deviations, residual variance over n - S - 1 degrees of freedom
    noisy = y + rng.normal(0.0, 0.5, y.shape)
    dm, dy = m - m.mean(1, keepdims=True), noisy - noisy.mean(1, keepdims=True)
    k_w = float((dy * dm).sum() / (dm * dm).sum())
    resid = dy - k_w * dm
    se_w = float(np.sqrt((resid**2).sum() / (m.size - 12 - 1) / (dm * dm).sum()))
    want = (k_w / se_w**2 + 1.0 / 0.05**2) / (1 / se_w**2 + 1 / 0.05**2)
    got, got_se, _ = selfcal.fit_marginal(noisy, m, centre=1.0, centre_se=0.05)
    assert got == pytest.approx(want) and got_se == pytest.approx((1 / se_w**2 + 400) ** -0.5)
    # ranks all alike: nothing to fit, the centre stands
    flat = np.ones((5, 2))
    assert selfcal.fit_marginal(3.0 * flat, flat, 1.5, 0.2)[:2] == (1.5, 0.2)


def test_fit_cluster_takes_the_marginal_compute_from_every_ranks_seconds() -> None:
    """`replica_case`'s two plans, every rank's expert seconds 2 x its modelled forward + 5 us
    a step: `k_compute` 2 and `expert_fixed_s` 5 us from the ranks' own seconds (the slowest
    rank's alone, through the origin, fitted more); the next fit starts from it, and on steps
    whose ranks computed alike (no spread: nothing to fit) keeps it."""

    cost, static, _, counts = replica_case()
    steps = np.stack([counts, 2 * counts, 3 * counts, 4 * counts])
    rank = 2.0 * per_step.device_compute(cost, static, steps) + 5e-6
    measured = np.zeros((4, len(selfcal.MEASURED)))
    measured[:, selfcal.EXPERTS] = rank.max(axis=1)
    _, fit = selfcal.fit_cluster(cost.cluster, cost, static, steps, measured, rank_experts=rank)
    assert fit.k_compute == pytest.approx(2.0) and fit.expert_fixed_s == pytest.approx(5e-6)
    assert fit.gemm_flops == pytest.approx(cost.cluster.gemm_flops("fp32") / 2.0)
    _, old = selfcal.fit_cluster(cost.cluster, cost, static, steps, measured, prior_rows=0)
    assert old.k_compute > 2.1
    alike = np.full_like(steps, 20.0)  # every device computes 40 tokens: the previous fit stands
    _, kept = selfcal.fit_cluster(
        cost.cluster, cost, static, alike, measured, previous=fit, rank_experts=rank
    )
    assert kept.k_compute == pytest.approx(2.0)
