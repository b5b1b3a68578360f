"""What a Balancer learned survives a checkpoint (`Planning.learned_state`).

The reference is the uninterrupted run: a real one-rank Balancer is saved with
`checkpoint.snapshot`, through `torch.save` and a `weights_only` load as `poise.pt` is read,
restored with `restore_plan`, and requests the same jobs as the saved one going on; one resumed
without its state re-learns it. A malformed state is one error naming the file and the entry,
before anything changes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from poise.core.errors import ConfigError
from poise.runtime.selfcal.fit import Fit, cluster_of
from tests.helpers import one_rank_balancer, one_rank_steps, spy_jobs


def _through_torch(value):
    """`value` after `torch.save` and a `weights_only` load, as `checkpoint.read_meta` reads."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


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


def _lived(balancer) -> None:
    """A run's worth of learning: a refutation halved the replicas' ratio and backed the
    re-plans off, switches measured, a fit, a carried pattern."""
    planning = balancer.planning
    planning.controller.ratio["replicas"] = 0.5
    planning.controller.skip, planning.controller.next_backoff = 2, 4
    planning.controller.promised_s = None
    planning.switch_price.record(0.030, 0.010, 0.024)
    planning.fit = Fit(k_compute=1.7, k_transfer=2.5, rows=12, k_replica=1.2)
    planning.pattern = (4, 37)


def test_a_checkpoint_keeps_what_the_balancer_learned() -> None:
    from poise.train import checkpoint as ck

    model, opt, balancer = one_rank_balancer(replan_every=2, plan_lag=0)
    one_rank_steps(model, opt, balancer, 4)
    _lived(balancer)
    payload = _through_torch(ck.snapshot(balancer, step=4, data_position=64))
    payload["path"] = "run/checkpoints/step-00000004"
    saved = balancer.planning.learned_state()
    assert payload["balancer"]["learned"] == saved
    went_on = spy_jobs(balancer, lambda job, at: (at, job.replicas, job.held_before))
    one_rank_steps(model, opt, balancer, 12)
    balancer.close()
    assert went_on and went_on[0][0] == 10  # re-plans 6 and 8 backed off

    model, opt, resumed = one_rank_balancer(replan_every=2, plan_lag=0)
    assert ck.restore_plan(resumed, payload)
    assert resumed.planning.learned_state() == saved
    assert resumed.planning.fitted_cluster == cluster_of(resumed.cluster, resumed.planning.fit)
    jobs = spy_jobs(resumed, lambda job, at: (at, job.replicas, job.held_before))
    one_rank_steps(model, opt, resumed, 12)
    resumed.close()
    assert [j[:2] for j in jobs] == [j[:2] for j in went_on] and jobs[0] == went_on[0]

    model, opt, forgot = one_rank_balancer(replan_every=2, plan_lag=0)
    older = dict(payload, balancer={k: v for k, v in payload["balancer"].items() if k != "learned"})
    assert ck.restore_plan(forgot, older)  # a checkpoint without the state: a fresh run's
    assert forgot.planning.controller.skip == 0 and forgot.planning.pattern is None
    jobs = spy_jobs(forgot, lambda job, at: (at, job.replicas, job.held_before))
    one_rank_steps(model, opt, forgot, 12)
    forgot.close()
    assert jobs != went_on and jobs[0][0] == 6


def test_a_resumed_balancer_keeps_its_adapted_lag_at_least_this_runs_plan_lag() -> None:
    from poise.train import checkpoint as ck

    model, opt, balancer = one_rank_balancer(replan_every=4, plan_lag=1)
    one_rank_steps(model, opt, balancer, 4)
    balancer.planning.lag = 3
    payload = ck.snapshot(balancer, step=4, data_position=0)
    balancer.close()
    # a lag longer than the interval is kept (the planner stretches it); plan_lag 0 stays 0
    for replan_every, plan_lag, lag in ((4, 1, 3), (2, 1, 3), (4, 4, 4), (4, 0, 0)):
        model, opt, resumed = one_rank_balancer(replan_every=replan_every, plan_lag=plan_lag)
        assert ck.restore_plan(resumed, payload)
        assert resumed.planning.lag == lag
        resumed.close()


def test_a_malformed_learned_state_is_one_checkpoint_error_naming_the_file() -> None:
    from poise.train import checkpoint as ck

    model, opt, balancer = one_rank_balancer(replan_every=2, plan_lag=0)
    one_rank_steps(model, opt, balancer, 4)
    _lived(balancer)
    payload = ck.snapshot(balancer, step=4, data_position=0)
    balancer.close()
    payload["path"] = "run/checkpoints/step-00000004"
    learned = payload["balancer"]["learned"]
    bad = [
        ({"lag": -1}, "balancer.lag"),
        ({"pattern": [3]}, "pattern"),
        ({"fit": {"k_compute": 1.0}}, "fit"),
        ({"control": {}}, "control"),
        ({"control": {**learned["control"], "skip": 99}}, "skip"),
        ({"switch": {**learned["switch"], "k_switch": "1"}}, "switch.k_switch"),
        ({"extra": 0}, "balancer.learned"),
    ]
    for change, field in bad:
        model, opt, fresh = one_rank_balancer(replan_every=2, plan_lag=0)
        broken = dict(payload, balancer=dict(payload["balancer"]))
        broken["balancer"]["learned"] = learned | change
        before = fresh.planning.learned_state()
        with pytest.raises(ck.CheckpointError) as err:
            ck.restore_plan(fresh, broken)
        assert err.value.source == "run/checkpoints/step-00000004/poise.pt"
        assert err.value.field == field, change
        assert len(fresh.window) == 0 and fresh.planning.learned_state() == before  # untouched
        fresh.close()


def test_a_resumed_balancer_backtests_its_last_forecast_on_the_restored_window() -> None:
    """Saved at step 5, after the job of step 4: the resumed Balancer's job of step 6 prices
    that job's plan (`last_forecast`, kept in the checkpoint) on the window's rows since step 4,
    the restored one included, as the uninterrupted run's job does."""
    from poise.train import checkpoint as ck

    model, opt, balancer = one_rank_balancer(replan_every=2, plan_lag=0)
    one_rank_steps(model, opt, balancer, 5)
    since, forecast = balancer.planning.last_forecast
    payload = _through_torch(ck.snapshot(balancer, step=5, data_position=0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    went_on = spy_jobs(balancer, lambda job, _: job)
    one_rank_steps(model, opt, balancer, 1)
    balancer.close()

    model, opt, resumed = one_rank_balancer(replan_every=2, plan_lag=0)
    model.load_state_dict(state)
    assert ck.restore_plan(resumed, payload)
    assert resumed.planning.last_forecast[0] == since == 4
    assert resumed.planning.last_forecast[1].digest() == forecast.digest()
    jobs = spy_jobs(resumed, lambda job, _: job)
    one_rank_steps(model, opt, resumed, 1)
    resumed.close()
    assert len(jobs) == len(went_on) == 1
    (plan, cut), (plan_then, cut_then) = jobs[0].last, went_on[0].last
    assert plan.digest() == plan_then.digest() and cut == cut_then == len(jobs[0].history) - 2
    # the restored row (step 5) alike; step 6's inputs are the new process's random draws
    np.testing.assert_array_equal(jobs[0].history[cut], went_on[0].history[cut])
