"""What a Balancer learned survives a checkpoint (`poise.runtime.learned_state`).

The reference is the uninterrupted run: a guard given back its state decides every later event
as the guard that went on would; a fresh one (what a resumed run had before) does not. A real
one-rank Balancer is saved with `checkpoint.snapshot`, through `torch.save` and a
`weights_only` load as `poise.pt` is read, restored with `restore_plan`, and its next planning
job plans homes only as the refuted run's would. A malformed state is one error naming the
file and the entry, before anything changes.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from poise.core.errors import ConfigError
from poise.runtime.guard import LEARNED, SwitchGuard
from poise.runtime.selfcal.fit import Fit, cluster_of
from poise.runtime.verdict import Verdict
from tests.test_forecast_backtest import _gain
from tests.test_runtime_balancer import _one_rank_balancer, _one_rank_steps, _spy_jobs

# the paired clock measured 4 ms a step lost where the model said 15 saved: trust 0
REFUTING = Verdict(1.0, 0.1, 10, wall_saving_s=-0.004, wall_se_s=0.002, probes=4,
                   modelled_clock_s=0.015)  # fmt: skip


def _through_torch(value):
    """`value` after `torch.save` and a `weights_only` load, as `checkpoint.read_meta` reads."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _lived(guard: SwitchGuard) -> SwitchGuard:
    """`guard` after a run's worth of events: two switches measured, a promise, a fallback the
    clock refuted, a re-plan that did not pay for its planning."""
    guard.record_switch(0.030, 0.010, migrate_s=0.024)
    guard.record_switch(0.050, 0.020, migrate_s=0.046)
    guard.promised(0.003, from_static=True)
    guard.fell_back(REFUTING)
    guard.planning_idle()
    return guard


def _trace(guard: SwitchGuard, replans: int = 20) -> list[tuple]:
    """What `guard` decides from here on: at each due re-plan, whether it is skipped, the trust,
    and its decision on a candidate with replicas and on one without."""
    replicas = dataclasses.replace(_gain(10e-3, 5e-3), candidate_transfers_s=1e-3)
    homes = _gain(10e-3, 5e-3)
    out = []
    for _ in range(replans):
        guard.replan_due()
        skipped = guard.skip_replan()
        d_rep, d_home = guard.decide(replicas, k_transfer=1.0), guard.decide(homes)
        out.append((skipped, guard.trust, d_rep.adopt, d_rep.switch_s, d_home.adopt))
    guard.fell_back(REFUTING)  # a second refutation doubles the wait
    out += [(guard.skip_replan(), guard.trust) for _ in range(20)]
    return out


def test_a_restored_guard_decides_as_the_uninterrupted_one() -> None:
    went_on = _lived(SwitchGuard(horizon=10, margin=0.2))
    resumed = SwitchGuard(horizon=10, margin=0.2)
    resumed.restore(_through_torch(went_on.state()))
    assert resumed.state() == went_on.state()
    fresh = SwitchGuard(horizon=10, margin=0.2)
    expected = _trace(went_on)
    assert _trace(resumed) == expected
    assert _trace(fresh) != expected  # what a resumed run decided before the state was kept
    assert expected[0][:3] == (True, 0.0, False)  # backing off, replicas refuted


def test_a_guard_state_is_checked_entry_by_entry() -> None:
    good = _lived(SwitchGuard(horizon=10)).state()
    assert set(good) == set(LEARNED)
    cases = [
        ("guard", {k: v for k, v in good.items() if k != "trust"}),
        ("guard", good | {"extra": 1.0}),
        ("guard.trust", good | {"trust": "high"}),
        ("guard.skip", good | {"skip": True}),
        ("guard.k_switch", good | {"k_switch": None}),
    ]
    for field, state in cases:
        guard = SwitchGuard(horizon=10)
        before = guard.state()
        with pytest.raises(ConfigError) as err:
            guard.restore(state, source="run/poise.pt")
        assert err.value.field == field and err.value.source == "run/poise.pt"
        assert guard.state() == before  # nothing set
    missing = {k: v for k, v in good.items() if k != "trust"}
    with pytest.raises(ConfigError, match=r"missing \['trust'\]"):
        SwitchGuard(horizon=10).restore(missing)
    guard = SwitchGuard(horizon=10, max_backoff=2)
    guard.restore(good | {"skip": 7, "next_backoff": 8})  # a run that backed off further
    assert guard.state()["skip"] == 2 and guard.state()["next_backoff"] == 2
    assert good["promised_s"] is not None
    SwitchGuard(horizon=10).restore(good | {"promised_s": None})  # unknown promise: allowed


def test_a_fit_comes_back_from_its_dict_and_prices_on_its_cluster() -> None:
    from poise.runtime.plan_inputs import default_cluster

    fit = Fit(k_compute=2.0, k_transfer=3.0, dispatch_s_per_row=1e-6, rows=40, k_replica=1.5,
              expert_fixed_s=0.004)  # fmt: skip
    again = Fit.from_dict(_through_torch(fit.as_dict()))
    assert again == fit and isinstance(again.rows, int)
    with pytest.raises(ConfigError) as err:
        Fit.from_dict(fit.as_dict() | {"k_compute": "2"}, source="x/poise.pt")
    assert err.value.field == "fit.k_compute" and err.value.source == "x/poise.pt"
    with pytest.raises(ConfigError, match=r"missing \['rows'\]"):
        Fit.from_dict({k: v for k, v in fit.as_dict().items() if k != "rows"})
    prior = default_cluster(2)
    fitted = cluster_of(prior, fit)  # by hand: FLOP/s / 2, transfers x 3 x 1.5, +1 us a row
    assert fitted.peak_flops.fp32 == pytest.approx(prior.peak_flops.fp32 / 2.0)
    assert fitted.host.transfer_scale == pytest.approx(prior.host.transfer_scale * 4.5)
    assert fitted.host.dispatch_fwd_s_per_row == pytest.approx(
        prior.host.dispatch_fwd_s_per_row + 1e-6
    )
    assert cluster_of(prior, Fit()) == prior


def test_a_checkpoint_keeps_what_the_balancer_learned() -> None:
    """A one-rank `auto` Balancer after 4 steps, refuted by the clock (trust 0, re-trial in 5
    re-plans), with a fit and a carried pattern, saved as `poise.pt`; a new Balancer restored
    from it has the same guard state, fit, fitted cluster and flags, and over the next 20
    steps requests the same jobs as the saved Balancer going on (after the fallback's backoff,
    homes only at 10; in full at 20, after the re-trial); one resumed without the state
    plans in full."""
    from poise.train import checkpoint as ck

    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    _one_rank_steps(model, opt, balancer, 4)
    balancer.guard.retrial = 5
    balancer.guard.fell_back(REFUTING)
    balancer.fit = Fit(k_compute=1.7, k_transfer=2.5, rows=12, k_replica=1.2)
    balancer._replicas_timed, balancer._pattern = True, (4, 37)
    payload = _through_torch(ck.snapshot(balancer, step=4, data_position=64))
    payload["path"] = "run/checkpoints/step-00000004"
    saved = balancer.guard.state()
    assert saved["trust"] == 0.0 and saved["retrial_in"] == 5
    went_on = _spy_jobs(balancer)
    _one_rank_steps(model, opt, balancer, 20)
    balancer.close()
    assert went_on == [(10, True), (20, False)]

    model, opt, resumed = _one_rank_balancer(replan_every=2, plan_lag=0)
    assert resumed.guard.trust == 1.0 and resumed._pattern is None  # a fresh run's
    assert ck.restore_plan(resumed, payload)
    assert resumed.guard.state() == saved
    assert resumed.fit == Fit(k_compute=1.7, k_transfer=2.5, rows=12, k_replica=1.2)
    assert resumed.fitted_cluster == cluster_of(resumed.cluster, resumed.fit)
    assert resumed.fitted_cluster.host.transfer_scale == pytest.approx(
        resumed.cluster.host.transfer_scale * 3.0
    )
    assert (resumed._replicas_timed, resumed._pattern) == (True, (4, 37))
    jobs = _spy_jobs(resumed)
    _one_rank_steps(model, opt, resumed, 20)
    resumed.close()
    assert jobs == went_on

    model, opt, forgot = _one_rank_balancer(replan_every=2, plan_lag=0)
    older = dict(payload, balancer={k: v for k, v in payload["balancer"].items() if k != "learned"})
    assert ck.restore_plan(forgot, older)  # a checkpoint from before the state was saved
    assert forgot.guard.state() == SwitchGuard(horizon=2).state()
    jobs = _spy_jobs(forgot)
    _one_rank_steps(model, opt, forgot, 20)
    forgot.close()
    assert jobs != went_on and not any(h for _, h in jobs)


def test_a_resumed_balancer_keeps_its_adapted_lag_at_least_this_runs_plan_lag() -> None:
    from poise.train import checkpoint as ck

    model, opt, balancer = _one_rank_balancer(replan_every=4, plan_lag=1)
    _one_rank_steps(model, opt, balancer, 4)
    balancer.lag = 3
    payload = ck.snapshot(balancer, step=4, data_position=0)
    balancer.close()
    # a lag longer than the interval is kept (the planner stretches it); plan_lag 0 stays 0
    for replan_every, plan_lag, lag in ((4, 1, 3), (2, 1, 3), (4, 4, 4), (4, 0, 0)):
        model, opt, resumed = _one_rank_balancer(replan_every=replan_every, plan_lag=plan_lag)
        assert ck.restore_plan(resumed, payload)
        assert resumed.lag == lag
        resumed.close()


def test_a_malformed_learned_state_is_one_checkpoint_error_naming_the_file() -> None:
    from poise.train import checkpoint as ck

    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    _one_rank_steps(model, opt, balancer, 4)  # the re-plan at 4 idles: the guard backs off
    payload = ck.snapshot(balancer, step=4, data_position=0)
    balancer.close()
    assert payload["balancer"]["learned"]["guard"]["idles"] == 1
    payload["path"] = "run/checkpoints/step-00000004"
    bad = [
        ({"lag": -1}, "balancer.lag"),
        ({"replicas_timed": 1}, "balancer.replicas_timed"),
        ({"pattern": [3]}, "balancer.pattern"),
        ({"replan_phase": -1}, "balancer.replan_phase"),
        ({"replan_phase": 1.5}, "balancer.replan_phase"),
        ({"fit": {"k_compute": 1.0}}, "fit"),
        ({"guard": {}}, "guard"),
        ({"extra": 0}, "balancer.learned"),
    ]
    for change, field in bad:
        model, opt, fresh = _one_rank_balancer(replan_every=2, plan_lag=0)
        broken = dict(payload, balancer=dict(payload["balancer"]))
        broken["balancer"]["learned"] = payload["balancer"]["learned"] | change
        before = fresh.guard.state()
        with pytest.raises(ck.CheckpointError) as err:
            ck.restore_plan(fresh, broken)
        assert err.value.source == "run/checkpoints/step-00000004/poise.pt"
        assert err.value.field == field, change
        assert len(fresh.window) == 0 and fresh._pattern is None  # nothing applied
        assert fresh.guard.state() == before != payload["balancer"]["learned"]["guard"]
        fresh.close()


def test_a_resumed_balancer_backtests_its_last_candidate_on_the_restored_window() -> None:
    """Saved at step 5, after the job of step 4: the resumed Balancer's job of step 6 backtests
    that job's candidate (`_last_candidate`, kept in the checkpoint) on the window's rows since
    step 4, the restored one included, as the uninterrupted run's job does."""
    from poise.train import checkpoint as ck

    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    balancer.guard.skip_replan = lambda: False  # one rank idles: plan at every boundary here
    _one_rank_steps(model, opt, balancer, 5)
    since, candidate = balancer._last_candidate
    payload = _through_torch(ck.snapshot(balancer, step=5, data_position=0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    went_on = _spy_jobs(balancer, lambda job, _: job)
    _one_rank_steps(model, opt, balancer, 1)
    balancer.close()

    model, opt, resumed = _one_rank_balancer(replan_every=2, plan_lag=0)
    resumed.guard.skip_replan = lambda: False
    model.load_state_dict(state)
    assert ck.restore_plan(resumed, payload)
    assert resumed._last_candidate[0] == since == 4
    assert resumed._last_candidate[1].digest() == candidate.digest()
    jobs = _spy_jobs(resumed, lambda job, _: job)
    _one_rank_steps(model, opt, resumed, 1)
    resumed.close()
    assert len(jobs) == len(went_on) == 1
    assert len(jobs[0].backtest_counts) == len(went_on[0].backtest_counts) == 2
    assert jobs[0].backtest_plan.digest() == went_on[0].backtest_plan.digest()
    np.testing.assert_array_equal(jobs[0].backtest_counts[0], went_on[0].backtest_counts[0])


def test_the_replan_phase_survives_a_checkpoint() -> None:
    """A cadence shifted by an `unsettled` refusal (`Balancer(recheck=...)`) is the resumed
    run's: its re-plans fall on the boundaries the uninterrupted run's do; a checkpoint written
    before the phase was kept (no entry) resumes on the unshifted cadence."""
    from poise.train import checkpoint as ck

    _, _, balancer = _one_rank_balancer(replan_every=4, plan_lag=1)
    balancer.replan_phase = 2  # as a refusal shifts it
    payload = _through_torch(ck.snapshot(balancer, step=0, data_position=0))
    balancer.close()
    assert payload["balancer"]["learned"]["replan_phase"] == 2
    _, _, resumed = _one_rank_balancer(replan_every=4, plan_lag=1)
    assert ck.restore_plan(resumed, payload)
    assert resumed.replan_phase == 2
    assert [s for s in range(1, 12) if resumed.replan_due_at(s)] == [2, 6, 10]
    resumed.close()
    older = dict(payload, balancer=dict(payload["balancer"]))
    older["balancer"]["learned"] = {
        k: v for k, v in payload["balancer"]["learned"].items() if k != "replan_phase"
    }
    _, _, resumed = _one_rank_balancer(replan_every=4, plan_lag=1)
    assert ck.restore_plan(resumed, older)
    assert resumed.replan_phase == 0
    assert [s for s in range(1, 12) if resumed.replan_due_at(s)] == [4, 8]
    resumed.close()
