"""The simulator: stale plans cost more, scaling keeps proportions, planning time is charged,
the online predictor matches the batch one, bad input fails with one clear error."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from poise.core.cluster import HostCosts
from poise.core.errors import ConfigError
from poise.core.presets import get_cluster
from poise.cost.model import CostModel
from poise.cost.schedule import Schedule
from poise.plan.predict import OnlineForecast, Predictor
from poise.sim.scaling import ScaledTrace, source_rows
from poise.sim.simulator import simulate
from poise.trace.generate import generate

from .helpers import toy_cluster, toy_spec


def drift_trace(steps: int = 24, devices: int = 8, experts: int = 8, seed: int = 3):
    return generate(
        "drift",
        steps=steps,
        layers=2,
        devices=devices,
        experts=experts,
        top_k=2,
        tokens_per_device=512,
        seed=seed,
        s=1.5,
        rate=0.15,
    )


def test_stale_plan_costs_more_than_fresh_on_drift() -> None:
    trace = drift_trace()
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)

    def mean_step(replan_every: int) -> float:
        result = simulate(
            trace, cluster, spec, ["eplb"], "sync", replan_every, "last", count_planning=False
        )
        return result.runs["eplb"].step_s[1:].mean()

    fresh, stale = mean_step(1), mean_step(100)
    assert fresh < stale


def test_each_step_priced_on_actual_loads_with_breakdown() -> None:
    trace = drift_trace(steps=6)
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    result = simulate(trace, cluster, spec, ["static", "auto"], "sync", 2, "ema")
    static, auto = result.runs["static"], result.runs["auto"]
    assert static.layer_s.shape == (6, 2) and static.phases["dispatch_s"].shape == (6, 2)
    # Planning is charged only at re-planning steps (0, 2, 4), and the step time includes it.
    assert np.all(auto.plan_s[[1, 3, 5]] == 0) and np.all(auto.plan_s[[0, 2, 4]] > 0)
    assert np.allclose(auto.step_s, auto.layer_s.sum(axis=1) + auto.plan_s)
    assert result.scaling.startswith("trace replayed as recorded")


def test_prophet_schedule_hides_planning_under_all_to_all() -> None:
    trace = drift_trace(steps=4)
    # A slow network: each step's all-to-all takes far longer than planning.
    cluster = toy_cluster(4, 2, bw=1e6, inter_bw=1e6, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    hidden = simulate(trace, cluster, spec, ["prophet"], "prophet", 2, "ema")
    assert np.all(hidden.runs["prophet"].plan_s == 0)
    assert np.all(hidden.runs["prophet"].plan_wall_s[[0, 2]] > 0)


def background_reference(step_s: np.ndarray, wall: dict[int, float], every: int):
    """The background planning rule written out naively: a re-plan is due every `every` steps;
    one due while the last plan is still being made (its `wall` seconds not yet covered by the
    steps run since its request) is skipped; a plan takes effect at the first step boundary
    after its seconds have run. Returns (the steps that planned, those skipped, each plan's
    delay from request to effect)."""
    planned, skipped, delays = [], [], []
    pending: tuple[int, float] | None = None  # (requested at, seconds still to run)
    for s in range(len(step_s)):
        if pending is not None and pending[1] <= 0:
            delays.append(s - pending[0])
            pending = None
        if s % every == 0:
            if pending is None:
                planned.append(s)
                pending = (s, wall[s])
            else:
                skipped.append(s)
        if pending is not None:
            pending = (pending[0], pending[1] - step_s[s])
    return planned, skipped, delays


def test_background_planning_applies_each_plan_when_it_is_ready() -> None:
    """A planner beside training: step 0 runs the static placement; a plan made at step s
    prices from the first step after it is ready; nothing is charged; a re-plan due while the
    last plan is still being made is skipped (training never waits for the planner)."""
    trace = drift_trace(steps=6)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    # steps of modelled seconds: every plan (ms of real planning) is ready by the next step
    slow = toy_cluster(4, 2, bw=5e6, inter_bw=2e5, lat=1e-3, flops=1e9)
    args = (trace, slow, spec, ["static", "eplb"], "sync", 2, "ema")
    inline = simulate(*args, count_planning=False)
    background = simulate(*args, count_planning=False, background_planning=True)
    bg, il = background.runs["eplb"], inline.runs["eplb"]
    np.testing.assert_allclose(bg.layer_s[0], background.runs["static"].layer_s[0])
    # Plans are made from the same forecasts; the one made at step 2 is in force at 3 and 4
    # in the background replay (paying its migration at 3), at 2 and 3 inline.
    recurring_bg = bg.layer_s - bg.phases["migrate_s"]
    np.testing.assert_allclose(recurring_bg[3], il.layer_s[3])
    np.testing.assert_allclose(bg.phases["migrate_s"][3], il.phases["migrate_s"][2])
    assert not np.allclose(bg.layer_s[2], il.layer_s[2])
    assert np.all(bg.plan_s == 0) and np.all(bg.plan_charge_s == 0)  # always ready in time
    # each plan in force from the step after its request (made at 0, 2, 4), inline at once
    assert bg.plan_delays == [1, 1, 1] and il.plan_delays == [0, 0, 0]
    assert bg.skipped_replans == [] and il.skipped_replans == []
    # Steps of nanoseconds: no plan is ready before the next re-plan, which is skipped; the
    # plan of step 0 never takes effect in 6 steps, and no step is charged for it.
    fast = toy_cluster(4, 2, bw=5e12, inter_bw=2e12, lat=1e-9, flops=1e18)
    res = simulate(
        trace, fast, spec, ["static", "auto"], "sync", 2, "ema", background_planning=True
    )
    auto, static = res.runs["auto"], res.runs["static"]
    assert np.all(auto.plan_s == 0)
    assert np.flatnonzero(auto.plan_wall_s).tolist() == [0]
    assert auto.skipped_replans == [2, 4] and auto.plan_delays == []
    np.testing.assert_allclose(auto.layer_s, static.layer_s)
    np.testing.assert_allclose(auto.step_s, auto.layer_s.sum(axis=1))


def test_background_planner_slower_than_the_interval_stretches_it() -> None:
    """Steps about as long as a plan: which re-plans run, which are skipped and when each plan
    takes effect follow the naive rule (`background_reference`) on the replay's own measured
    planner seconds and priced steps."""
    trace = drift_trace(steps=40)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    inline = simulate(trace, toy_cluster(4, 2), spec, ["auto"], "sync", 1, "ema")
    plan_s = float(np.median(inline.runs["auto"].plan_wall_s))
    # a cluster whose steps are about a third of a plan: the planner spans about 3 steps
    probe = simulate(trace, toy_cluster(4, 2), spec, ["static"], "sync", 1, "ema")
    scale = 3.0 * float(probe.runs["static"].step_s.mean()) / plan_s
    cluster = toy_cluster(4, 2, bw=1e9 * scale, flops=1e9 * scale)
    run = simulate(
        trace, cluster, spec, ["static", "auto"], "sync", 1, "ema", background_planning=True
    ).runs["auto"]
    walls = {s: float(w) for s, w in enumerate(run.plan_wall_s) if w > 0}
    planned, skipped, delays = background_reference(run.step_s, walls, 1)
    assert planned == sorted(walls) and run.skipped_replans == skipped
    assert run.plan_delays == delays
    assert skipped and max(delays) >= 2  # the planner was slower than the interval
    assert np.all(run.plan_s == 0)


def test_background_planning_pays_the_first_moves_from_the_static_homes() -> None:
    """Beside training, step 0 runs the static placement, so the first plan's re-homing is
    paid where it takes effect, as the live Balancer (which starts from the static homes)
    pays it: bytes moved there = the plan's steady Trans + Agg plus one `migration_bytes` per
    (layer, expert) whose home differs from the static one. Inline, the first plan is the
    layout training starts with and moves nothing."""
    trace = drift_trace(steps=4, devices=8, experts=16)
    spec = toy_spec(experts=16, layers=2, d_model=256, d_expert=512, tokens=512)
    cluster = toy_cluster(4, 2, bw=5e6, inter_bw=2e5, lat=1e-3, flops=1e9)  # plans in time
    args = (trace, cluster, spec, ["static", "eplb"], "sync", 10, "ema")
    bg = simulate(*args, count_planning=False, background_planning=True).runs["eplb"]
    plan = bg.last_plan  # made at step 0 (uniform forecast), in force from step 1
    static_home = np.repeat(np.arange(8), 2)  # 16 experts, 2 per device, in blocks
    moved = int((plan.placement.home != static_home[None, :]).sum())
    assert moved > 0  # EPLB lays uniform loads out otherwise than in blocks
    assert bg.bytes_moved[0] == 0.0
    assert bg.bytes_moved[1] == pytest.approx(
        plan.transfers.total_step_bytes + moved * spec.migration_bytes
    )
    assert bg.phases["migrate_s"][1].sum() > 0 and bg.phases["migrate_s"][2].sum() == 0
    inline = simulate(*args, count_planning=False).runs["eplb"]
    assert inline.phases["migrate_s"].sum() == 0


def test_auto_prices_no_step_past_the_end_of_the_trace() -> None:
    """The replay caps `auto`'s horizon at the steps its plan can serve: the last re-plan of
    a 12-step trace (at step 10) serves steps 10 and 11 inline, only 11 beside training; a
    caller's own `auto.steps_left` is kept."""
    trace = drift_trace(steps=12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    args = (trace, toy_cluster(4, 2), spec, ["auto"], "sync", 5, "ema")
    assert simulate(*args).runs["auto"].last_plan.notes["horizon"] == 2.0
    background = simulate(*args, background_planning=True).runs["auto"]
    assert background.last_plan.notes["horizon"] == 1.0
    kept = simulate(*args, options={"auto": {"steps_left": 4}}).runs["auto"]
    assert kept.last_plan.notes["horizon"] == 4.0


def test_scaling_keeps_expert_proportions_and_row_variation() -> None:
    trace = drift_trace(steps=3, devices=16, experts=8)
    scaled = ScaledTrace.create(trace.counts, 128, seed=1)
    assert scaled.devices == 128 and scaled.scaled
    rows = scaled.rows
    assert np.array_equal(np.bincount(rows, minlength=16), np.full(16, 8))  # 8 devices per rank
    for s in range(3):
        step = scaled.step(s)
        assert step.shape == (2, 128, 8)
        np.testing.assert_allclose(step.sum(axis=1), 8 * trace.counts[s].sum(axis=1))
        # Every modelled device replays a recorded row exactly.
        assert np.array_equal(step[:, 5], trace.counts[s][:, rows[5]])
    # Not dividing: proportions kept approximately, every row used 6 or 7 times.
    uses = np.bincount(source_rows(16, 100, seed=2), minlength=16)
    assert uses.min() == 6 and uses.max() == 7 and uses.sum() == 100
    assert "scaled from 16 to 128" in scaled.describe()


def test_scaled_simulation_on_many_devices() -> None:
    trace = drift_trace(steps=4, devices=16, experts=16)
    cluster = get_cluster("dgx-h100:32")  # 256 devices
    spec = toy_spec(experts=16, layers=2, d_model=256, d_expert=512, tokens=512)
    result = simulate(trace, cluster, spec, ["static", "shadow"], "sync", 2, "ema")
    assert result.runs["static"].device_load.shape == (4, 256)
    assert np.all(np.isfinite(result.runs["shadow"].step_s))
    assert "16 to 256" in result.scaling


def test_online_forecast_matches_batch_predictor() -> None:
    x = np.random.default_rng(0).random((7, 2, 3, 4))
    kinds = (Predictor("last"), Predictor("window", window=3), Predictor("ema", alpha=0.3))
    for predictor in kinds:
        batch = predictor.predict_all(x)
        online = OnlineForecast(predictor)
        for t in range(7):
            online.update(x[t])
            np.testing.assert_allclose(online.forecast(), batch[t], rtol=1e-12)
    with pytest.raises(ConfigError, match="no step observed"):
        OnlineForecast(Predictor()).forecast()


def test_trace_and_model_disagree_on_experts() -> None:
    trace = drift_trace(steps=2)
    with pytest.raises(ConfigError, match="8 experts but model") as info:
        simulate(trace, toy_cluster(4, 2), toy_spec(experts=4, layers=2), ["static"])
    assert info.value.field == "experts"
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate(trace, toy_cluster(4, 2), toy_spec(experts=8, layers=2), ["nope"])


# ------------------------------------------------------------------ host costs and step work
def test_cluster_without_host_costs_prices_as_the_cost_model() -> None:
    """No `HostCosts` and the MoE layers timed alone (`dense_params=None`): every step is the
    cost model's price of the plan, bit for bit, and the host and outside-the-layers terms stay
    zero."""
    trace = drift_trace(steps=5)
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512, non_moe=1e5)
    run = simulate(trace, cluster, spec, ["static"], "sync", 100, "ema", dense_params=None).runs[
        "static"
    ]
    plan = run.last_plan
    assert plan is not None
    cost = CostModel(cluster, spec, Schedule())
    for s in range(5):
        priced = cost.price(plan.placement, plan.assignment, trace.counts[s])
        assert run.step_s[s] - run.plan_s[s] == priced.step_s
        np.testing.assert_array_equal(run.phases["non_moe_fwd_s"][s], priced.phases.non_moe_fwd_s)
    assert all(not v.any() for v in run.host_phases.values())
    assert all(not v.any() for v in run.outside_s.values())
    assert set(run.phase_totals()) >= {"dispatch_host_fwd_s", "optimizer_s", "planning_s"}


def test_host_costs_and_step_work_on_a_hand_computed_step() -> None:
    """1 layer, 2 devices, 2 experts (one each), 100 tokens per device, top-1, fp32 GELU experts
    d_model 4, d_expert 8 (F_t = 128 FLOPs, 16 bytes per token), no latency."""
    counts = np.array([[[[60.0, 40.0], [30.0, 70.0]]]])  # [S=1, L=1, D=2, E=2]
    spec = toy_spec(experts=2, layers=1, d_model=4, d_expert=8, tokens=100, non_moe=1e4)
    base = toy_cluster(2, bw=1e9, lat=0.0, flops=1e9)
    host = HostCosts(
        dense_fwd_flops=5e8, dense_bwd_flops=4e8,
        dispatch_fwd_s=1e-4, dispatch_fwd_s_per_row=1e-6,
        dispatch_bwd_s=5e-5, dispatch_bwd_s_per_row=2e-6,
        optimizer_s=1e-3, optimizer_s_per_param=1e-8,
        clip_s=0.0, clip_s_per_param=1e-9,
        allreduce_lat_s=1e-4, allreduce_bw_Bps=1e9,
    )  # fmt: skip
    kw = {"slots_per_device": 1, "count_planning": False}
    plain = simulate(counts, base, spec, ["static"], "sync", 10, "ema", dense_params=0, **kw).runs[
        "static"
    ]
    # Expert compute: device 1 computes 40 + 70 = 110 rows: FEC = 110 * 128 / 1e9, BEC = 2 FEC.
    fec = 110 * 128 / 1e9
    # All-to-all: each device sends or receives at most 40 rows of 16 bytes; 4 per step.
    a2a = 4 * 40 * 16 / 1e9
    fnec, bnec = 100 * 1e4 / 1e9, 2 * 100 * 1e4 / 1e9  # at the GEMM rate
    assert plain.step_s[0] == pytest.approx(fnec + bnec + a2a + 3 * fec, rel=1e-12)

    cluster = dataclasses.replace(base, host=host)
    run = simulate(
        counts, cluster, spec, ["static"], "sync", 10, "ema", dense_params=1000, **kw
    ).runs["static"]
    fnec, bnec = 100 * 1e4 / 5e8, 2 * 100 * 1e4 / 4e8  # measured rates
    # Dispatcher rows s + r: device 0 routes 100 and computes 90, device 1 routes 100 and
    # computes 110: the slowest handles 210.
    h_fwd, h_bwd = 1e-4 + 210 * 1e-6, 5e-5 + 210 * 2e-6
    params = 1000 + 1 * 1 * 64  # dense + 1 slot of a 2 * 4 * 8 expert
    allreduce = 1e-4 + 1000 * 4 / 1e9
    clip = 1e-9 * params + 1e-4 + 8 / 1e9
    gather = 1e-4 + 8 * 1 * 2 / 1e9  # the [L=1, E=2] int64 routing counts
    optimizer = 1e-3 + 1e-8 * params
    layer = fnec + bnec + a2a + 3 * fec + h_fwd + h_bwd
    assert run.layer_s[0, 0] == pytest.approx(layer, rel=1e-12)
    outside = allreduce + gather + clip + optimizer
    assert run.step_s[0] == pytest.approx(layer + outside, rel=1e-12)
    assert run.phases["non_moe_bwd_s"][0, 0] == pytest.approx(bnec)
    assert run.host_phases["dispatch_host_fwd_s"][0, 0] == pytest.approx(h_fwd)
    assert run.outside_s["optimizer_s"][0] == pytest.approx(optimizer)
    totals = run.phase_totals()
    assert totals["grad_allreduce_s"] == pytest.approx(allreduce)
    assert totals["dispatch_host_bwd_s"] == pytest.approx(h_bwd)
    # dense_params alone (no host costs): the all-reduces on the links, nothing else
    bare = simulate(
        counts, base, spec, ["static"], "sync", 10, "ema", dense_params=1000, **kw
    ).runs["static"]
    on_links = (4000 + 16 + 8) / 1e9  # dense gradients, counts, the norm: ring on 2 devices
    assert bare.step_s[0] - plain.step_s[0] == pytest.approx(on_links, rel=1e-9)
    with pytest.raises(ConfigError, match="must be >= 0"):
        simulate(counts, base, spec, ["static"], dense_params=-1)


def test_default_charges_the_models_dense_allreduce_to_every_policy() -> None:
    """By default `simulate` prices whole steps: every step of every policy, static included,
    pays the all-reduce of the gradients of the model's dense parameters
    (`ModelSpec.dense_params`) beyond the MoE layers; `dense_params=0` or None times the MoE
    layers alone.

    One node of 4 devices, 1 GB/s per device, 10 us; one fp32 block with F_d = 2e5 FLOPs per
    token: P_d = F_d / 2 = 1e5 dense parameters, G = 4e5 bytes. Ring all-reduce
    2 (3/4) 4e5 / 1e9 + 2 * 3 * 1e-5 = 6.6e-4 s (the tree, 2 * 4e5 / 1e9 + 2 * 2 * 1e-5 =
    8.4e-4, is slower). The routing counts (8 L E = 32 bytes) and the clip's norm (8 bytes) go
    by the tree: 2 * 32 / 1e9 + 4e-5 = 4.0064e-5 s and 2 * 8 / 1e9 + 4e-5 = 4.0016e-5 s. No
    host costs: no optimizer or clip compute."""
    cluster = toy_cluster(4, bw=1e9, lat=1e-5)
    spec = toy_spec(experts=4, layers=1, tokens=100, non_moe=2e5)
    assert spec.dense_params == 100_000
    counts = np.random.default_rng(0).integers(0, 50, size=(4, 1, 4, 4)).astype(np.float64)
    counts[:, 0, :, 0] += 200  # a hot expert: eplb's plans differ from static's
    grad, gather, norm = 6.6e-4, 4.0064e-5, 4.0016e-5
    policies = ["static", "eplb"]
    args = (counts, cluster, spec, policies, "sync", 1, "last")
    kw = {"count_planning": False, "slots_per_device": 2}
    default = simulate(*args, **kw).runs
    moe_only = simulate(*args, dense_params=0, **kw).runs
    assert default["eplb"].last_plan.placement.replicas().sum() > 0
    for name in policies:
        run, bare = default[name], moe_only[name]
        np.testing.assert_allclose(run.outside_s["grad_allreduce_s"], grad, rtol=1e-12)
        np.testing.assert_array_equal(run.layer_s, bare.layer_s)  # the same plans and layers
        extra = run.step_s - bare.step_s
        assert np.all(extra >= grad)
        np.testing.assert_allclose(extra, grad + gather + norm, rtol=1e-9)
        assert all(not v.any() for v in bare.outside_s.values())
        assert run.phase_totals()["grad_allreduce_s"] == pytest.approx(grad, rel=1e-12)
    assert default["static"].mean_step_s >= moe_only["static"].mean_step_s + grad
    # "spec" (the default, spelled out) and the model's own count price alike; None is 0.
    for dense in ("spec", spec.dense_params):
        again = simulate(*args, dense_params=dense, **kw).runs["static"]
        np.testing.assert_array_equal(again.step_s, default["static"].step_s)
    none = simulate(*args, dense_params=None, **kw).runs["static"]
    np.testing.assert_array_equal(none.step_s, moe_only["static"].step_s)
    with pytest.raises(ConfigError, match="'spec'") as info:
        simulate(*args, dense_params="model", **kw)  # type: ignore[arg-type]
    assert info.value.field == "dense_params"


def _poise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "poise.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_simulate_writes_table_csv_json_and_plots(tmp_path) -> None:
    trace = tmp_path / "drift.npz"
    drift_trace(steps=6, devices=16, experts=16).save(trace)
    out = tmp_path / "out"
    proc = _poise(
        "simulate",
        str(trace),
        "--cluster",
        "dgx-h100:4",
        "--policies",
        "static,eplb,auto",
        "--replan-every",
        "3",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "eplb" in proc.stdout and "vs static" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 32 and "16 to 32" in summary["scaling"]
    assert {row["policy"] for row in summary["policies"]} == {"static", "eplb", "auto"}
    steps_csv = (out / "steps.csv").read_text().splitlines()
    assert len(steps_csv) == 1 + 6 * 3
    assert len((out / "layers.csv").read_text().splitlines()) == 1 + 6 * 3 * 2
    for png in ("step_time.png", "breakdown.png", "device_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cluster", "no-such-preset"], "no-such-preset"),
        (["--model", "gpt-s"], "experts"),
        (["--schedule", "warp"], "schedule"),
        (["--policies", "static,warp"], "policy"),
    ],
)
def test_cli_simulate_bad_input_is_one_line(tmp_path, args: list[str], needle: str) -> None:
    trace = tmp_path / "drift.npz"
    drift_trace(steps=2, devices=16, experts=8).save(trace)
    proc = _poise("simulate", str(trace), "--out", str(tmp_path / "o"), *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_cli_simulate_charges_the_dense_allreduce_by_default(tmp_path) -> None:
    """`poise simulate` prices every policy's steps with the dense gradients' all-reduce of the
    model's dense blocks (`ModelSpec.dense_params`) unless `--dense-params 0` times the MoE
    layers alone; a negative count is one line naming the option."""
    trace = tmp_path / "drift.npz"
    drift_trace(steps=4, devices=16, experts=16).save(trace)
    means = {}
    for label, extra in (("default", []), ("moe-only", ["--dense-params", "0"])):
        out = tmp_path / label
        proc = _poise(
            "simulate", str(trace), "--cluster", "dgx-h100:2", "--policies", "static",
            "--out", str(out), *extra,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((out / "summary.json").read_text())
        means[label] = summary["policies"][0]["mean_step_s"]
    assert means["default"] > means["moe-only"] > 0
    proc = _poise("simulate", str(trace), "--dense-params", "-5", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--dense-params" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("keyword", "runs"),
    [
        # plans in a thread beside training by default, as the runtime's Balancer does;
        # --no-background-planning charges planning on the critical path
        (
            "background_planning",
            [([], True), (["--no-background-planning"], False), (["--background-planning"], True)],
        ),
        # --split-tokens splits each step's tokens of a replicated expert among its holders by
        # that step's counts (the runtime's default); without it, by the plans' fixed shares
        ("split_tokens", [([], False), (["--split-tokens"], True)]),
        # --retarget re-chooses a plan's replicas each step (the runtime's default)
        ("retarget", [([], False), (["--retarget"], True)]),
    ],
)
def test_cli_simulate_passes_its_switches(tmp_path, monkeypatch, keyword: str, runs: list) -> None:
    """`poise simulate`'s switches reach `simulate` as the documented defaults and values."""
    import poise.commands.simulate as cmd
    from poise.cli import main

    trace = tmp_path / "drift.npz"
    drift_trace(steps=2, devices=16, experts=16).save(trace)
    seen: list[bool] = []

    def fake(*args, **kw):
        seen.append(kw[keyword])
        raise SystemExit(0)  # stop before the outputs

    monkeypatch.setattr(cmd, "simulate", fake)
    for extra, _ in runs:
        with pytest.raises(SystemExit):
            main(["simulate", str(trace), "--policies", "static", "--out", str(tmp_path), *extra])
    assert seen == [want for _, want in runs]
