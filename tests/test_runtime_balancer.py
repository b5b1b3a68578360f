"""The Balancer changes where experts live, never the mathematics.

On 2 and 4 gloo ranks (one spawn each, every policy inside it): 20 AdamW steps of a two-layer
MoE stack with skewed routing, the loop calling `reduce_replicas()` and `step()` itself, plans
requested every 2 steps and adopted one step later on the planner thread, end with the
parameters and losses of plain static EP (no Balancer) within 1e-5 under every policy that
replicates or moves experts, with each step's tokens split among the replicas by the step's
counts (the default) and, for two policies, by the plans' fixed shares (`:fixed`); every rank
switches plans at the same steps. A forced change of every home moves the AdamW moments with the
weights; ranks that disagree on a plan get one clear error. The guard (2 ranks) adopts a plan
that clearly pays, refuses one whose switch costs more than it saves, and never switches when
the load is balanced. One-process tests cover the helpers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.cost.model import CostModel
from poise.runtime.launch import run_ranks

from .helpers import train_residual_moe

# `:fixed`: the plan's fixed token shares (no per-step split); `:link`: Trans and Agg through
# shared memory (`host_link`) instead of gloo's all-to-all; `:free`: free balancing (the timing
# oracle, `poise.runtime.untimed`)
POLICIES = ["static", "shadow", "prophet", "vexpert", "eplb", "auto", "shadow:fixed", "eplb:fixed",
            "eplb:link", "eplb:free"]  # fmt: skip
E, D_MODEL, D_EXPERT, TOKENS, STEPS, EVERY = 8, 8, 16, 64, 20, 2
TOL = 1e-5


def _build(W: int, seed: int = 0):
    """A residual stack of two MoE layers with spare slots, routers skewed to experts 0 and 1."""
    import torch
    import torch.distributed as dist

    from poise.nn import MoE, MoEConfig, apply_expert_parallel

    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        [MoE(MoEConfig(D_MODEL, D_EXPERT, E, 2, init_seed=i)) for i in range(2)]
    )
    group = dist.group.WORLD if dist.is_initialized() else None
    apply_expert_parallel(model, group, num_slots=E // W + 2)
    with torch.no_grad():
        for block in model.blocks:
            block.router.weight[:2] += 0.5
    # eps well above the smallest expert gradients: AdamW would otherwise turn float-order
    # noise on a near-zero gradient into a full step.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    return model, opt


def _train(model, opt, rank: int, steps: int, balancer=None) -> list[float]:
    """This rank's loss per step (the Balancer's calls named by the loop)."""
    return train_residual_moe(model, opt, rank, steps, TOKENS, D_MODEL, balancer)


def _home_rows(model, opt, rank: int) -> dict:
    """`{(layer, expert, tensor): (weights, exp_avg, exp_avg_sq)}` of the experts homed here."""
    out = {}
    for li, block in enumerate(model.blocks):
        slots = block.routing.slots
        for slot, e in enumerate(slots.expert.tolist()):
            if e < 0 or not slots.home[slot]:
                continue
            for k, w in enumerate(block.experts.weights()):
                state = opt.state.get(w, {})
                moments = [state[n][slot].numpy().copy() for n in ("exp_avg", "exp_avg_sq")]
                out[(li, e, k)] = (w[slot].detach().numpy().copy(), *moments)
    return out


def _equivalence(rank: int, W: int) -> dict:
    import torch.distributed as dist

    from poise.runtime.balancer import Balancer
    from tests.helpers import toy_cluster

    model, opt = _build(W)
    result = {"reference": (_train(model, opt, rank, STEPS), _home_rows(model, opt, rank))}
    result["routers"] = {"reference": [b.router.weight.detach().numpy() for b in model.blocks]}
    # Fast links and slow GEMMs: every policy finds balancing worth its transfers.
    cluster = toy_cluster(devices_per_node=W, bw=1e12, flops=1e6)
    for policy in POLICIES:
        model, opt = _build(W)
        name, _, fixed = policy.partition(":")
        # every plan that differs is adopted (guard off), priced on the toy cluster as given
        balancer = Balancer(model, opt, name, replan_every=EVERY, cluster=cluster,
                            guard=False, calibrate=False, split_tokens=fixed != "fixed",
                            host_link=fixed == "link", free_balancing=fixed == "free")  # fmt: skip
        result[f"{policy}.link"] = balancer.link is not None
        # Trans, Agg and migration on a group of their own over the same ranks (balancing only)
        result[f"{policy}.transfers_pg"] = (
            balancer.moves.group is balancer.transfers_pg,
            balancer.transfers_pg is not balancer.group,
            dist.get_process_group_ranks(balancer.transfers_pg or dist.group.WORLD)
            == list(range(W)),
        )
        losses = _train(model, opt, rank, STEPS, balancer)
        used = balancer.link.channels if balancer.link is not None else {}
        result[f"{policy}.channels"] = sorted({k.split("-")[0] for k in used})
        balancer.close()
        stats = list(balancer.stats)
        result[f"{policy}.switched_at"] = [s.step for s in stats if s.switched]
        result[f"{policy}.switches"] = balancer.switches  # plans that took effect, counted
        result[f"{policy}.decided_at"] = [s.step for s in stats if s.replanned]
        # per step: all transfer seconds, those inside forward/backward, the Agg bytes sent
        result[f"{policy}.transfer_s"] = [
            (s.seconds.get("transfers", 0.0), s.seconds.get("transfers_in_compute", 0.0),
             s.agg_bytes)
            for s in stats
        ]  # fmt: skip
        # per step: the seconds free balancing left out, those of `step` itself, the transfers'
        result[f"{policy}.untimed"] = [
            (s.seconds.get("untimed", 0.0), s.seconds.get("boundary", 0.0),
             s.seconds.get("transfers", 0.0))
            for s in stats
        ]  # fmt: skip
        result[policy] = (losses, _home_rows(model, opt, rank))
        result["routers"][policy] = [b.router.weight.detach().numpy() for b in model.blocks]
        result[f"{policy}.moved"] = (
            sum(s.trans_bytes for s in stats),
            sum(s.migrate_bytes for s in stats),
            sum(s.replanned for s in stats),
            float(np.mean(stats[-1].max_over_mean)),
            float(np.mean(stats[0].max_over_mean)),
        )
        # the migrations' packed rows stay in buffers for the next switch (`transfers.Scratch`)
        result[f"{policy}.scratch"] = balancer.moves.scratch.nbytes
        result[f"{policy}.retargeted"] = sum(s.retargeted for s in stats)
        plan = balancer.routed  # what the layers run: the plan, its replicas retargeted
        fixed_routes = plan.assignment.with_split(False)
        result[f"{policy}.split"] = (
            plan.assignment.by_counts,
            bool(plan.placement.replicas().any()),
            # each layer's routing splits where the plan does and some expert of the layer has
            # two holders
            [
                b.routing.by_counts == (plan.assignment.by_counts and _splits(plan.placement, i))
                for i, b in enumerate(model.blocks)
            ],
            # steps of the window the split routes differently from the plan's fixed shares
            sum(
                not np.array_equal(
                    plan.assignment.split(plan.placement, c),
                    fixed_routes.split(plan.placement, c),
                )
                for c in balancer.window
            ),
        )
    if W == 2:
        result["forced"] = _forced_home_change(rank, W, cluster)
        result["mismatch"] = _mismatch(rank, W)
        result["mismatch_training"] = _mismatch_in_training(rank, W)
        result["guard"] = _guarded(rank, W)
        result["probed"] = _probed(rank, W, cluster)
    return result


def _probed(rank: int, W: int, cluster) -> dict:
    """eplb with the guard on over fast links (its plans pay), re-planning every 4 steps,
    probing every 3 (at most 2 probes), 14 steps: losses, the probe steps and what they sent."""
    from poise.runtime.balancer import Balancer

    model, opt = _build(W)
    balancer = Balancer(model, opt, "eplb", replan_every=4, cluster=cluster, calibrate=False,
                        probe_every=3, max_probes=2)  # fmt: skip
    jobs: list = []  # the planning jobs the leader submitted (their snapshots)
    submit = balancer.planner.submit

    def spy(fn, *args, **kw):
        jobs.append(fn.args[0])
        return submit(fn, *args, **kw)

    balancer.planner.submit = spy  # type: ignore[method-assign]
    begin = balancer._begin_probe
    since: list[tuple[int, int]] = []  # (boundary, the boundary its plan took force) per probe

    def begin_probe() -> None:
        since.append((balancer.steps_done, balancer._plan_since))
        begin()

    balancer._begin_probe = begin_probe  # type: ignore[method-assign]
    losses = _train(model, opt, rank, 14, balancer)
    balancer.close()
    stats = list(balancer.stats)
    probes = balancer.probe_pairs()
    return {
        "losses": losses,
        "probe_steps": [s.step for s in stats if s.probe],
        "probe_since": since,
        # what the boundary before each probe step launched (Trans) and the probe step's Agg
        "probe_bytes": [
            (stats[i - 1].trans_bytes, s.agg_bytes) for i, s in enumerate(stats) if s.probe
        ],
        "replica_steps_bytes": [s.agg_bytes for s in stats if not s.probe and s.step > 6],
        "row_layout": list(balancer.row_layout),
        "layouts": [(s.step, s.layout) for s in stats],  # as `metrics.jsonl` names them
        "pairs": (len(probes), probes.pair_of.tolist()),
        "fit_steps": [job.fit_rows[:, 0].astype(int).tolist() for job in jobs],
        "job_probes": [None if job.probes is None else len(job.probes) for job in jobs],
        # every rank's experts seconds each job fits the compute on, by step
        "job_rank_experts": [
            dict(
                zip(
                    job.fit_rows[:, 0].astype(int).tolist(),
                    job.fit_rank_experts.tolist(),
                    strict=True,
                )
            )
            for job in jobs
        ],
        # every rank's measured seconds as gathered, and this rank's own experts seconds
        "rank_seconds": [s.rank_seconds for s in stats],
        "own_experts": [s.seconds.get("experts", 0.0) for s in stats],
    }


def _forced_home_change(rank: int, W: int, cluster) -> dict:
    """Train 3 steps, then move every expert's home to the other rank (and reorder slots)."""
    from poise.runtime.balancer import Balancer

    model, opt = _build(W)
    balancer = Balancer(model, opt, "static", replan_every=1000, cluster=cluster)
    _train(model, opt, rank, 3, balancer)
    before = _home_rows(model, opt, rank)
    steps_before = [float(opt.state[w]["step"]) for b in model.blocks for w in b.experts.weights()]
    home = (balancer.plan.placement.home + 1) % W  # every home changes rank
    placement = Placement.from_homes(home, W, balancer.slots)
    for layer in range(placement.layers):  # and each rank holds one replica (slots reorder)
        for r in range(W):
            placement.copies[layer, r, int(np.flatnonzero(home[layer] != r)[-1])] = 1
    plan = Plan("forced", placement, Assignment.even(placement),
                transfers_between(balancer.plan.placement, placement, balancer.spec()))  # fmt: skip
    from poise.runtime.stats import StepStats

    moved = StepStats(step=3, policy="forced")
    balancer.apply(plan, moved)
    after = _home_rows(model, opt, rank)
    steps_after = [float(opt.state[w]["step"]) for b in model.blocks for w in b.experts.weights()]
    losses = _train(model, opt, rank, 1, balancer)  # the new layout trains
    # then only a replica changes (the same homes): nothing is re-laid, nothing migrates
    placement = placement.copy()
    placement.copies[0, 0, int(np.flatnonzero(home[0] != 0)[0])] = 1
    moves = transfers_between(balancer.plan.placement, placement, balancer.spec())
    replica = Plan("replica", placement, Assignment.even(placement), moves)
    only_replica = StepStats(step=4, policy="replica")
    balancer.apply(replica, only_replica)
    losses += _train(model, opt, rank, 1, balancer)
    balancer.close()
    return {
        "before": before,
        "after": after,
        "steps": (steps_before, steps_after),
        "loss": losses,
        "relaid": (moved.relaid_rows, only_replica.relaid_rows, only_replica.migrate_bytes),
    }


def _mismatch(rank: int, W: int) -> str:
    from poise.runtime.balancer import Balancer, PlanMismatchError

    model, opt = _build(W)
    balancer = Balancer(model, opt, "static", replan_every=1000)
    plan = balancer.plan
    if rank == 1:
        placement = plan.placement.copy()
        placement.copies[0, 0, -1] = 1
        plan = Plan("other", placement, Assignment.even(placement), plan.transfers)
    try:
        balancer.verify_plan(plan)
    except PlanMismatchError as exc:
        return str(exc)
    finally:
        balancer.close()
    return ""


def _mismatch_in_training(rank: int, W: int) -> str:
    """`check_plans`: every rank plans too; here the ranks run different policies (a planner
    that is not deterministic across ranks), so the first decision must fail on every rank."""
    from poise.runtime.balancer import Balancer, PlanMismatchError
    from tests.helpers import toy_cluster

    model, opt = _build(W)
    cluster = toy_cluster(devices_per_node=W, bw=1e12, flops=1e6)
    policy = "eplb" if rank == 0 else "shadow"
    balancer = Balancer(model, opt, policy, replan_every=EVERY, cluster=cluster, guard=False,
                        calibrate=False, check_plans=True)  # fmt: skip
    try:
        _train(model, opt, rank, 6, balancer)
    except PlanMismatchError as exc:
        return f"step {balancer.steps_done}: {exc}"
    finally:
        balancer.close()
    return ""


def _guarded(rank: int, W: int) -> dict:
    """The guard on 2 ranks (defaults: plan lag 1, guard on), 10 steps, re-planning every 2:
    `pays`: fast links, slow GEMMs, a skewed load (eplb replicates the hot experts);
    `costly`: the same plans over links of 100 B/s, expected to serve one step and to pay for
    their switch twice (the modelled switch costs 0.7 of the modelled saving of one step);
    `balanced`: every rank routes evenly (a replayed uniform trace), policy auto, calibrating."""
    import torch
    import torch.distributed as dist

    from poise.nn import MoE, MoEConfig, ReplayRouter, apply_expert_parallel
    from poise.runtime.balancer import Balancer
    from poise.trace.trace import Trace
    from tests.helpers import toy_cluster

    out = {}
    settings = {
        "pays": dict(policy="eplb", cluster=toy_cluster(W, bw=1e12, flops=1e6), calibrate=False),
        "costly": dict(policy="eplb", cluster=toy_cluster(W, bw=1e2, flops=1e6), calibrate=False,
                       guard_horizon=1, guard_margin=1.0),
        "balanced": dict(policy="auto"),
        # `pays` with its `unsettled` candidate asked again a whole period later
        "pays-late": dict(policy="eplb", cluster=toy_cluster(W, bw=1e12, flops=1e6),
                          calibrate=False, recheck=False),
    }  # fmt: skip
    for name, kw in settings.items():
        if name == "balanced":
            torch.manual_seed(0)
            uniform = Trace(np.full((1, 2, W, E), 8), np.arange(1), top_k=2, tokens_per_device=32)
            model = torch.nn.Module()
            model.blocks = torch.nn.ModuleList(
                [MoE(MoEConfig(D_MODEL, D_EXPERT, E, 2, init_seed=i),
                     router=ReplayRouter(D_MODEL, E, 2, uniform, layer=i, rank=rank))
                 for i in range(2)]
            )  # fmt: skip
            apply_expert_parallel(model, dist.group.WORLD, num_slots=E // W + 2)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        else:
            model, opt = _build(W)
        balancer = Balancer(model, opt, replan_every=EVERY, **kw)
        records: list[tuple] = []  # what the guard was told of each switch, and from what
        record = balancer.guard.record_switch

        def spy(
            measured_s: float, modelled_s: float, migrate_s: float | None = None,
            b=balancer, rec=records, call=record,
        ) -> None:  # fmt: skip
            from poise.runtime.balancer import PROBE

            rows = np.stack(b.measured)[np.array(b.row_layout) != PROBE]  # probes left out
            rec.append((measured_s, modelled_s, migrate_s, b._switch_check, rows))
            call(measured_s, modelled_s, migrate_s)

        balancer.guard.record_switch = spy  # type: ignore[method-assign]
        requests: list[int] = []  # the boundaries where a plan was requested
        request = balancer._request

        def requested(step: int, rec=requests, call=request) -> None:
            rec.append(step)
            call(step)

        balancer._request = requested  # type: ignore[method-assign]
        _train(model, opt, rank, 10, balancer)
        balancer.close()
        stats = list(balancer.stats)
        out[name] = {
            "switched_at": [s.step for s in stats if s.switched],
            "decisions": [s.decision for s in stats if s.replanned],
            "requested_at": requests,
            "gain_switch": [(s.gain_s, s.switch_cost_s) for s in stats if s.replanned],
            "doubts": [s.as_record()["doubt_s"] for s in stats if s.replanned],
            "bytes": sum(s.trans_bytes + s.migrate_bytes for s in stats),
            "fit": stats[-1].fit if name == "balanced" else None,
            "fits": [s.fit for s in stats if s.replanned],
            "planned_s": sum(s.seconds.get("plan", 0.0) for s in stats),
            "probe": balancer.probe,
            "switch_records": records,
            "k_switch": (balancer.guard.switches, balancer.guard.k_switch),
            "row_layout": list(balancer.row_layout),
        }
    return out


def _merge(results: list[dict], key: str) -> dict:
    merged: dict = {}
    for r in results:
        merged.update(r[key][1])
    return merged


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The 2-rank spawn, shared by the tests that read its results."""
    return run_ranks(_equivalence, 2)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_training_ends_where_static_ep_does(world_size: int, request) -> None:
    if world_size == 2:
        results = request.getfixturevalue("two_ranks")
    else:
        results = run_ranks(_equivalence, world_size)
    reference = _merge(results, "reference")
    assert len(reference) == 2 * E * 3
    for policy in POLICIES:
        params = _merge(results, policy)
        assert params.keys() == reference.keys()
        worst = max(float(np.abs(params[k][0] - reference[k][0]).max()) for k in reference)
        assert worst <= TOL, (policy, worst)
        for r in results:
            np.testing.assert_allclose(r[policy][0], r["reference"][0], rtol=TOL, atol=TOL)
        routers = zip(
            results[0]["routers"][policy], results[0]["routers"]["reference"], strict=True
        )
        for a, b in routers:
            np.testing.assert_allclose(a, b, atol=TOL)
        trans, migrate, replans, balance_end, balance_start = results[0][f"{policy}.moved"]
        # free balancing decides every request at once (`plan_lag` 0); the others at least one
        # step later, as many as the last job took (`planner.adoption_lag`), the requests due
        # while one is in flight skipped (these steps take milliseconds, a plan more), and the
        # last request (step 20) is never decided; static never plans (nothing to pay)
        if policy == "static":
            assert replans == 0
        elif policy.endswith(":free"):
            assert replans == STEPS // EVERY, (policy, replans)
        else:
            assert 1 <= replans <= STEPS // EVERY - 1, (policy, replans)
        switched = [r[f"{policy}.switched_at"] for r in results]
        assert all(s == switched[0] for s in switched), (policy, switched)  # the same boundary
        assert all(r[f"{policy}.switches"] == len(switched[0]) for r in results), policy
        # a plan takes effect only where the leader's decision was taken (`plan_lag` or more
        # steps after its request: `planner.adoption_lag`)
        assert set(switched[0]) <= set(results[0][f"{policy}.decided_at"]), switched[0]
        # homes moved through gloo left their packing buffers for the next switch
        kept = results[0][f"{policy}.scratch"]
        assert (kept > 0) == (migrate > 0 and ":link" not in policy), (policy, kept, migrate)
        if policy != "static":
            assert trans + migrate > 0, policy  # the policy really replicated or moved experts
            assert balance_end < balance_start, policy
        else:
            assert trans == migrate == 0
        own = results[0][f"{policy}.transfers_pg"]
        assert own == (True, policy != "static", True), (policy, own)
        # balancing ranks of one host move replicas through shared memory when asked to
        assert results[0][f"{policy}.link"] == (":link" in policy)
        by_counts, replicated, layers_split, _ = results[0][f"{policy}.split"]
        assert by_counts == (not policy.endswith(":fixed")), policy
        assert layers_split == [True] * 2, policy
        if policy in ("shadow", "eplb", "auto"):
            assert replicated, policy  # splitting had replicas to split among
        if results[0][f"{policy}.link"]:  # it had replicas, and they went through the link
            assert replicated, policy
            # and so did its migrations, where it moved homes (`migrate` bytes)
            channels = set(results[0][f"{policy}.channels"])
            assert {"agg", "trans"} <= channels <= {"agg", "trans", "migrate"}, policy
            assert ("migrate" in channels) or migrate == 0, (policy, migrate)
    # the split routed some step differently from the fixed shares (on 2 ranks, where a
    # replicated expert sits on both and no tokens are remote, only by shedding)
    assert sum(results[0][f"{p}.split"][3] for p in POLICIES if ":" not in p) > 0
    # and replicas were retargeted in some run (`Balancer(retarget=)`, on by default): the
    # equivalence above holds with them
    assert sum(results[0][f"{p}.retargeted"] for p in POLICIES) > 0


def _splits(placement, layer: int) -> bool:
    """Some expert of `layer` has two holders."""
    return bool(((placement.copies[layer] > 0).sum(axis=0) > 1).any())


def _check_forced(results: list[dict]) -> None:
    before, after = {}, {}
    for r in results:
        before.update(r["forced"]["before"])
        after.update(r["forced"]["after"])
    assert before.keys() == after.keys()
    # the moments are not trivially zero (an expert without tokens so far has zero moments)
    assert sum(bool(np.abs(v[1]).max() > 0) for v in before.values()) > len(before) // 2
    for key in before:
        for old, new in zip(before[key], after[key], strict=True):
            np.testing.assert_array_equal(new, old)  # weights, exp_avg, exp_avg_sq moved exactly
    for r in results:
        steps_before, steps_after = r["forced"]["steps"]
        assert steps_before == steps_after == [3.0] * len(steps_before)
        assert np.isfinite(r["forced"]["loss"]).all()
        moved_rows, replica_rows, replica_bytes = r["forced"]["relaid"]
        assert moved_rows > 0  # every home changed rank: rows re-laid in place
        assert replica_rows == 0 and replica_bytes == 0  # a replica-only switch re-lays nothing


@pytest.mark.dist
def test_transfers_inside_forward_and_backward_are_told_apart(two_ranks: list[dict]) -> None:
    """`transfers_in_compute` holds the Trans waits of the forward pre-hooks and the Agg
    launches of the gradient hooks: on every step whose replicas sent gradients it is more than
    0 and less than all the transfers (the boundary finishes the Aggs and launches the next
    Trans, which the training loop times as `balance`); without replicas it is 0."""
    for r in two_ranks:
        for policy in ("eplb", "shadow"):
            rows = r[f"{policy}.transfer_s"]
            with_replicas = [(t, c) for t, c, agg in rows if agg > 0]
            assert with_replicas, policy
            assert all(0.0 < c < t for t, c in with_replicas), (policy, with_replicas)
        assert all(c == 0.0 for _, c, _ in r["static.transfer_s"])


@pytest.mark.dist
def test_free_balancing_leaves_its_transfers_out_of_the_step(two_ranks: list[dict]) -> None:
    """Free balancing (`poise.runtime.untimed`): Agg, planning, migration and Trans run at the
    step boundary, so the seconds it leaves out of a step hold all its transfers and all of
    `step`; nothing of them falls inside forward and backward; other runs leave nothing out."""
    for r in two_ranks:
        rows = r["eplb:free.untimed"]
        assert all(u >= t and u >= b for u, b, t in rows), rows
        assert sum(t > 0 for _, _, t in rows) >= STEPS // 2  # it had transfers to leave out
        assert all(c == 0.0 for _, c, _ in r["eplb:free.transfer_s"])  # none inside compute
        for policy in ("eplb", "static", "auto"):
            assert all(u == 0.0 for u, _, _ in r[f"{policy}.untimed"]), policy


def test_forced_home_change_moves_adamw_moments(two_ranks: list[dict]) -> None:
    _check_forced(two_ranks)


@pytest.mark.dist
def test_ranks_with_different_plans_get_one_clear_error(two_ranks: list[dict]) -> None:
    for r in two_ranks:
        assert "ranks computed different plans" in r["mismatch"]
        # under training: requested after step 2, decided (and refused) after step 3
        assert r["mismatch_training"].startswith("step 3: "), r["mismatch_training"]
        assert "ranks computed different plans at step 3" in r["mismatch_training"]


@pytest.mark.dist
def test_guard_adopts_what_pays_and_refuses_what_does_not(two_ranks: list[dict]) -> None:
    guards = [r["guard"] for r in two_ranks]
    for name in ("pays", "costly", "balanced"):  # every rank took the same decisions
        assert all(g[name]["switched_at"] == guards[0][name]["switched_at"] for g in guards)
        assert all(g[name]["decisions"] == guards[0][name]["decisions"] for g in guards)
        # only the leader (rank 0) planned; the others took its decisions
        assert guards[0][name]["planned_s"] > 0 and guards[1][name]["planned_s"] == 0, name
    pays, costly, balanced = guards[0]["pays"], guards[0]["costly"], guards[0]["balanced"]
    # the first candidate (EPLB's, with replicas) waits: with no earlier one to backtest, only
    # the window's own older half vouches for it (`planning_job.holdout`), which is not enough
    # for replicas; the next, whose predecessor would have paid on the steps since, is adopted
    # (`leader.forecast_held`)
    assert pays["switched_at"] and pays["decisions"][:2] == ["unsettled", "adopt"], pays
    # `recheck`: the refused candidate's request is followed half a period (1 step) later, and
    # every 2 steps from there; without it a whole period later, on the first cadence
    late = guards[0]["pays-late"]
    assert late["decisions"][:2] == ["unsettled", "adopt"], late
    first = pays["requested_at"][0]
    assert late["requested_at"][0] == first == EVERY, (pays, late)
    assert pays["requested_at"][1] == first + 1, pays
    assert {s % EVERY for s in pays["requested_at"][1:]} == {(first + 1) % EVERY}, pays
    assert {s % EVERY for s in late["requested_at"]} == {0}, late
    # (which boundary then decides depends on the lag, adapted to the planner's measured time:
    # a request of step 3 decided 2 steps later switches where one of step 4 decided 1 later
    # does, so only the requests are compared)
    # each switch was measured from its own row and the steady rows after it, on every rank
    from poise.runtime.guard import migration_seconds, switch_seconds
    from poise.runtime.selfcal import fit as selfcal

    assert pays["switch_records"], pays
    for measured_s, modelled_s, migrate_s, (step, modelled, wait), rows in pays["switch_records"]:
        # the row after the switch's stats carries it (its boundary, then the fill's Trans)
        assert step - 1 in pays["switched_at"] and modelled_s == modelled > 0
        assert measured_s == switch_seconds(rows, step, wait)
        # its migration was timed inside its boundary, and gathered with it
        carried = rows[rows[:, 0] == step, 1:][0]
        assert migrate_s == migration_seconds(rows, step)
        assert 0 < migrate_s <= carried[selfcal.BOUNDARY]
    assert all(g["pays"]["k_switch"] == pays["k_switch"] for g in guards)
    # each measured row knows its layout: static up to the first switch, replicas from the row
    # that carried it (eplb replicates the hot experts)
    from poise.runtime.balancer import REPLICAS, STATIC

    first = pays["switched_at"][0]
    assert pays["row_layout"][: first + 1] == [STATIC] * (first + 1)
    assert pays["row_layout"][first + 1] == REPLICAS, pays["row_layout"]
    assert costly["switched_at"] == [] and costly["bytes"] == 0, costly
    assert "no-gain" in costly["decisions"], costly
    assert all(gain < 2 * switch for gain, switch in costly["gain_switch"]), costly
    # each decision's record says what the recent steps' spread took off its gain
    assert all(d >= 0 for d in costly["doubts"] + pays["doubts"]), (costly, pays)
    assert pays["doubts"][0] > 0, pays  # loads that vary from step to step leave some doubt
    assert balanced["switched_at"] == [] and balanced["bytes"] == 0, balanced
    # nothing to gain repaid the planner's CPU (it shares the cores), but the first re-plan's
    # job backtested a holdout, whose candidate is held to homes and says nothing of what
    # planning is worth (`same`, no backoff); the next are `idle` (the backoff doubles; how
    # many fit in 10 steps depends on how many steps a job takes: a request due while one is
    # in flight is skipped); all kept static
    first, *rest = balanced["decisions"]
    assert first == "same" and rest and set(rest) == {"idle"}, balanced
    fit = balanced["fits"][-1]  # the self-calibration saw the steps and fitted its constants
    assert fit["rows"] > 0 and fit["k_compute"] > 0, fit
    # no replica ran: k_transfer stays where the start-up probe put it (`runtime.probe`), the
    # same on every rank; the runs with calibrate=False did not probe
    k, measured_s, modelled_s = balanced["probe"]
    assert measured_s > 0 and modelled_s > 0 and k == pytest.approx(measured_s / modelled_s)
    assert fit["k_transfer"] == k, (fit, balanced["probe"])
    assert all(g["balanced"]["probe"] == balanced["probe"] for g in guards)
    assert pays["probe"] is None and costly["probe"] is None
    assert fit["dispatch_s_per_row"] > 0, fit  # gloo's all-to-all: host work beyond the link


# ------------------------------------------------------------------------- one process
def test_plan_digest_sees_every_part_of_a_plan() -> None:
    placement = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 3)
    plan = Plan("p", placement, Assignment.even(placement), None)  # type: ignore[arg-type]
    same = Plan("q", placement.copy(), Assignment.even(placement), None)  # type: ignore[arg-type]
    assert plan.digest() == same.digest()
    moved = placement.copy()
    moved.copies[0, 1, 0] = 1
    assert Plan("r", moved, plan.assignment, None).digest() != plan.digest()  # type: ignore[arg-type]
    grouped = Assignment.group_local(placement, 2)
    assert Plan("g", placement, grouped, None).digest() != plan.digest()  # type: ignore[arg-type]
    assert 0 <= plan.digest() < 2**62


def test_layer_loads_follow_the_assignment() -> None:
    from poise.runtime.stats import layer_loads

    placement = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    placement.copies[0, 1, 0] = 1  # rank 1 holds a replica of expert 0
    counts = np.array([[[6, 2], [4, 0]]])  # [L, W, E]
    loads = layer_loads(placement, Assignment.even(placement), counts)
    assert loads.device_tokens.tolist() == [[6.0, 6.0]]  # rank 1: its 4 for e0 + rank 0's 2 for e1
    assert loads.max_over_mean.tolist() == [1.0]
    assert loads.tokens_moved.tolist() == [2]


def _one_rank_balancer(replan_every: int, plan_lag: int, guard: bool = True):
    """A one-layer MoE (8 wide, 4 experts top-2) on one rank with a spare slot, its AdamW and
    an `auto` Balancer re-planning every `replan_every` steps on one modelled device."""
    import torch

    from poise.nn import MoE, MoEConfig, apply_expert_parallel
    from poise.runtime.balancer import Balancer, default_cluster

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
    apply_expert_parallel(model, None, num_slots=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    balancer = Balancer(model, opt, "auto", replan_every=replan_every,
                        cluster=default_cluster(1), plan_lag=plan_lag, guard=guard)  # fmt: skip
    return model, opt, balancer


def _one_rank_steps(model, opt, balancer, steps: int) -> None:
    """`steps` training steps of a one-rank model taking `[16, 8]` inputs, as the loop runs
    them (the Balancer's `reduce_replicas` before the optimizer, `step` after it)."""
    import torch

    for _ in range(steps):
        model(torch.randn(16, 8)).square().mean().backward()
        balancer.reduce_replicas()
        opt.step()
        balancer.step()
        opt.zero_grad()


def _spy_jobs(balancer, what=lambda job, requested_at: (requested_at, job.homes_only)) -> list:
    """`what(job, requested at)` of every planning job `balancer` submits from now on (default
    `(requested at, homes_only)`), in a list that fills as the steps run."""
    submit = balancer.planner.submit
    seen: list = []

    def spy(fn, requested_at, adopt_at):
        seen.append(what(fn.args[0], requested_at))
        return submit(fn, requested_at=requested_at, adopt_at=adopt_at)

    balancer.planner.submit = spy
    return seen


def test_the_balancer_counts_due_replans_towards_a_refuted_models_retrial() -> None:
    """A refutation with a wait of 3 re-plans, on a Balancer re-planning every 2 steps: the
    re-plan due at step 2 is skipped (the fallback's backoff), the one at 4 plans homes only
    (`PlanningJob.homes_only`), and at step 6, skipped or not, the model is trusted again: the
    next job plans in full."""
    from poise.runtime.verdict import Verdict

    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    jobs = _spy_jobs(balancer)
    balancer.guard.retrial = 3
    balancer.guard.fell_back(Verdict(1.0, 0.1, 10, wall_saving_s=-0.004, wall_se_s=0.002,
                                     probes=4, modelled_clock_s=0.015))  # fmt: skip
    _one_rank_steps(model, opt, balancer, 4)
    assert balancer.guard.trust == 0.0 and jobs == [(4, True)]
    _one_rank_steps(model, opt, balancer, 2)
    assert balancer.guard.trust == 1.0
    # (the job at 4 backtested a holdout, so it was not idle: the re-plan at 6 ran, in full)
    _one_rank_steps(model, opt, balancer, 4)
    assert jobs[:2] == [(4, True), (6, False)]
    balancer.close()


def test_the_balancer_carries_the_load_patterns_age_from_plan_to_plan() -> None:
    """Each taken job leaves `(requested at, auto's pattern_age note)`; the next job gets the
    steps the pattern held before its window (`persistence.carried_age`): here a pattern of
    age 50 at step 2, and a 4-step window at step 4, give 50 + 2 - 4 = 48."""
    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0, guard=False)
    held = _spy_jobs(balancer, lambda job, requested_at: (requested_at, job.held_before))
    take = balancer.planner.take
    ages: list[int] = []

    def took():
        done = take()
        ages.append(done.value.plan.notes["pattern_age"])
        return done

    balancer.planner.take = took
    _one_rank_steps(model, opt, balancer, 2)
    assert held == [(2, 0)] and len(ages) == 1 and 0 <= ages[0] <= 2
    assert balancer._pattern == (2, ages[0])
    balancer._pattern = (2, 50)
    _one_rank_steps(model, opt, balancer, 2)
    assert held[-1] == (4, 48) and len(balancer.window) == 4
    balancer.close()


def test_one_process_balancer_records_and_plans() -> None:
    import torch

    from poise.nn import MoE, MoEConfig, apply_expert_parallel
    from poise.runtime.balancer import Balancer, default_cluster, spec_from_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)), MoE(MoEConfig(8, 16, 4, 2)))
    apply_expert_parallel(model, None, num_slots=5)  # one rank with a spare slot
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    balancer = Balancer(model, opt, "auto", replan_every=2, cluster=default_cluster(1),
                        plan_lag=0)  # fmt: skip
    _one_rank_steps(model, opt, balancer, 4)
    stats = list(balancer.stats)
    # one rank: nothing to gain. The first re-plan's job backtests a holdout (its candidate is
    # held to homes) and is never idle; the next does not repay the planner's CPU (shared with
    # the rank): idle, and planning backs off
    assert [s.replanned for s in stats] == [False, True, False, True]
    assert stats[1].decision in ("same", "no-gain") and stats[1].seconds["plan"] > 0
    assert stats[3].decision == "idle"
    # the static layout ran every step; the first (step 0) counts as the one that set it up
    from poise.runtime.balancer import STATIC

    assert list(balancer.row_layout) == [STATIC] * 4
    assert list(balancer.row_settled) == [False, True, True, True]
    ref_counts, ref_rows, bal_counts, bal_rows = balancer.wall_reference()
    assert ref_rows[:, 0].tolist() == [1, 2, 3]
    assert np.array_equal(ref_counts[-1], balancer.window[-1])
    assert len(bal_counts) == len(bal_rows) == 0  # no plan with replicas ran
    # a run that balanced, went static, then balanced again (step 2 carried the switch):
    # balancing is judged on the steps since static last ran, static on its settled steps
    from poise.runtime.balancer import REPLICAS

    balancer.row_layout.clear()
    balancer.row_layout.extend([REPLICAS, STATIC, REPLICAS, REPLICAS])
    balancer.row_settled.clear()
    balancer.row_settled.extend([True, True, False, True])
    ref_counts, ref_rows, bal_counts, bal_rows = balancer.wall_reference()
    assert ref_rows[:, 0].tolist() == [1] and bal_rows[:, 0].tolist() == [3]
    assert np.array_equal(bal_counts[0], balancer.window[3])
    assert stats[1].seconds["plan_cpu"] > 0 and balancer.guard.idles == 1
    assert stats[-1].device_tokens[0] == [32.0]  # 16 tokens x top-2, one rank
    assert {"gate", "dispatch", "experts", "combine"} <= stats[-1].seconds.keys()
    assert stats[-1].as_dict()["step"] == 3
    spec = spec_from_layers([model[0], model[1]], 16)
    assert (spec.d_model, spec.d_expert, spec.experts, spec.moe_layers) == (8, 16, 4, 2)
    assert spec.activation == "swiglu" and spec.dtype_bytes == 4
    # a plan in force that did not pay: the leader's outcome replaces it or names the exit
    # (horizon 2, margin 0.2, switches priced at k = 1 before any was measured)
    import dataclasses

    from poise.runtime.assessment import Assessment
    from poise.runtime.leader import exit_outcome
    from poise.runtime.planning_job import JobResult
    from poise.runtime.verdict import Verdict

    def option(gain: float, switch: float) -> Assessment:
        return Assessment(False, current_busy_s=1.0, candidate_busy_s=1.0 - gain, switch_s=switch)

    now = balancer.plan
    fresh, homes, back = (Plan(n, now.placement, now.assignment, now.transfers)
                          for n in ("fresh", "homes", "static"))  # fmt: skip
    stale = Verdict(saving_s=0.0, cost_s=1.0, steps=3)  # the model saw it stale, no clock
    result = JobResult(fresh, option(0.5, 0.1), balancer.cluster, balancer.fit, stale,
                       ((homes, option(0.1, 0.0)), (back, option(0.2, 0.0))))  # fmt: skip
    out = exit_outcome(balancer.guard, result, 0.0, 1.0, 3)
    assert out.decision == "replace" and out.plan is fresh and out.adopts  # 1.0 - 0.12 > 0.4
    assert out.next_lag == 3
    assert out.gain_s == pytest.approx(1.0) and out.switch_s == pytest.approx(0.1)
    assert out.verdict is stale
    # after a refutation (trust 0.5) the homes-only candidate is credited, and reported, in
    # full; one with replicas at half: 0.5 x 0.49 x 2 - 1.2 x 0.1 = 0.37 < static's 0.4
    balancer.guard.trust = 0.5
    out = exit_outcome(balancer.guard, result, 0.0, 1.0, 3)
    assert out.decision == "replace" and out.gain_s == pytest.approx(1.0)
    held = dataclasses.replace(result.assessment, candidate_transfers_s=0.01)
    out = exit_outcome(balancer.guard, dataclasses.replace(result, assessment=held), 0, 1.0, 3)
    assert out.decision == "fallback" and out.plan is back
    balancer.guard.trust = 1.0
    refuted = Verdict(saving_s=2.0, cost_s=1.0, steps=3, wall_saving_s=-5.0, wall_se_s=1.0)
    out = exit_outcome(balancer.guard, dataclasses.replace(result, paid=refuted), 0.0, 1.0, 3)
    assert out.decision == "fallback" and out.plan is back and out.gain_s == pytest.approx(0.4)
    # the leader's outcome: a plan in force that did not pay gives way; one that paid is
    # weighed against the candidate; with the static layout in force, a refused candidate
    # that did not cover its planning backs off; the next lag ceil(0.5 / 0.2) = 3
    from poise.runtime.leader import leader_outcome

    kw = dict(wait_s=0.0, plan_s=0.5, planning_s=0.1, period_s=0.2, plan_lag=1)
    out = leader_outcome(balancer.guard, result, on_static=False, **kw)
    assert (out.decision, out.plan, out.next_lag) == ("replace", fresh, 3)
    paid = dataclasses.replace(result, paid=Verdict(saving_s=2.0, cost_s=1.0, steps=3))
    out = leader_outcome(balancer.guard, paid, on_static=False, **kw)
    assert (out.decision, out.plan, out.verdict) == ("adopt", fresh, paid.paid)
    same = dataclasses.replace(result, assessment=Assessment(same=True))
    assert leader_outcome(balancer.guard, same, on_static=True, **kw).decision == "idle"
    out = leader_outcome(balancer.guard, same, on_static=False, **kw)  # nothing fresh to take
    assert (out.decision, out.plan) == ("fallback", back)
    # once the clock refuted the model outright (trust 0) no candidate with replicas can be
    # adopted: a re-plan is idle (backs off) under any layout that pays, not only the static
    # one; a candidate without replicas, which the clock never measured, is still weighed
    balancer.guard.trust = 0.0
    replicas = dataclasses.replace(
        paid, assessment=dataclasses.replace(paid.assessment, candidate_transfers_s=0.05)
    )
    assert leader_outcome(balancer.guard, replicas, on_static=False, **kw).decision == "idle"
    assert leader_outcome(balancer.guard, paid, on_static=False, **kw).decision == "adopt"
    balancer.guard.trust = 1.0
    assert leader_outcome(balancer.guard, replicas, on_static=False, **kw).decision == "adopt"
    # every rank applies the plan the outcome names; a fallback backs off, a replacement keeps
    # the backoff as it was, an adoption resets it
    from poise.runtime.stats import StepStats

    balancer.guard.kept()  # the backoff back at its start (the idle re-plan above doubled it)
    # ... and keeps what the plan in force promised over static: 0 after a fallback to the
    # static layout, a plan's credited gain a step from there (these plans all lay out as
    # static, so each counts from it)
    balancer.guard.promised_s = 0.5
    for decision, chosen, backoff, gain, promised in [("fallback", back, 2, 0.01, 0.0),
                                                      ("replace", fresh, 2, 0.02, 0.02),
                                                      ("adopt", homes, 1, 0.03, 0.03)]:  # fmt: skip
        given = dataclasses.replace(out, decision=decision, plan=chosen, step_gain_s=gain)
        balancer._own_outcome = lambda stats, given=given: given  # the leader's outcome
        balancer._decide(StepStats(step=99, policy="auto"))
        assert balancer.plan is chosen and balancer.guard._next_backoff == backoff, decision
        assert balancer.guard.promised_s == pytest.approx(promised), decision
    assert balancer.guard.fallbacks == 1
    balancer.close()
    assert default_cluster(4).num_devices == 4


@pytest.mark.dist
def test_no_plan_is_requested_that_would_serve_no_step() -> None:
    """With the run's length known (`total_steps`), a plan requested at boundary s is decided
    at s + lag and serves the steps after it: `steps_left` counts them, and a re-plan whose
    plan would serve none is not requested (no planning at the run's end)."""
    import torch

    from poise.nn import MoE, MoEConfig, apply_expert_parallel
    from poise.runtime.balancer import Balancer, default_cluster

    def replanned(total_steps: int | None, plan_lag: int) -> tuple[list[bool], list]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
        apply_expert_parallel(model, None, num_slots=5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        balancer = Balancer(model, opt, "auto", replan_every=2, cluster=default_cluster(1),
                            plan_lag=plan_lag, total_steps=total_steps)  # fmt: skip
        if total_steps is not None:
            want = [max(0, total_steps - 2 - plan_lag), 0, 0]
            assert [balancer.steps_left(s) for s in (2, total_steps - plan_lag, 99)] == want
        submit = balancer.planner.submit

        def submitted(job, **kw):  # the job carries the steps its plan would serve
            assert job.args[0].steps_left == balancer.steps_left(kw["requested_at"])
            jobs.append(job.args[0].steps_left)
            return submit(job, **kw)

        jobs: list[int | None] = []
        balancer.planner.submit = submitted
        _one_rank_steps(model, opt, balancer, 3)
        balancer.close()
        return [s.replanned for s in balancer.stats], jobs

    assert replanned(None, 0) == ([False, True, False], [None])
    assert replanned(3, 0) == ([False, True, False], [1])  # decided at 2, serves step 3
    assert replanned(2, 0) == ([False, False, False], [])  # would serve nothing: not requested
    assert replanned(3, 1) == ([False, False, False], [])  # decided at 3, the last step
    assert replanned(4, 1) == ([False, False, True], [1])
    assert replanned(None, 1) == ([False, False, True], [None])
    with pytest.raises(ConfigError, match="total_steps"):
        Balancer(torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2))), None, total_steps=-1)


def test_cpu_ranks_beyond_the_cores_share_them() -> None:
    """`shared_cores` = cores / threads x world_size / ranks_on_host once the host's processes
    want more cores than it has (hand-worked on this machine's core count)."""
    import os

    import torch

    from poise.runtime.plan_inputs import default_cluster, shared_cores

    cores = len(os.sched_getaffinity(0))
    assert shared_cores(1, 1, threads=cores) == 0.0  # one rank, all cores: nothing shared
    assert shared_cores(2, 2, threads=cores) == 1.0  # two ranks want 2 x cores
    assert shared_cores(2, 4, threads=cores) == 0.5  # two of four such ranks
    assert shared_cores(2 * cores, 2 * cores, threads=1) == cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shared = default_cluster(2 * cores, ranks_on_host=2 * cores)
        assert shared.host.shared_cores == cores and shared.num_devices == 2 * cores
        assert default_cluster(2 * cores).host.shared_cores == 0.0  # host unknown: independent
        assert default_cluster(cores, ranks_on_host=cores).host.shared_cores == 0.0
    finally:
        torch.set_num_threads(threads)


def test_ranks_on_host_from_local_world_size(monkeypatch, tmp_path) -> None:
    """torchrun's `LOCAL_WORLD_SIZE` says how many ranks share this host's cores (`poise train`'s
    cluster reads it): 2C CPU ranks of 1 thread on C cores share them, C of them do not."""
    import os

    import torch

    from poise.core.errors import ConfigError
    from poise.runtime.plan_inputs import ranks_on_host
    from poise.train.setup import make_cluster
    from tests.helpers import tiny_train_config

    cores = len(os.sched_getaffinity(0))
    cfg = tiny_train_config(str(tmp_path), "host", device="cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_on_host(8) == 8
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert make_cluster(cfg, 2 * cores).host.shared_cores == cores  # all 2C here
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        assert ranks_on_host(8) == cores
        assert make_cluster(cfg, 2 * cores).host.shared_cores == 0.0  # C here, C elsewhere
    finally:
        torch.set_num_threads(threads)
    for bad in ("two", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
            ranks_on_host(8)


def test_bad_arguments_are_config_errors() -> None:
    import torch

    from poise.nn import MoE, MoEConfig
    from poise.runtime.balancer import Balancer

    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="unknown policy"):
        Balancer(model, opt, "nope")
    with pytest.raises(ConfigError, match=">= 1") as info:
        Balancer(model, opt, replan_every=0)
    assert info.value.field == "replan_every"
    with pytest.raises(ConfigError, match="2 devices but 1 ranks"):
        Balancer(model, opt, cluster="cpu-2")
    with pytest.raises(ConfigError, match=r"no poise\.nn\.MoE"):
        Balancer(torch.nn.Linear(2, 2), opt)
    with pytest.raises(ConfigError, match="turn the guard off") as info:
        Balancer(model, opt, "eplb", free_balancing=True)  # the guard is on by default
    assert info.value.field == "free_balancing"


def test_a_switch_is_measured_beyond_the_plans_steady_steps() -> None:
    """`switch_seconds` by hand: the switch at step 4 exposed 0.30 s of boundary and 0.12 s of
    transfers (its new replicas' first Trans awaited in the next forward); the steps after it
    expose 0.02 + 0.03, 0.02 + 0.05 and 0.02 + 0.04 s (median 0.06 s); 0.05 s of the boundary
    was the planner's wait: 0.42 - 0.06 - 0.05 = 0.31 s."""
    from poise.runtime.guard import switch_seconds
    from poise.runtime.selfcal import fit as selfcal

    rows = np.zeros((5, 1 + len(selfcal.MEASURED)))
    rows[:, 0] = [3, 4, 5, 6, 7]
    rows[:, 1 + selfcal.BOUNDARY] = [0.01, 0.30, 0.02, 0.02, 0.02]
    rows[:, 1 + selfcal.TRANSFERS] = [0.0, 0.12, 0.03, 0.05, 0.04]
    rows[:, 1 + selfcal.PERIOD] = 1.0  # plays no part
    assert switch_seconds(rows, 4, 0.05) == pytest.approx(0.31)
    assert switch_seconds(rows[:2], 4, 0.05) is None  # no settled step after it yet
    assert switch_seconds(rows[2:], 4, 0.05) is None  # its row is gone


def test_a_switchs_migration_is_priced_apart_from_its_fixed_part() -> None:
    """`record_switch` with the migration's own seconds: the per-byte ratio `k_switch` comes
    from the migration alone, the rest of the switch goes to `relay_s`, which every switch
    pays. A first switch that moved one home and re-laid four layers (ep_step's zipf-1.2:
    31 ms exposed for a 0.62 ms modelled migration that took 5 ms) prices a later 10x larger
    migration at 8.06 x 6.2 + 26 = 76 ms, not 50 x 6.2 = 310 ms."""
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import SwitchGuard

    guard = SwitchGuard(horizon=10)
    guard.record_switch(measured_s=0.031, modelled_s=0.00062, migrate_s=0.005)
    assert guard.k_switch == pytest.approx(0.005 / 0.00062) and guard.switches == 1
    assert (guard.relays, guard.relay_s) == (1, pytest.approx(0.026))
    bigger = Assessment(False, switch_s=0.0062, current_busy_s=1.0, candidate_busy_s=0.9)
    assert guard.decide(bigger).switch_s == pytest.approx(0.005 / 0.00062 * 0.0062 + 0.026)
    whole = SwitchGuard(horizon=10)  # the migration not timed: the whole switch's ratio
    whole.record_switch(measured_s=0.031, modelled_s=0.00062)
    assert whole.k_switch == pytest.approx(50.0) and whole.relays == 0
    # a migration that outlasted the switch's exposure (overlapped steps) leaves no fixed part
    guard.record_switch(measured_s=0.010, modelled_s=0.001, migrate_s=0.012)
    assert guard.relays == 2 and guard.relay_s == pytest.approx(0.013)
    # the larger migration weighs by its size: (5 + 12) ms over (0.62 + 1) ms modelled
    assert guard.k_switch == pytest.approx(0.017 / 0.00162)


def test_guard_prices_switches_with_what_they_measured() -> None:
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import Decision, SwitchGuard

    guard = SwitchGuard(horizon=10, margin=0.2)
    plan = Assessment(False, switch_s=0.5, current_busy_s=1.0, candidate_busy_s=0.9)  # 0.1 s/step
    assert guard.decide(plan).adopt  # 1.0 s over 10 steps > 1.2 * 0.5 s
    assert not guard.decide(plan, wait_s=0.4).adopt  # the planner's delay counts
    assert not SwitchGuard(horizon=2).decide(plan).adopt  # 0.2 s over 2 steps: no
    before = guard.decide(plan, switch_prior=4.0)  # no switch measured yet: the prior scales
    assert not before.adopt and before.switch_s == 2.0
    guard.record_switch(measured_s=2.0, modelled_s=0.5)  # switches cost 4x the model here
    decision = guard.decide(plan)
    assert not decision.adopt and decision.reason == "no-gain" and decision.switch_s == 2.0
    assert guard.decide(plan, switch_prior=0.1).switch_s == 2.0  # measured beats the prior
    guard.record_switch(measured_s=1.0, modelled_s=0.5)
    assert guard.k_switch == 3.0  # measured over modelled, summed: (2 + 1) / (0.5 + 0.5)
    assert guard.decide(Assessment(same=True)).reason == "same"
    assert SwitchGuard(horizon=2, enabled=False).decide(plan).adopt  # guard off: adopt
    # a change of replicas alone (no home moves: modelled 0 s) is priced at what such switches
    # measured, the mean (one measured below 0 counts as 0), not scaled by k_switch
    relay = Assessment(False, current_busy_s=1.0, candidate_busy_s=0.99)  # 0.01 s a step
    assert guard.decide(relay).adopt and guard.decide(relay).switch_s == 0.0  # none measured
    guard.record_switch(measured_s=0.12, modelled_s=0.0)
    guard.record_switch(measured_s=-0.02, modelled_s=0.0)
    assert (guard.relays, guard.relay_s, guard.k_switch) == (2, pytest.approx(0.06), 3.0)
    d = guard.decide(relay)  # 0.1 s over 10 steps > 1.2 * 0.06 s
    assert d.adopt and d.switch_s == pytest.approx(0.06)
    guard.record_switch(measured_s=0.24, modelled_s=0.0)  # mean 0.12: 0.1 < 1.2 * 0.12
    assert not guard.decide(relay).adopt
    # a migration: k_switch 3 x 0.5 s, and what every switch costs beyond its migration
    assert guard.decide(plan).switch_s == pytest.approx(1.5 + 0.12)
    refused = Decision(False, "no-gain", gain_s=0.05, switch_s=1.0)
    assert not guard.planning_pays(refused, planning_s=0.1)  # the planner cost more
    assert guard.planning_pays(refused, planning_s=0.01)
    assert guard.planning_pays(Decision(True, "adopt"), planning_s=1.0)
    idle = SwitchGuard(horizon=10)
    idle.planning_idle()  # planning that did not pay backs off like a fallback
    assert idle.skip_replan() and not idle.skip_replan() and idle.fallbacks == 0
    guard.fell_back()  # a fallback skips the next re-plan, doubling on repeats
    assert guard.skip_replan() and not guard.skip_replan()
    guard.fell_back()
    assert [guard.skip_replan() for _ in range(3)] == [True, True, False]  # doubled


def _replica_case():
    """tests/test_cost.py's hand-computed case: 2 devices, experts homed on d0, d1; counts
    [[10, 30], [20, 40]]; the candidate replicates e1 on d0 (d0's 30 e1-tokens stay home).
    toy_spec: token 16 B, expert 256 B, 128 FLOP per token forward; 1e9 B/s, 1e9 FLOP/s.
    Static: d1 computes 70 tokens, d0 sends 30 -> busy = 3 * 70 * 128 + 2 * 30 * 16 = 27,840 ns.
    Replica: loads [60, 40], d0 sends 20 -> busy = 3 * 60 * 128 + 2 * 20 * 16 = 23,680 ns;
    Trans + Agg = 2 * 256 = 512 ns."""
    from tests.helpers import toy_cluster, toy_spec

    spec = toy_spec(experts=2)
    cost = CostModel(toy_cluster(bw=1e9, flops=1e9), spec)
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    static = Plan("static", p, Assignment.to_home(p), transfers_between(None, p, spec))
    r = p.copy()
    r.copies[0, 0, 1] = 1
    replica = Plan("r", r, Assignment.to_home(r), transfers_between(p, r, spec))
    counts = np.array([[[10, 30], [20, 40]]], dtype=float)
    return cost, static, replica, counts


def test_guard_prices_a_plan_by_its_live_parts() -> None:
    from poise.runtime.assessment import assess
    from poise.runtime.guard import SwitchGuard

    cost, static, replica, counts = _replica_case()
    a = assess(cost, static, replica, counts)
    assert a.current_busy_s == pytest.approx(27_840e-9)
    assert a.candidate_busy_s == pytest.approx(23_680e-9)
    assert a.current_transfers_s == 0 and a.candidate_transfers_s == pytest.approx(512e-9)
    assert a.live_gain_s() == pytest.approx(4_160e-9 - 512e-9)
    assert a.switch_s == 0.0  # no home moves; the replica's fill is its first Trans, in live_s
    guard = SwitchGuard(horizon=10, margin=0.0)
    assert guard.decide(a).adopt
    # transfers measured at 4160 / 512 = 8.125 times the model's: the replica saves nothing
    assert not guard.decide(a, k_transfer=8.2).adopt
    # the steps just run had e1 cold ([[30, 10], [40, 20]]): static's d0 computes 70 and the
    # busiest link carries 40 tokens -> 3 * 70 * 128 + 2 * 40 * 16 = 28,160 ns; the replica's
    # d0 computes 80 (its own 10 e1-tokens too), d1 still sends 40 -> 32,000 ns
    cold = np.array([[[[30, 10], [40, 20]]]], dtype=float)  # [S, L, D, E]
    b = assess(cost, static, replica, counts, recent=cold)
    assert b.recent_busy_gain_s == pytest.approx(-3_840e-9)
    assert b.recent_transfers_gain_s == pytest.approx(-512e-9)
    assert b.live_gain_s() == pytest.approx(-4_352e-9)  # the smaller of forecast and recent
    assert not guard.decide(b).adopt
    hot = assess(cost, static, replica, counts, recent=np.stack([counts, counts]))
    assert hot.live_gain_s() == pytest.approx(a.live_gain_s())  # recent = forecast: unchanged


def test_guard_adopts_only_a_gain_beyond_the_spread_of_the_recent_steps() -> None:
    """The recent steps' gains a step (the hand-computed cases above): a hot step gains 4,160 ns
    of busy and -512 of transfers, a cold one -3,840 and -512. Their mean's standard error is
    the sample standard deviation over sqrt(2); the guard takes `CLOCK_Z` of it off the gain."""
    from poise.runtime.assessment import Assessment, assess
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.verdict import CLOCK_Z

    cost, static, replica, counts = _replica_case()
    cold = np.array([[[30, 10], [40, 20]]], dtype=float)
    mixed = assess(cost, static, replica, counts, recent=np.stack([counts, cold]))
    busy = np.array([4_160e-9, -3_840e-9])
    assert mixed.recent_busy_gain_s == pytest.approx(busy.mean())
    assert mixed.recent_gain_se_s() == pytest.approx(busy.std(ddof=1) / np.sqrt(2))
    same = assess(cost, static, replica, counts, recent=np.stack([counts, counts]))
    assert same.recent_gain_se_s() == 0.0  # identical steps: no spread
    assert assess(cost, static, replica, counts, recent=counts[None]).recent_gain_se_s() == 0.0
    # busy and transfers together, for any transfer scale k: var_b + k^2 var_t + 2 k cov
    a = Assessment(False, recent_gain_cov=(4e-6, 1e-6, -1e-6))
    assert a.recent_gain_se_s(3.0) == pytest.approx(np.sqrt(4e-6 + 9e-6 - 6e-6))
    # 0.01 s a step over 10 steps against a 0.05 s switch (margin 0.2: 0.06 needed)
    guard = SwitchGuard(horizon=10, margin=0.2)
    sure = Assessment(
        False, switch_s=0.05, current_busy_s=1.0, candidate_busy_s=0.99,
        recent_busy_gain_s=0.01, recent_transfers_gain_s=0.0, recent_gain_cov=(1e-6, 0.0, 0.0),
    )  # fmt: skip
    assert guard.decide(sure).adopt  # 0.1 - 2 * 0.001 * 10 = 0.08 > 0.06
    assert guard.decide(sure).doubt_s == pytest.approx(0.02)  # reported beside gain and switch
    noisy = dataclasses.replace(sure, recent_gain_cov=(1e-4, 0.0, 0.0))
    assert CLOCK_Z == 2.0 and not guard.decide(noisy).adopt  # 0.1 - 0.2 < 0.06
    assert guard.decide(noisy).doubt_s == pytest.approx(0.2)
    assert not guard.decide(noisy, horizon=100).adopt  # the doubt grows with the horizon too


def test_a_fallback_the_clock_forced_on_the_model_stops_crediting_its_gains() -> None:
    """Predicted +15 ms a step for the paired clock, measured -4 +- 2 (4 probes) while the
    model's counterfactual said the plan paid: the fallback sets `trust` to clip(-4 / 15, 0, 1)
    = 0, and a later candidate with replicas is credited at 0; one without replicas, which the
    clock never measured, in full. A fallback the model agreed with (its own saving below the
    transfers) or one without the model's figure leaves it at 1."""
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.verdict import Verdict

    # 0.1 s a step of compute saved, 0.01 of Trans and Agg paid: 0.09 s a step over 10 steps
    big = Assessment(
        False, switch_s=0.0, current_busy_s=1.0, candidate_busy_s=0.9, candidate_transfers_s=0.01
    )
    homes = Assessment(False, switch_s=0.0, current_busy_s=1.0, candidate_busy_s=0.9)
    refuted = Verdict(1.0, 0.1, 10, wall_saving_s=-0.004, wall_se_s=0.002, probes=4,
                      modelled_clock_s=0.015)  # fmt: skip
    guard = SwitchGuard(horizon=10)
    assert guard.model_refuted(refuted) and guard.decide(big).adopt
    guard.fell_back(refuted)
    assert guard.trust == 0.0 and guard.fallbacks == 1
    d = guard.decide(big)
    assert not d.adopt and d.gain_s == 0.0
    d = guard.decide(homes)
    assert d.adopt and d.gain_s == pytest.approx(1.0)
    agreed = Verdict(0.05, 0.1, 10, wall_saving_s=-0.004, wall_se_s=0.002, probes=4,
                     modelled_clock_s=0.015)  # fmt: skip
    unpredicted = Verdict(1.0, 0.1, 10, wall_saving_s=-0.004, wall_se_s=0.002)
    for v in (agreed, unpredicted, None):
        other = SwitchGuard(horizon=10)
        other.fell_back(v)
        assert other.trust == 1.0 and other.decide(big).adopt
    half = SwitchGuard(horizon=10)
    half.trust = 0.5  # the share scales the gain: 0.09 s a step over 10 steps, halved
    assert half.decide(big).gain_s == pytest.approx(0.45)
    assert half.decide(homes).gain_s == pytest.approx(1.0)
    # leaving a plan that does not pay: the candidate's gain is credited at `trust` too, where
    # it holds replicas
    moves = dataclasses.replace(big, switch_s=0.1)
    back = Assessment(False, switch_s=0.2, current_busy_s=1.0, candidate_busy_s=1.0)
    assert SwitchGuard(horizon=10).exit_choice(moves, [back], model_refuted=False) == 0
    assert guard.exit_choice(moves, [back], model_refuted=False) == 1  # trust 0: the exit
    rehome = dataclasses.replace(homes, switch_s=0.1)
    assert guard.exit_choice(rehome, [back], model_refuted=False) == 0


def test_a_refuted_model_is_trusted_again_after_a_wait_that_doubles() -> None:
    """After a refutation `trust` returns to 1 once `max_backoff` (here 3) re-plans were due,
    skipped or not; the next refutation waits twice as long (6), the one after 12. A fallback
    the clock did not force starts no wait."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.verdict import Verdict

    refuted = Verdict(1.0, 0.1, 10, wall_saving_s=-0.004, wall_se_s=0.002, probes=4,
                      modelled_clock_s=0.015)  # fmt: skip
    guard = SwitchGuard(horizon=10, max_backoff=3)
    guard.replan_due()  # nothing refuted: nothing to wait for
    assert guard.trust == 1.0
    for wait in (3, 6, 12):
        guard.fell_back(refuted)
        for _ in range(wait - 1):
            guard.replan_due()
            assert guard.trust == 0.0
        guard.replan_due()
        assert guard.trust == 1.0
    guard.fell_back(Verdict(0.05, 0.1, 10))  # the model saw it fail too: no refutation
    guard.replan_due()
    assert guard.trust == 1.0 and guard.retrial == 24
    assert SwitchGuard(horizon=10, backoff=0, max_backoff=0).retrial == 1


def test_guard_keeps_a_plan_only_while_its_saving_beats_its_measured_transfers() -> None:
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import Verdict, verdict

    cost, static, replica, counts = _replica_case()
    steps = np.stack([counts, counts])  # [S=2, L, D, E]: saves 2 * 4,160 ns
    measured = np.zeros((2, len(selfcal.MEASURED)))
    measured[:, selfcal.BOUNDARY] = 1e-6  # Trans launches
    measured[:, selfcal.PERIOD] = 1.0  # wall clock plays no part
    measured[:, selfcal.TRANSFERS] = 3e-6
    v = verdict(cost, static, replica, steps, measured)
    assert v.saving_s == pytest.approx(8_320e-9) and v.cost_s == pytest.approx(8e-6)
    guard = SwitchGuard(horizon=10)
    assert guard.pays(v)
    measured[:, selfcal.TRANSFERS] = 4e-6  # 10 us of transfers for 8.32 us saved
    assert not guard.pays(verdict(cost, static, replica, steps, measured))
    assert guard.pays(Verdict(0.0, 1.0, 0)) and guard.pays(None)  # nothing run yet
    assert SwitchGuard(horizon=10, enabled=False).pays(Verdict(0.0, 1.0, 5))


def test_guard_drops_a_plan_the_wall_clock_measured_slower_than_static() -> None:
    """The wall-clock test by hand on `_replica_case` (static busy 27,840 ns a step): static
    steps measured at 1 ms + busy + (0, +1, -1) us, so their residuals' median is 1 ms and
    their MAD 1 us; plan steps the same spread around 1 ms + `shift`. The standard error is
    1.2533 * 1.4826 us * sqrt(1/3 + 1/3) = 1.517 us, with min(3, 3) - 1 = 2 degrees of freedom:
    conclusive beyond t = 4.303 of them (6.53 us). The model's test passes throughout (no
    transfers measured), so only the clock decides."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import MIN_WALL_STEPS, verdict

    cost, static, replica, counts = _replica_case()
    busy = 27_840e-9
    steps = np.stack([counts] * 3)  # [S=3, L, D, E]
    noise = np.array([0.0, 1e-6, -1e-6])

    def rows(residual: float) -> np.ndarray:
        out = np.zeros((3, len(selfcal.MEASURED)))
        out[:, selfcal.PERIOD] = residual + busy + noise
        return out

    guard = SwitchGuard(horizon=10)
    se = 1.2533 * 1.4826e-6 * np.sqrt(2 / 3)
    for shift, pays in [(-2e-6, True), (1e-6, True), (5e-6, True), (7e-6, False)]:
        v = verdict(cost, static, replica, steps, rows(1e-3 + shift), steps, rows(1e-3))
        assert v.wall_saving_s == pytest.approx(-shift, abs=1e-12)
        assert v.wall_se_s == pytest.approx(se, rel=1e-4) and v.dof == 2
        assert v.saving_s > v.cost_s  # the model's test alone would keep the plan
        assert guard.pays(v) is pays, shift
    # static steps priced out: the same static residual from twice the load
    heavy = verdict(cost, static, replica, steps, rows(1e-3 + 5e-6), 2 * steps,
                    rows(1e-3) + np.eye(len(selfcal.MEASURED))[selfcal.PERIOD] * busy)  # fmt: skip
    assert heavy.wall_saving_s == pytest.approx(-5e-6, abs=1e-12)
    few = verdict(cost, static, replica, steps, rows(1e-3 + 5e-6), steps[: MIN_WALL_STEPS - 1],
                  rows(1e-3)[: MIN_WALL_STEPS - 1])  # fmt: skip
    assert few.wall_saving_s is None and guard.pays(few)  # too few static steps: not taken
    # balancing judged as a whole: the plan's own 3 steps were fast, but 6 steps of balancing
    # since static (earlier plans' included) measured 6 us slower; MADs 1 us on 3 and 6 steps,
    # standard error 1.314 us with min(3, 6) - 1 = 2 degrees of freedom: 4.303 x 1.314 = 5.65
    pooled = verdict(cost, static, replica, steps, rows(1e-3 - 2e-6), steps, rows(1e-3),
                     np.concatenate([steps, steps]),
                     np.concatenate([rows(1e-3 + 6e-6), rows(1e-3 + 6e-6)]))  # fmt: skip
    assert pooled.wall_saving_s == pytest.approx(-6e-6, abs=1e-12)
    assert pooled.wall_se_s == pytest.approx(1.2533 * 1.4826e-6 * np.sqrt(1 / 3 + 1 / 6), rel=1e-4)
    assert pooled.dof == 2
    assert not guard.pays(pooled)
    homes = Placement.from_homes(np.array([[1, 0]]), 2, 2)  # homes swapped, no replica
    moved = Plan("homes", homes, Assignment.to_home(homes), None)  # type: ignore[arg-type]
    v = verdict(cost, static, moved, steps, rows(1e-3 + 5e-6), steps, rows(1e-3))
    assert v.wall_saving_s is None  # no Trans or Agg to measure: the model's test alone


def test_a_conclusive_wall_clock_overrules_the_model() -> None:
    """`pays` by hand: the model's test fails (over 3 steps the plan saves 3 x 4.16 = 12.48 us
    and measured 3 x (4 us of transfers + 1 us at the boundary) = 15 us); the clock's saving
    per step `w`, with standard error 1.517 us (as in the test above), decides when it is
    conclusive: w - z se > 0 keeps the plan, w + z se < 0 drops it (z = `clock_z(2)` = 4.303:
    3 steps a side, 2 degrees of freedom; z se = 6.53 us), else the model's test holds."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import verdict

    cost, static, replica, counts = _replica_case()
    busy = 27_840e-9
    steps = np.stack([counts] * 3)
    noise = np.array([0.0, 1e-6, -1e-6])

    def rows(residual: float, transfers: float = 0.0) -> np.ndarray:
        out = np.zeros((3, len(selfcal.MEASURED)))
        out[:, selfcal.PERIOD] = residual + busy + noise
        out[:, selfcal.TRANSFERS] = transfers
        out[:, selfcal.BOUNDARY] = 1e-6 if transfers else 0.0  # Trans launches
        return out

    guard = SwitchGuard(horizon=10)
    for saving, pays in [(7e-6, True), (4e-6, False), (0.0, False), (-4e-6, False), (-7e-6, False)]:
        plan_rows = rows(1e-3 - saving, transfers=4e-6)
        v = verdict(cost, static, replica, steps, plan_rows, steps, rows(1e-3))
        assert v.saving_s < v.cost_s  # the model's test alone would drop the plan
        assert v.wall_saving_s == pytest.approx(saving, abs=1e-12)
        assert guard.pays(v) is pays, saving
        assert guard.clock_says_slower(v) is (saving < -6.6e-6), saving
        assert not guard.model_refuted(v)  # slower, but the model saw it too: a stale plan
    # the model's test passing and the clock inconclusive: kept
    v = verdict(cost, static, replica, steps, rows(1e-3 + 2e-6), steps, rows(1e-3))
    assert v.saving_s > v.cost_s and guard.pays(v) and not guard.clock_says_slower(v)
    # the model's test passing and the clock conclusive against it: the model is refuted
    v = verdict(cost, static, replica, steps, rows(1e-3 + 7e-6), steps, rows(1e-3))
    assert v.saving_s > v.cost_s and not guard.pays(v) and guard.model_refuted(v)


def test_a_clock_that_refutes_the_models_prediction_judges_the_plan_itself() -> None:
    """`plan_pays` with probes (hand-made verdicts, 8 probes: 7 degrees of freedom, t = 2.365,
    18.92 ms at a standard error of 8 ms): a clock of -3 ms a step (not conclusive) where the
    model predicted +17 ms is 20 ms below the prediction, so the clock's own estimate decides
    (no saving: the plan goes, and the model that said it paid is refuted); +3 ms under a
    refuted +25 keeps it; a prediction the clock does not refute (+15 ms against -3 +- 8: 18 <
    18.92; +10: 13) leaves the model's counterfactual to decide, as without probes or with
    fewer than `MIN_PROBES`."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.verdict import MIN_PROBES, Verdict, plan_pays, prediction_refuted

    def v(clock: float, model: float | None, probes: int = 8, paid: bool = True) -> Verdict:
        saving, cost = (2.0, 1.0) if paid else (1.0, 2.0)  # the model's counterfactual
        return Verdict(saving, cost, 10, clock, 8e-3, probes, model)

    assert prediction_refuted(v(-3e-3, 17e-3)) and not plan_pays(v(-3e-3, 17e-3))
    assert SwitchGuard.model_refuted(v(-3e-3, 17e-3))
    assert not prediction_refuted(v(-3e-3, 15e-3)) and plan_pays(v(-3e-3, 15e-3))  # 18 < 18.92
    assert prediction_refuted(v(3e-3, 25e-3)) and plan_pays(v(3e-3, 25e-3, paid=False))
    assert not prediction_refuted(v(-3e-3, 10e-3)) and plan_pays(v(-3e-3, 10e-3))
    assert not plan_pays(v(-3e-3, 10e-3, paid=False))
    assert not prediction_refuted(v(-3e-3, 17e-3, probes=MIN_PROBES - 1))
    assert plan_pays(v(-3e-3, 17e-3, probes=MIN_PROBES - 1))
    assert not prediction_refuted(v(-3e-3, None)) and plan_pays(v(-3e-3, None))
    # a clock above the prediction (not conclusive) does not refute a model that failed it
    assert not prediction_refuted(v(10e-3, -10e-3)) and not plan_pays(v(10e-3, -10e-3, paid=False))


def test_a_plan_that_does_not_pay_gives_way_to_the_best_option() -> None:
    """`exit_choice` by hand (horizon 10, margin 0.2, switches priced at 2x the model):
    nets over the horizon, gain per step x 10 less the switch, the candidate's 1.2 times:
    candidate 4 x 10 - 1.2 x 2 x 5 = 28; homes alone 1 x 10 = 10; static 2 x 10 - 2 x 3 = 14."""
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import SwitchGuard

    def option(gain: float, switch: float) -> Assessment:
        return Assessment(False, current_busy_s=10.0, candidate_busy_s=10.0 - gain,
                          switch_s=switch)  # fmt: skip

    guard = SwitchGuard(horizon=10, margin=0.2)
    candidate, homes, static = option(4.0, 5.0), option(1.0, 0.0), option(2.0, 3.0)
    assert guard.exit_choice(candidate, [homes, static], False, switch_prior=2.0) == 0
    # the clock refuted the model that priced the candidate: only the exits count
    assert guard.exit_choice(candidate, [homes, static], True, switch_prior=2.0) == 2
    assert guard.exit_choice(Assessment(same=True), [homes, static], False, 2.0) == 2
    # a candidate that nets 18 - 1.2 x 2 x 1.8 = 13.68 < 14 (14.4 without the margin): static;
    # equal nets go to the exit listed first
    assert guard.exit_choice(option(1.8, 1.8), [homes, static], False, switch_prior=2.0) == 2
    assert guard.exit_choice(option(1.0, 0.0), [homes, option(1.0, 0.0)], False, 2.0) == 1
    # a measured k_switch replaces the prior once a switch was recorded
    guard.record_switch(0.5, 1.0)
    assert guard.exit_choice(option(4.0, 30.0), [homes, static], False, switch_prior=2.0) == 0


def test_a_replacement_is_credited_at_the_share_its_predecessor_delivered() -> None:
    """`delivered_share` and `replacement_credit` by hand: a plan promised 10 ms a step over
    static; on 8 steps the model's counterfactual saved 120 ms less 40 ms of measured transfers
    (10 ms a step: all of it), 80 - 40 (5: half), 20 - 60 (-5: none). `exit_choice` weighs the
    candidate (net 4 x 10 - 1.2 x 5 = 34 at full credit) at that share against static (20):
    at half credit 20 - 6 = 14, so static. The promise adds up over plans in a row and goes
    back to 0 on static, unknown (credit 1) on a fallback to homes alone."""
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.verdict import Verdict, delivered_share

    def paid(saving_ms: float, cost_ms: float) -> Verdict:
        return Verdict(saving_ms * 1e-3, cost_ms * 1e-3, 8)

    assert delivered_share(10e-3, paid(120, 40)) == pytest.approx(1.0)
    assert delivered_share(10e-3, paid(80, 40)) == pytest.approx(0.5)
    assert delivered_share(10e-3, paid(20, 60)) == 0.0
    assert delivered_share(10e-3, paid(400, 0)) == 1.0  # more than promised: full credit
    assert delivered_share(None, paid(20, 60)) == 1.0  # nothing known promised
    assert delivered_share(0.0, paid(20, 60)) == 1.0
    assert delivered_share(10e-3, None) == 1.0
    assert delivered_share(10e-3, Verdict(0.0, 0.0, 0)) == 1.0

    def option(gain: float, switch: float) -> Assessment:
        return Assessment(False, current_busy_s=10.0, candidate_busy_s=10.0 - gain,
                          switch_s=switch)  # fmt: skip

    guard = SwitchGuard(horizon=10, margin=0.2)
    assert guard.promised_s == 0.0  # on static
    guard.promised(6e-3, from_static=True)
    guard.promised(4e-3, from_static=False)  # (static - a) + (a - b)
    assert guard.promised_s == pytest.approx(10e-3)
    candidate, static = option(4.0, 5.0), option(2.0, 0.0)
    assert guard.exit_choice(candidate, [static], False, paid=paid(120, 40)) == 0
    assert guard.exit_choice(candidate, [static], False, paid=paid(80, 40)) == 1
    assert guard.exit_choice(candidate, [static], False, paid=paid(20, 60)) == 1
    replicas = Assessment(False, candidate_transfers_s=1e-3)  # a candidate holding replicas
    assert guard.replacement_credit(paid(80, 40), replicas) == pytest.approx(0.5)
    guard.trust = 0.5  # after a fallback the clock forced on the model: both shares apply
    assert guard.replacement_credit(paid(80, 40), replicas) == pytest.approx(0.25)
    assert guard.replacement_credit(paid(80, 40), candidate) == pytest.approx(0.5)  # no replica
    guard.returned(to_static=False)
    assert guard.promised_s is None and guard.replacement_credit(paid(20, 60), replicas) == 0.5
    guard.promised(3e-3, from_static=False)
    assert guard.promised_s is None  # still unknown: no base to add to
    guard.returned(to_static=True)
    assert guard.promised_s == 0.0


def test_the_leader_records_what_an_adopted_plan_promised() -> None:
    """`leader_outcome` carries the adopted candidate's credited gain a step (`decide`'s gain
    over the horizon it used), `exit_outcome` a replacement's at its credit (half here: 10 of
    20 ms a step delivered); the Balancer passes it to `SwitchGuard.promised`."""
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.leader import exit_outcome, leader_outcome
    from poise.runtime.plan_inputs import default_cluster
    from poise.runtime.planning_job import JobResult
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import Verdict
    from tests.helpers import toy_spec

    spec = toy_spec(experts=4, layers=1)
    p = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 3)
    plan = Plan("fresh", p, Assignment.even(p), transfers_between(None, p, spec))
    cand = Assessment(False, current_busy_s=1.0, candidate_busy_s=0.95, switch_s=0.01)
    guard = SwitchGuard(horizon=10, margin=0.2)
    # (its forecast held: the same candidate would have paid on the steps since)
    result = JobResult(plan, cand, default_cluster(2), selfcal.Fit(), None, backtest=cand)
    kw = dict(wait_s=0.0, plan_s=0.0, planning_s=0.0, period_s=0.1, plan_lag=1)
    out = leader_outcome(guard, result, on_static=True, **kw)
    assert out.decision == "adopt" and out.step_gain_s == pytest.approx(0.05)
    guard.promised(0.02, from_static=True)
    stale = Verdict(saving_s=0.2, cost_s=0.12, steps=8)  # 10 ms a step delivered of 20
    back = (plan, Assessment(False, current_busy_s=1.0, candidate_busy_s=1.0, switch_s=0.0))
    out = exit_outcome(guard, dataclasses.replace(result, paid=stale, exits=(back,)), 0.0, 1.0, 0)
    assert out.decision == "replace" and out.step_gain_s == pytest.approx(0.025)
    assert out.gain_s == pytest.approx(0.25)  # 0.5 x 0.05 x 10


def test_per_step_pricing_matches_a_loop_over_the_steps() -> None:
    """`live_parts` and `predicted_phases` price all steps in one call (the steps' layers end to
    end); the reference prices each step on its own, as a simulator would: they must agree, on
    a plan with replicas, per-step token splitting, host costs and ranks that share cores."""
    import dataclasses

    from poise.cost.host import dispatch_rows
    from poise.runtime.plan_inputs import default_cluster
    from poise.runtime.selfcal import fit as selfcal
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
    live = selfcal.live_parts(cost, plan, counts)
    pred = selfcal.predicted_phases(cost, plan, counts)
    pricer = cost.pricer(p, plan.assignment)
    for s, row in enumerate(counts):
        ph, device_load = pricer.phases(row)
        busy, transfers = selfcal.busy_and_transfers(ph)
        assert live[s] == pytest.approx([busy, transfers], rel=1e-12)
        per_device = dispatch_rows(row, device_load)  # [L, D]; 4 ranks sharing 2 cores
        rows = np.maximum(per_device.max(axis=1), per_device.sum(axis=1) / 2.0).sum()
        expected = [ph.expert_fwd_s.sum(), (ph.dispatch_s + ph.combine_s).sum(),
                    (ph.trans_s + ph.agg_s).sum(), rows]  # fmt: skip
        assert pred[s] == pytest.approx(expected, rel=1e-12)
    assert live[:, 1].min() > 0 and ph.dispatch_host_fwd_s.sum() > 0  # every term is in play
    assert selfcal.live_parts(cost, plan, counts[:0]).shape == (0, 2)


def test_self_calibration_fits_the_scales() -> None:
    from poise.runtime.selfcal import fit as selfcal

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
    """`_replica_case`'s replica plan, modelled per step: expert forward 60 * 128 FLOP / 1e9 =
    7,680 ns (d0's 60 tokens), dispatch + combine 2 * 20 * 16 B / 1e9 = 640 ns, Trans + Agg
    512 ns, the busiest dispatcher 100 rows (d0: 40 routed + 60 computed; d1: 60 + 40). Steps
    measured at 2x the compute, 3x the transfers and the link plus 100 ns per row: without a
    prior the fit recovers exactly 2, 3 and 100 ns, and the fitted cluster prices the plan's
    transfers at 3 * 512 ns, its all-to-all at the link's 640 ns and its dispatcher at 100 ns
    per row."""
    from poise.runtime.selfcal.fit import A2A, BOUNDARY, EXPERTS, TRANSFERS
    from poise.runtime.selfcal import fit as selfcal

    cost, static, replica, counts = _replica_case()
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
    """`_replica_case`: 128 FLOP a token at 1e9 FLOP/s. Static: d0 computes 30 tokens (e0:
    10 + 20), d1 70 -> 3,840 and 8,960 ns; the replica plan: d0 60 (its 30 e1-tokens stay),
    d1 40 -> 7,680 and 5,120 ns; summed over the layers of each step, the steps' counts scaled."""
    from poise.runtime.selfcal import fit as selfcal

    cost, static, replica, counts = _replica_case()
    steps = np.stack([counts, 2 * counts])
    assert selfcal.device_compute(cost, static, steps) == pytest.approx(
        np.array([[3_840e-9, 8_960e-9], [7_680e-9, 17_920e-9]])
    )
    assert selfcal.device_compute(cost, replica, steps)[0] == pytest.approx([7_680e-9, 5_120e-9])
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
    from poise.runtime.selfcal import fit as selfcal

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
    """`_replica_case`'s two plans, every rank's expert seconds 2 x its modelled forward + 5 us
    a step: `k_compute` 2 and `expert_fixed_s` 5 us from the ranks' own seconds (the slowest
    rank's alone, through the origin, fitted more); the next fit starts from it, and on steps
    whose ranks computed alike (no spread: nothing to fit) keeps it."""
    from poise.runtime.selfcal import fit as selfcal

    cost, static, _, counts = _replica_case()
    steps = np.stack([counts, 2 * counts, 3 * counts, 4 * counts])
    rank = 2.0 * selfcal.device_compute(cost, static, steps) + 5e-6
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


def test_background_planner_hands_results_over_at_the_adoption_step() -> None:
    import threading

    from poise.core.errors import PoiseError
    from poise.runtime.planner.background import BackgroundPlanner

    planner = BackgroundPlanner(process=False)  # a thread: the job is a closure
    release = threading.Event()
    planner.submit(lambda: release.wait(5) and "plan", requested_at=4, adopt_at=5)
    assert planner.busy and not planner.due(4) and planner.due(5)
    with pytest.raises(PoiseError, match="in flight"):
        planner.submit(lambda: None, 5, 6)
    threading.Timer(0.05, release.set).start()
    done = planner.take()  # waits for the thread
    # take() waited for the release, 0.05 s after the timer started (the job's own clock may
    # start late on a loaded machine, so only its sign is certain)
    assert done.value == "plan" and done.wait_s > 0.02 and done.plan_s > 0
    assert (done.requested_at, done.adopt_at) == (4, 5) and not planner.busy
    planner.close()


def test_a_plan_is_decided_as_many_steps_after_its_request_as_planning_took() -> None:
    """`adoption_lag` by hand, and the Balancer's use of it: each decision broadcasts the lag
    of the next request (the last job's wall time over the median step), which is decided
    that many steps after it is requested."""
    import time

    import torch

    from poise.runtime.leader import median_period_s
    from poise.runtime.planner.background import adoption_lag
    from poise.runtime.records import FIT_WINDOW
    from poise.runtime.selfcal import fit as selfcal

    assert adoption_lag(0.25, 0.1, 1) == 3  # ready during the third step
    assert adoption_lag(0.05, 0.1, 1) == 1 and adoption_lag(0.3, 0.1, 1) == 3
    assert adoption_lag(5.0, 0.1, 1) == 50  # longer than a re-plan period: it stretches
    assert adoption_lag(0.25, 0.0, 2) == 2  # no period measured yet: the least
    rows = np.zeros((4, 1 + len(selfcal.MEASURED)))
    rows[:, 1 + selfcal.PERIOD] = [0.0, 0.2, 0.4, 0.3]  # the first step has no period
    assert median_period_s(rows) == pytest.approx(0.3) and median_period_s(rows[:1]) == 0.0
    model, opt, balancer = _one_rank_balancer(replan_every=4, plan_lag=1, guard=False)
    balancer.lag = 3  # the first request (step 4) is decided at step 7
    lags = {}
    for _ in range(12):  # room for a second decision up to 4 steps after its request
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        time.sleep(0.3)  # steps far longer than this one-layer plan takes to make
        stats = balancer.step()
        opt.zero_grad()
        if stats.replanned:
            period = median_period_s(np.stack(balancer.measured)[-FIT_WINDOW:])
            lags[balancer.steps_done] = balancer.lag, period, stats.seconds["plan"]
    first, second = sorted(lags)[:2]
    assert first == 7
    lag, period, plan_s = lags[first]
    # (1 on an idle machine; more where the planner's process waits for the cores)
    assert lag == adoption_lag(plan_s, period, 1) and second == 8 + lag
    balancer.close()


def test_each_steps_period_holds_its_own_agg() -> None:
    """The step period the paired clock compares (`selfcal.PERIOD`) runs from one step's Agg
    landing to the next's: a step whose Agg takes 0.3 s longer to land (the real finish, then
    a sleep) has a period at least that long, and its neighbours do not. Ended before the Agg,
    the next step's period carried it, so a probe step (no Agg of its own) read its
    predecessor's Agg as its own time and the clock credited the replicas with it."""
    import time

    from poise.runtime.selfcal import fit as selfcal

    model, opt, balancer = _one_rank_balancer(replan_every=100, plan_lag=1, guard=False)
    finish = balancer.moves.finish_aggs
    slow = 3  # the step (`steps_done` when its Agg lands) whose Agg is slow

    def slow_finish(stats) -> None:
        finish(stats)
        if balancer.steps_done == slow:
            time.sleep(0.3)

    balancer.moves.finish_aggs = slow_finish
    _one_rank_steps(model, opt, balancer, 6)
    rows = np.stack(balancer.measured)
    steps, periods = rows[:, 0].astype(int).tolist(), rows[:, 1 + selfcal.PERIOD].tolist()
    period = dict(zip(steps, periods, strict=True))
    assert period[slow] >= 0.3, period
    assert period[slow - 1] < 0.15 and period[slow + 1] < 0.15, period
    balancer.close()


def test_a_planner_slower_than_the_interval_stretches_it() -> None:
    """With a lag longer than `replan_every` (a planner known to take more steps than the
    interval), the re-plans due while a plan is in flight are skipped and no boundary waits:
    requested at 4, decided at 10 (8 skipped), the next request at 12, decided at 18."""
    import torch

    model, opt, balancer = _one_rank_balancer(replan_every=4, plan_lag=1, guard=False)
    requested: list[int] = []
    submit = balancer.planner.submit

    def spy(job, requested_at: int, adopt_at: int) -> None:
        requested.append(requested_at)
        submit(job, requested_at=requested_at, adopt_at=adopt_at)

    balancer.planner.submit = spy
    balancer.lag = 6
    decided = []
    for _ in range(19):
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        stats = balancer.step()
        opt.zero_grad()
        if stats.replanned:
            decided.append(balancer.steps_done)
            balancer.lag = 6  # held, whatever the job's measured time would give
    assert requested == [4, 12] and decided == [10, 18]
    balancer.close()


def test_a_fallback_drops_replicas_before_it_moves_homes_back() -> None:
    """`fallback_target`: replicas with static homes -> static; replicas on moved homes -> those
    homes alone (no migration now); moved homes alone -> static."""
    from poise.runtime.guard import exit_plans, fallback_target
    from tests.helpers import toy_spec

    spec = toy_spec(experts=2)
    _, static, replica, _ = _replica_case()
    assert fallback_target(replica, static, spec) is static  # homes are static's already
    swapped = Placement.from_homes(np.array([[1, 0]]), 2, 2)  # e0 on d1, e1 on d0
    moved = swapped.copy()
    moved.copies[0, 1, 1] = 1  # and a replica of e1 on d1
    plan = Plan("m", moved, Assignment.to_home(moved), transfers_between(None, moved, spec))
    target = fallback_target(plan, static, spec)
    assert target.placement.home.tolist() == [[1, 0]]  # homes stay where the plan put them
    assert not target.placement.replicas().any()
    assert target.transfers.migrations is None or not len(target.transfers.migrations)
    np.testing.assert_array_equal(target.assignment.weights, Assignment.to_home(swapped).weights)
    assert fallback_target(target, static, spec) is static  # then the static homes come back
    # the exits the guard weighs: those homes alone, then static with its moves back
    first, back = exit_plans(plan, static, spec)
    assert first.digest() == target.digest() and back.digest() == static.digest()
    assert back.transfers.migrations[:, 1:].tolist() == [[0, 1, 0], [1, 0, 1]]
    (only,) = exit_plans(replica, static, spec)
    assert only.digest() == static.digest() and not len(only.transfers.migrations)


def test_the_planner_thread_runs_at_the_lowest_priority() -> None:
    """Its niceness is 19 (Linux: per thread), the training thread's is unchanged."""
    import os
    import sys
    import threading

    from poise.runtime.planner.background import BackgroundPlanner

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread priority is Linux's")
    planner = BackgroundPlanner(process=False)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    planner.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), 0, 0)
    assert planner.take().value == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    planner.close()


def test_the_planner_process_runs_jobs_elsewhere_at_the_lowest_priority() -> None:
    """The default planner runs each pickled job in its worker process, at nice 19; a job's
    exception re-raises at `take`, a job that does not pickle and a worker that dies are one
    clear `PoiseError` each."""
    import os
    import sys
    from functools import partial

    from poise.core.errors import PoiseError
    from poise.runtime.planner.background import BackgroundPlanner

    planner = BackgroundPlanner(preload=("poise.runtime.planning_job",))
    try:
        planner.submit(partial(os.getpid), requested_at=0, adopt_at=1)
        done = planner.take()
        assert done.value != os.getpid() and done.plan_s >= 0 and done.cpu_s >= 0
        loaded = (
            "[m in __import__('sys').modules for m in ('poise.runtime.planning_job', 'numpy.ma')]"
        )
        planner.submit(partial(eval, loaded), 0, 0)  # imported before the first job
        assert planner.take().value == [True, True]  # numpy.ma: `LAZY_IMPORTS`
        if sys.platform.startswith("linux"):
            planner.submit(partial(os.getpriority, os.PRIO_PROCESS, 0), 1, 1)
            assert planner.take().value == 19
        planner.submit(partial(int, "not a number"), 2, 2)
        with pytest.raises(ValueError, match="not a number"):
            planner.take()
        with pytest.raises(PoiseError, match="must pickle"):
            planner.submit(lambda: None, 3, 3)
        assert not planner.busy
        planner.submit(partial(os._exit, 3), 4, 4)
        with pytest.raises(PoiseError, match="exited with status 3"):
            planner.take()
    finally:
        planner.close()
    import gc

    from poise.runtime.planner.background import WorkerProcess

    dropped = WorkerProcess()
    proc = dropped.proc
    del dropped  # never closed: its finalizer ends the worker's input, and it exits
    gc.collect()
    assert proc.wait(timeout=10) == 0
    # a Ctrl-C reaches the worker with its rank (one process group): the rank answers it, the
    # worker goes on serving until its input ends
    import pickle
    import signal

    worker = WorkerProcess(("poise.runtime.planning_job",))
    worker.call(pickle.dumps(partial(os.getpid)))  # started: its handlers are set
    worker.proc.send_signal(signal.SIGINT)
    assert worker.call(pickle.dumps(partial(abs, -7)))[0] == 7
    assert worker.proc.stdin is not None
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=10) == 0


def test_the_planner_process_takes_the_priority_it_is_given() -> None:
    """`priority="idle"` runs the worker at SCHED_IDLE where Linux has it, the default at
    nice 19 with the normal policy; an unknown priority is one clear error."""
    import os
    import sys
    from functools import partial

    from poise.core.errors import PoiseError
    from poise.runtime.planner.background import BackgroundPlanner

    with pytest.raises(PoiseError, match="priority must be one of"):
        BackgroundPlanner(priority="realtime")
    if not sys.platform.startswith("linux"):
        pytest.skip("scheduling policies are Linux's")
    inherited = os.getpriority(os.PRIO_PROCESS, 0)  # SCHED_IDLE leaves the nice value alone
    for priority, policy, nice in (
        ("idle", os.SCHED_IDLE, inherited),
        ("nice", os.SCHED_OTHER, 19),
    ):
        planner = BackgroundPlanner(priority=priority)
        try:
            planner.submit(partial(os.sched_getscheduler, 0), 0, 0)
            assert planner.take().value == policy
            planner.submit(partial(os.getpriority, os.PRIO_PROCESS, 0), 0, 0)
            assert planner.take().value == nice
        finally:
            planner.close()


def test_a_plan_that_only_changes_replicas_moves_no_home() -> None:
    """`apply` re-lays rows (a collective over every weight and moment) only where home slots
    change: adding, swapping or dropping replicas keeps every rank's homes in their slots."""
    from poise.nn.slots import slot_maps
    from poise.runtime.moves.layer_state import same_homes

    static = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 3)
    replica = static.copy()
    replica.copies[0, 0, 2] = 1  # rank 0 also holds e2
    swapped = static.copy()
    swapped.copies[0, 0, 3] = 1  # rank 0 holds e3 instead
    moved = Placement.from_homes(np.array([[0, 1, 0, 1]]), 2, 3)
    maps = {
        n: slot_maps(p, 0, 3)
        for n, p in {
            "static": static,
            "replica": replica,
            "swapped": swapped,
            "moved": moved,
        }.items()
    }
    assert same_homes(maps["static"], maps["replica"])
    assert same_homes(maps["replica"], maps["swapped"])
    assert same_homes(maps["swapped"], maps["static"])
    assert not same_homes(maps["static"], maps["moved"])  # e1 and e2 change rank


def _static_auto_job():
    """A `run_job` case: `auto` from a static layout whose rank 0 holds the 4 hot experts of 8
    (2 ranks, 5 slots each), 4 steps of the same counts measured, calibrating, not the first
    re-plan (a backtest plan is given: no holdout)."""
    from poise.plan.predict import Predictor
    from poise.runtime.planning_job import PlanningJob
    from poise.runtime.selfcal import fit as selfcal
    from tests.helpers import toy_cluster, toy_spec

    spec = toy_spec(experts=8, d_model=64, d_expert=256)
    home = Placement.from_homes(np.array([[0, 0, 0, 0, 1, 1, 1, 1]]), 2, 5)
    static = Plan("static", home, Assignment.to_home(home), transfers_between(None, home, spec))
    counts = np.array([[[60, 50, 40, 30, 5, 5, 5, 5]] * 2], dtype=float)
    history = np.repeat(counts[None], 4, axis=0)
    rows = np.zeros((4, 1 + len(selfcal.MEASURED)))
    rows[:, 0] = np.arange(1, 5)
    rows[:, 1 + selfcal.PERIOD] = 0.01
    none = np.zeros((0, *counts.shape))
    return PlanningJob(
        history=history, fit_counts=history, fit_rows=rows, settled=np.ones(4, dtype=bool),
        static_counts=none, static_rows=np.zeros((0, rows.shape[1])), balanced_counts=none,
        balanced_rows=np.zeros((0, rows.shape[1])), current=static, static=static,
        prior=toy_cluster(bw=1e9, flops=1e9), spec=spec, previous=selfcal.Fit(),
        policy="auto", predictor=Predictor("last"), options={}, slots=5, calibrate=True,
        split_tokens=False, horizon=10, measured_switch=None,
        backtest_plan=static, backtest_counts=history[:1],  # not the first re-plan: no holdout
    )  # fmt: skip


def test_the_switches_measured_price_steers_auto_only_when_calibrating() -> None:
    """`run_job` on `_static_auto_job`: at the prior's migration price its plan moves homes;
    with switches measured at 1e6 times their model it replicates instead. That measured
    figure is a fitted one: with calibration off the plan is the prior's, whatever the switches
    measured (which steps switch, and to what, must not depend on the machine's speed)."""
    from dataclasses import replace

    from poise.runtime.planning_job import run_job

    job = _static_auto_job()
    static = job.static
    moves = run_job(job).plan
    dear = run_job(replace(job, measured_switch=1e6)).plan
    assert moves.digest() != static.digest() and moves.placement.replicas().sum() == 0
    assert dear.placement.replicas().sum() > 0
    fixed = replace(job, calibrate=False)
    assert run_job(replace(fixed, measured_switch=1e6)).plan.digest() == moves.digest()


@pytest.mark.parametrize("transfer_s", [0.0, 1.0])
def test_the_planning_job_prices_the_exits_only_when_the_plan_in_force_did_not_pay(
    transfer_s: float,
) -> None:
    """`run_job` on `_replica_case`'s replica plan in force, 4 settled steps: with no transfer
    seconds measured its model saving (4,160 ns a step) pays and no exit is priced; with 1 s of
    transfers a step it does not (`plan_pays`), and both exits of `exit_plans` come priced
    (here one: static). With the guard off, none is priced."""
    from poise.plan.predict import Predictor
    from poise.runtime.planning_job import PlanningJob, run_job
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import plan_pays
    from tests.helpers import toy_spec

    cost, static, replica, counts = _replica_case()
    history = np.repeat(counts[None], 4, axis=0)
    rows = np.zeros((4, 1 + len(selfcal.MEASURED)))
    rows[:, 0] = np.arange(1, 5)
    rows[:, 1 + selfcal.PERIOD] = 0.01
    rows[:, 1 + selfcal.TRANSFERS] = transfer_s
    none = np.zeros((0, *counts.shape))
    job = PlanningJob(
        history=history, fit_counts=history, fit_rows=rows, settled=np.ones(4, dtype=bool),
        static_counts=none, static_rows=np.zeros((0, rows.shape[1])), balanced_counts=none,
        balanced_rows=np.zeros((0, rows.shape[1])), current=replica, static=static,
        prior=cost.cluster, spec=toy_spec(experts=2), previous=selfcal.Fit(), policy="static",
        predictor=Predictor("last"), options={}, slots=2, calibrate=False, split_tokens=False,
        horizon=10, measured_switch=None,
    )  # fmt: skip
    result = run_job(job)
    assert result.paid is not None and result.paid.steps == 4
    assert plan_pays(result.paid) == (transfer_s == 0.0)
    assert [p.digest() for p, _ in result.exits] == ([] if transfer_s == 0.0 else [static.digest()])
    from dataclasses import replace

    assert run_job(replace(job, guarded=False)).exits == ()
    # near the run's end the guard credits no step past it (the job's own horizon is 10)
    assert result.horizon == 10 and run_job(replace(job, steps_left=3)).horizon == 3
    # and `auto`'s horizon stops there too (its plan's note)
    ending = run_job(replace(job, policy="auto", steps_left=3))
    assert ending.plan.notes["horizon"] == 3.0 and ending.horizon == 3
    # with probes (the Balancer probing), the verdict's clock comes from them: 4 probe steps
    # each 1 ms slower than their one neighbour (the replicas save 1 ms a step, exactly)
    from poise.runtime.paired_clock import Probes
    from poise.runtime.verdict import MIN_PROBES

    n = MIN_PROBES
    probe_rows = np.zeros((n, len(selfcal.MEASURED)))
    probe_rows[:, selfcal.PERIOD] = 0.011
    pair_rows = probe_rows.copy()
    pair_rows[:, selfcal.PERIOD] = 0.010
    probes = Probes(history[:1].repeat(n, 0), probe_rows, history[:1].repeat(n, 0), pair_rows,
                    np.arange(n))  # fmt: skip
    paid = run_job(replace(job, probes=probes)).paid
    assert paid is not None and paid.probes == n
    assert paid.wall_saving_s == pytest.approx(1e-3) and paid.wall_se_s == pytest.approx(0.0)
    # calibrating, the compute is fitted on every rank's own seconds where the job has them:
    # 3 x the model's per device (steps scaled so that the ranks' rows differ step to step)
    steps = history * np.arange(1, 5)[:, None, None, None]
    own = 3.0 * selfcal.device_compute(cost, replica, steps)
    fitted = run_job(replace(job, fit_counts=steps, calibrate=True, fit_rank_experts=own)).fit
    assert fitted.k_compute == pytest.approx(3.0)


@pytest.mark.dist
def test_every_rank_s_seconds_are_recorded_as_it_measured_them(two_ranks: list[dict]) -> None:
    """`StepStats.rank_seconds`: on both ranks, per step, every `selfcal.MEASURED` column, and
    rank r's experts seconds are what rank r measured itself (to the nanosecond the gather
    rounds to); some rank's transfers column is non-zero (the run had replicas)."""
    from poise.runtime.selfcal import fit as selfcal

    runs = [r["probed"] for r in two_ranks]
    for run in runs:
        assert len(run["rank_seconds"]) == len(run["own_experts"]) > 0
        for step, gathered in enumerate(run["rank_seconds"]):
            assert set(gathered) == set(selfcal.MEASURED)
            for r, other in enumerate(runs):
                assert gathered["experts_s"][r] == pytest.approx(
                    other["own_experts"][step], abs=1e-9
                )
    assert any(x > 0 for run in runs for g in run["rank_seconds"] for x in g["transfers_s"])
    # the planning jobs fit the compute on those seconds, each fit step's row as gathered
    by_step = dict(enumerate(g["experts_s"] for g in runs[0]["rank_seconds"]))
    jobs = runs[0]["job_rank_experts"]
    assert jobs and all(job for job in jobs)
    for job in jobs:
        for step, row in job.items():
            assert row == pytest.approx(by_step[step], abs=1e-9)


def test_probe_steps_idle_the_replicas_and_keep_the_mathematics(two_ranks: list[dict]) -> None:
    """Probe steps (`Balancer(probe_every=3, max_probes=2)`): both ranks probe at the same
    steps, at most twice, only on the cadence and while a plan with replicas is in force; the
    boundary before a probe launches no Trans and the probe step runs no Agg (its replicas
    idle); each probe row is recorded as such and paired with its neighbours; the losses
    are static EP's."""
    from poise.runtime.balancer import PROBE, REPLICAS

    runs = [r["probed"] for r in two_ranks]
    assert runs[0]["probe_steps"] == runs[1]["probe_steps"]
    for r in two_ranks:
        losses = r["probed"]["losses"]
        np.testing.assert_allclose(losses, r["reference"][0][: len(losses)], rtol=TOL, atol=TOL)
    probed = runs[0]
    steps = probed["probe_steps"]
    assert 1 <= len(steps) <= 2, probed
    # a step's stats carry the number of the boundary it ran after: probes start at
    # boundaries s with (s - plan_since) % 3 == 1 (3 // 2), counted from the plan's switch
    begun = [b for b, _ in probed["probe_since"]]  # one begun at the last boundary never ran
    assert begun[: len(steps)] == steps and len(begun) - len(steps) <= 1, probed["probe_since"]
    assert all((b - since) % 3 == 1 and b - since >= 2 for b, since in probed["probe_since"])
    assert all(b == (0, 0) for b in probed["probe_bytes"]), probed["probe_bytes"]
    assert any(b > 0 for b in probed["replica_steps_bytes"])  # replicas did work elsewhere
    layout = probed["row_layout"]
    assert layout.count(PROBE) == len(steps)
    for i, lay in enumerate(layout):
        if lay == PROBE:  # between two steps run under the plan's replicas (or at the end)
            assert layout[i - 1] == REPLICAS and (i + 1 == len(layout) or layout[i + 1] == REPLICAS)
    # each step's stats name the layout it ran under, as the records hold it
    from poise.runtime.records import LAYOUT_NAMES

    names = [name for _, name in probed["layouts"]]
    assert names[-len(layout) :] == [LAYOUT_NAMES[x] for x in layout]
    assert names[0] == "static" and "replicas" in names
    assert [t for t, name in probed["layouts"] if name == "probe"] == steps
    n, pair_of = probed["pairs"]
    assert n == len(steps) and sorted(set(pair_of)) == list(range(n))
    # the self-calibration never fits a probe step (it ran another layout); jobs carry probes
    fitted = {t for rows in probed["fit_steps"] for t in rows}
    assert fitted and not fitted & set(steps), (fitted, steps)
    assert probed["job_probes"] and all(p is not None for p in probed["job_probes"])
    assert runs[1]["fit_steps"] == []  # only the leader plans


def test_the_paired_clock_sees_through_the_machines_drift() -> None:
    """`paired_clock` and `verdict(probes=)` by hand on `_replica_case` (static busy 27,840 ns a
    step): four probe steps, each 5 us slower than its neighbours (the replicas save 5 us a
    step), while the machine's speed drifts by 0, +100, -80 and +50 us from one probe to the
    next. d = (5, 5 + 1, 5 - 1, 5) us -> saving 5 us, standard error std(d) / 2 = 0.408 us.
    The static steps of the run's start, at drift 0, would have judged the same plan on the
    drift instead (the clock's older test, without probes); with fewer than `MIN_PROBES`
    probes the clock is not taken."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.paired_clock import Probes, paired_clock
    from poise.runtime.selfcal import fit as selfcal
    from poise.runtime.verdict import MIN_PROBES, verdict

    cost, static, replica, counts = _replica_case()
    busy = 27_840e-9
    drift = np.array([0.0, 100e-6, -80e-6, 50e-6])
    jitter = np.array([0.0, 1e-6, -1e-6, 0.0])  # the probes' own noise

    def rows(period: np.ndarray) -> np.ndarray:
        out = np.zeros((len(period), len(selfcal.MEASURED)))
        out[:, selfcal.PERIOD] = period
        return out

    probe_periods = 1e-3 + busy + drift + 5e-6 + jitter
    pair_periods = np.repeat(1e-3 + busy + drift, 2)  # a neighbour before and after each
    n = len(drift)
    probes = Probes(
        np.stack([counts] * n), rows(probe_periods), np.stack([counts] * 2 * n),
        rows(pair_periods), np.repeat(np.arange(n), 2),
    )  # fmt: skip
    saving, se = paired_clock(cost, static, probes)
    d = 5e-6 + jitter
    assert saving == pytest.approx(5e-6, abs=1e-12)
    assert se == pytest.approx(float(np.std(d, ddof=1) / 2), rel=1e-9)
    steps = np.stack([counts] * n)
    v = verdict(cost, static, replica, steps, rows(pair_periods[::2]), probes=probes)
    assert (v.wall_saving_s, v.wall_se_s, v.probes) == (saving, se, n)
    # what the model predicts the clock measures: the homes alone (static's here) 27,840 ns
    # busy, the replica plan 23,680 ns and 512 ns of Trans + Agg -> 3,648 ns a step
    assert v.modelled_clock_s == pytest.approx(3_648e-9)
    assert v.as_dict()["modelled_clock_s"] == v.modelled_clock_s  # as the step's line logs it
    assert SwitchGuard(horizon=10).pays(v)  # conclusive: 5 us > 2 x 0.41 us
    # probes 5 us *faster* than their neighbours: the replicas cost 5 us; the plan goes
    slower = Probes(probes.counts, rows(probe_periods - 10e-6), probes.pair_counts,
                    probes.pair_measured, probes.pair_of)  # fmt: skip
    v = verdict(cost, static, replica, steps, rows(pair_periods[::2]), probes=slower)
    assert v.wall_saving_s == pytest.approx(-5e-6, abs=1e-12) and v.saving_s > v.cost_s
    assert not SwitchGuard(horizon=10).pays(v)
    # the static-reference test on the same steps reads the drift: static at drift 0 against
    # the plan's steps at +25 us (their median) says the plan costs 25 us a step
    old = verdict(cost, static, replica, steps, rows(pair_periods[::2]), steps[:3],
                  rows(np.full(3, 1e-3 + busy)), steps, rows(pair_periods[::2]))  # fmt: skip
    assert old.wall_saving_s == pytest.approx(-25e-6, abs=1e-9) and old.probes == 0
    few = Probes(probes.counts[: MIN_PROBES - 1], probes.measured[: MIN_PROBES - 1],
                 probes.pair_counts[: 2 * (MIN_PROBES - 1)],
                 probes.pair_measured[: 2 * (MIN_PROBES - 1)],
                 probes.pair_of[: 2 * (MIN_PROBES - 1)])  # fmt: skip
    v = verdict(cost, static, replica, steps, rows(pair_periods[::2]), probes=few)
    assert v.wall_saving_s is None and v.probes == 0


def _probes_reading(counts: np.ndarray, clocks_s: np.ndarray):
    """`Probes` on `_replica_case`'s counts whose probe i ran `clocks_s[i]` slower than its
    one neighbour (the paired clock's `d_i`)."""
    from poise.runtime.paired_clock import Probes
    from poise.runtime.selfcal import fit as selfcal

    n = len(clocks_s)
    steps = np.stack([counts] * n)
    rows = np.zeros((n, len(selfcal.MEASURED)))
    rows[:, selfcal.PERIOD] = 1e-3 + clocks_s
    pairs = np.zeros((n, len(selfcal.MEASURED)))
    pairs[:, selfcal.PERIOD] = 1e-3
    return Probes(steps, rows, steps, pairs, np.arange(n))


def _replica_job(probes):
    """A calibrating `PlanningJob` with `_replica_case`'s replica plan in force for as many
    steps as `probes` has, those steps' rows empty but their periods (1 ms)."""
    from poise.plan.predict import Predictor
    from poise.runtime.planning_job import PlanningJob
    from poise.runtime.selfcal import fit as selfcal
    from tests.helpers import toy_spec

    cost, static, replica, counts = _replica_case()
    n = len(probes)
    steps = np.stack([counts] * n)
    rows = np.zeros((n, 1 + len(selfcal.MEASURED)))
    rows[:, 0] = np.arange(1, n + 1)
    rows[:, 1 + selfcal.PERIOD] = 1e-3
    none = np.zeros((0, *counts.shape))
    return PlanningJob(
        history=steps, fit_counts=steps, fit_rows=rows, settled=np.ones(n, dtype=bool),
        static_counts=none, static_rows=np.zeros((0, rows.shape[1])), balanced_counts=none,
        balanced_rows=np.zeros((0, rows.shape[1])), current=replica, static=static,
        prior=cost.cluster, spec=toy_spec(experts=2), previous=selfcal.Fit(), policy="static",
        predictor=Predictor("last"), options={}, slots=2, calibrate=True, split_tokens=False,
        horizon=10, measured_switch=None, probes=probes,
    )  # fmt: skip


def test_replicas_are_priced_at_what_the_paired_clock_measured_them_to_cost(monkeypatch) -> None:
    """`replica_scale` by hand on `_replica_case` (the replica saves B = 27,840 - 23,680
    = 4,160 ns of busy, its Trans + Agg T = 512 ns): a clock of 2,112 ns a step means the
    replica cost 4,160 - 2,112 = 2,048 ns = 4 T; a clock above B - T leaves 1; one that measured
    the replica 5 us slower, (4,160 + 5,000) / 512. A calibrating planning job with such probes
    records `k_replica` 4 and prices its plans with transfers 4 times as dear (its fitted
    cluster's `transfer_scale`; the prior's constants otherwise, the job's rows being empty),
    and `auto`'s migration price is divided by it (a migration is priced at the switch's own
    scale, not the replicas')."""
    from dataclasses import replace

    from poise.runtime.paired_clock import Probes, replica_scale
    from poise.runtime.planning_job import run_job

    cost, static, replica, counts = _replica_case()
    n = 4

    def probes_with(clock_s: float) -> Probes:
        return _probes_reading(counts, np.full(n, clock_s))

    assert replica_scale(cost, replica, probes_with(2_112e-9), 2_112e-9) == pytest.approx(4.0)
    assert replica_scale(cost, replica, probes_with(4e-6), 4e-6) == 1.0
    assert replica_scale(cost, replica, probes_with(-5e-6), -5e-6) == pytest.approx(9_160 / 512)
    assert replica_scale(cost, static, probes_with(-5e-6), -5e-6) == 1.0  # no Trans to price
    job = _replica_job(probes_with(2_112e-9))
    import poise.runtime.planning_job as planning_job

    seen: dict = {}
    live_plan = planning_job.live_plan

    def spy(*args):
        seen["options"] = args[7]
        return live_plan(*args)

    monkeypatch.setattr(planning_job, "live_plan", spy)
    result = run_job(job)
    assert result.paid is not None and result.paid.wall_saving_s == pytest.approx(2_112e-9)
    # a migration at the transfers' own scale (1 here) on a cluster whose transfers are 4x
    assert seen["options"]["auto"]["migration_scale"] == pytest.approx(0.25)
    assert result.fit.k_replica == pytest.approx(4.0) and result.fit.k_transfer == 1.0
    assert result.cluster.host.transfer_scale == pytest.approx(
        4.0 * cost.cluster.host.transfer_scale
    )
    # no clock this time (no probes): the previous fit's k_replica stands
    again = run_job(replace(job, probes=None, previous=result.fit))
    assert again.fit.k_replica == pytest.approx(4.0)
    assert run_job(replace(job, calibrate=False)).fit.k_replica == 1.0


def test_while_the_clock_refutes_replicas_auto_plans_homes_only() -> None:
    """`_replica_case` from the static layout: `auto` places 2 replicas; with `homes_only` (the
    guard's trust at 0) it weighs only `keep`, `permute` and `static` and places none.
    `homes_only_options` keeps the homes-only policies of a user's list, `static` where none is
    left."""
    from dataclasses import replace

    from poise.runtime.planning_job import homes_only_options, run_job

    _, static, _, counts = _replica_case()
    job = replace(_replica_job(_probes_reading(counts, np.full(4, 2e-6))), policy="auto",
                  current=static, probes=None, backtest_plan=static,
                  backtest_counts=counts[None])  # not the first re-plan: no holdout  # fmt: skip
    assert run_job(job).plan.placement.replicas().sum() == 2
    homes = run_job(replace(job, homes_only=True)).plan
    assert homes.placement.replicas().sum() == 0
    assert set(homes.notes["candidate_step_s"]) <= {"keep", "permute", "static"}
    assert homes_only_options({})["auto"]["candidates"] == ["permute", "static"]
    mine = {"auto": {"candidates": ["prophet", "permute"], "horizon": 5}}
    assert homes_only_options(mine)["auto"] == {"candidates": ["permute"], "horizon": 5}
    assert homes_only_options({"auto": {"candidates": ["prophet"]}})["auto"]["candidates"] == [
        "static"
    ]
    assert mine["auto"]["candidates"] == ["prophet", "permute"]  # a copy


def test_a_planning_job_hands_the_carried_age_to_auto() -> None:
    """`_replica_case`'s 4 identical steps hold throughout, so with `held_before` 70 the plan's
    pattern is 74 steps old and its horizon 74; with none, 4 and the base of 10."""
    from dataclasses import replace

    from poise.runtime.planning_job import run_job

    _, static, _, counts = _replica_case()
    job = replace(_replica_job(_probes_reading(counts, np.full(4, 2e-6))), policy="auto",
                  current=static, probes=None)  # fmt: skip
    carried = run_job(replace(job, held_before=70))
    assert carried.plan.notes["pattern_age"] == 74 and carried.horizon == 74
    fresh = run_job(job)
    assert fresh.plan.notes["pattern_age"] == 4 and fresh.horizon == 10


def test_replicas_are_priced_dearer_only_by_what_the_clock_shows_beyond_its_noise() -> None:
    """The same case with a noisy clock: 4 probes reading 1,912 and 2,312 ns in turn, mean
    2,112 ns (which alone would price the replica at 4 T, as above), standard error
    sqrt(4 * 200^2 / 3) / 2 = 115.47 ns. The job prices replicas at the clock's ceiling, 2,112 +
    3.182 (t, 3 degrees of freedom) x 115.47 = 2,479.4 ns: k_replica = (4,160 - 2,479.4) / 512
    = 3.28. A clock as wide as its mean (1,112 and 3,112 ns) proves nothing: k_replica 1."""
    from poise.runtime.planning_job import run_job

    _, _, _, counts = _replica_case()
    noisy = _probes_reading(counts, np.array([1_912e-9, 2_312e-9] * 2))
    result = run_job(_replica_job(noisy))
    se = np.sqrt(4 * 200.0**2 / 3) / 2
    assert result.paid is not None and result.paid.wall_se_s == pytest.approx(se * 1e-9)
    assert result.fit.k_replica == pytest.approx((4_160 - (2_112 + 3.182 * se)) / 512)
    wide = _probes_reading(counts, np.array([1_112e-9, 3_112e-9] * 2))
    assert run_job(_replica_job(wide)).fit.k_replica == 1.0


def test_probing_stops_once_the_paired_clock_has_spoken() -> None:
    """`clock_settled` by hand: no verdict, fewer than `MIN_PROBES` probes, a saving within
    `CLOCK_Z` standard errors: not settled; beyond them, either way: settled. A Balancer under
    replicas probes on its cadence until a shared verdict settles the clock, then no more in
    that episode; a layout without replicas starts a new episode."""
    import torch

    from poise.nn import MoE, MoEConfig, apply_expert_parallel
    from poise.runtime.balancer import OTHER, REPLICAS, Balancer
    from poise.runtime.plan_inputs import default_cluster
    from poise.runtime.verdict import MIN_PROBES, Verdict, clock_settled, clock_z

    def v(saving: float | None, se: float, probes: int = MIN_PROBES) -> Verdict:
        return Verdict(1.0, 0.5, 10, wall_saving_s=saving, wall_se_s=se, probes=probes)

    assert not clock_settled(None)
    assert not clock_settled(v(None, 0.0))
    assert not clock_settled(v(10e-3, 1e-3, probes=MIN_PROBES - 1))
    z = clock_z(MIN_PROBES - 1)  # t with 3 degrees of freedom: 3.182
    assert z == 3.182
    assert not clock_settled(v(z * 1e-3 - 1e-6, 1e-3))  # just inside
    assert not clock_settled(v(2.5e-3, 1e-3))  # beyond 2 standard errors, not beyond t's 3.182
    assert clock_settled(v(z * 1e-3 + 1e-6, 1e-3))
    assert clock_settled(v(-(z * 1e-3 + 1e-6), 1e-3))  # conclusive the other way too
    assert clock_settled(v(2.5e-3, 1e-3, probes=12))  # 11 degrees of freedom: 2.201

    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
    apply_expert_parallel(model, None, num_slots=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    balancer = Balancer(model, opt, "auto", cluster=default_cluster(1), probe_every=5)
    balancer._layout, balancer._plan_since = REPLICAS, 0  # as if a plan with replicas ran
    assert [s for s in range(2, 20) if balancer._probe_due(s)] == [2, 7, 12, 17]
    # counted from the plan's switch: adopted at 11, 4 probes start before the re-plan at 31
    balancer._plan_since = 11
    assert [s for s in range(11, 40) if balancer._probe_due(s)] == [13, 18, 23, 28, 33, 38]
    balancer._plan_since = 0
    balancer.note_verdict(v(1e-3, 1e-3))  # inconclusive: probing goes on
    assert balancer._probe_due(7)
    balancer.note_verdict(v(5e-3, 1e-3))
    assert not any(balancer._probe_due(s) for s in range(2, 20))
    balancer.note_verdict(None)  # a later verdict without probes does not undo it
    assert not balancer._probe_due(7)
    balancer.apply(balancer.static_plan, balancer._current)  # the episode ends
    assert balancer._layout != REPLICAS and balancer._layout != OTHER
    balancer._layout = REPLICAS  # and a new one begins
    assert balancer._probe_due(7)
    balancer.close()


def test_probe_pairs_take_settled_neighbours_under_replicas_since_replicas_took_over() -> None:
    """`Balancer.probe_pairs` on a hand-made record (rows 0-5): static, the switch's row
    (replicas, unsettled), a probe, replicas, replicas, a probe. Probe 2 pairs with row 3 only
    (row 1 carried the switch), probe 5 with row 4 (nothing after it yet). Then rows 6-8: a
    layout without replicas, replicas, a probe: only probe 8, paired with row 7, counts (the
    episode starts again when plans with replicas take over)."""
    import torch

    from poise.nn import MoE, MoEConfig, apply_expert_parallel
    from poise.runtime.balancer import OTHER, PROBE, REPLICAS, STATIC, Balancer
    from poise.runtime.plan_inputs import default_cluster
    from poise.runtime.records import N_MEASURED

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
    apply_expert_parallel(model, None, num_slots=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    balancer = Balancer(model, opt, "auto", cluster=default_cluster(1), plan_process=False)

    def record(layouts: list[int], settled: list[bool]) -> None:
        for i, (lay, ok) in enumerate(zip(layouts, settled, strict=True)):
            balancer.window.append(np.full((1, 1, 4), i))
            balancer.measured.append(np.concatenate([[i], np.full(N_MEASURED, 10.0 * i)]))
            balancer.row_layout.append(lay)
            balancer.row_settled.append(ok)

    record([STATIC, REPLICAS, PROBE, REPLICAS, REPLICAS, PROBE], [True, False] + [True] * 4)
    p = balancer.probe_pairs()
    assert p.counts[:, 0, 0, 0].tolist() == [2, 5] and p.measured[:, 0].tolist() == [20, 50]
    assert p.pair_counts[:, 0, 0, 0].tolist() == [3, 4] and p.pair_of.tolist() == [0, 1]
    assert p.pair_measured[:, 0].tolist() == [30, 40]
    for rows in (balancer.window, balancer.measured, balancer.row_layout, balancer.row_settled):
        rows.clear()
    record([STATIC, REPLICAS, PROBE, REPLICAS, REPLICAS, PROBE, OTHER, REPLICAS, PROBE], [True] * 9)
    p = balancer.probe_pairs()
    assert p.counts[:, 0, 0, 0].tolist() == [8] and p.pair_counts[:, 0, 0, 0].tolist() == [7]
    balancer.close()
