"""Router: selection, weights, aux losses and capacity against hand computations; the expert
bias update; ReplayRouter reproducing a trace's counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from poise.core.errors import ConfigError, TraceError
from poise.nn.router import ReplayRouter, Router, capacity_keep, replay_experts, scaled_counts
from poise.trace.trace import Trace


def router_with_logits(logits: torch.Tensor, **kw: object) -> tuple[Router, torch.Tensor]:
    """A router whose weight is the identity, and inputs equal to `logits [T, E]`."""
    E = logits.shape[1]
    router = Router(E, E, **kw)  # type: ignore[arg-type]
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router, logits.clone()


LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.0], [1.0, 1.5, 2.0, 0.5]])


def test_softmax_top2_with_renormalisation_by_hand():
    router, x = router_with_logits(LOGITS, top_k=2)
    r = router(x)
    assert r.experts.tolist() == [[0, 1], [1, 2], [2, 1]]
    p = LOGITS.softmax(-1)
    w0 = torch.tensor([p[0, 0], p[0, 1]]) / (p[0, 0] + p[0, 1])
    torch.testing.assert_close(r.weights[0], w0)
    assert r.counts.tolist() == [1, 3, 2, 0]
    assert r.keep is None


def test_top1_keeps_the_raw_probability_unless_asked():
    router, x = router_with_logits(LOGITS, top_k=1)
    torch.testing.assert_close(router(x).weights[:, 0], LOGITS.softmax(-1).max(-1).values)
    router, x = router_with_logits(LOGITS, top_k=1, renormalize=True)
    torch.testing.assert_close(router(x).weights, torch.ones(3, 1))


def test_balance_loss_and_z_loss_by_hand():
    router, x = router_with_logits(LOGITS, top_k=2, balance_coef=0.1, z_loss_coef=0.01)
    r = router(x)
    p = LOGITS.softmax(-1)
    f = torch.tensor([1.0, 3.0, 2.0, 0.0]) / (3 * 2)  # counts [1, 3, 2, 0] of 6 assignments
    balance = 4 * float((f * p.mean(0)).sum())
    z = float(sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS.tolist()) / 3)
    assert float(r.balance_loss.detach()) == pytest.approx(balance, rel=1e-6)
    assert float(r.z_loss.detach()) == pytest.approx(z, rel=1e-6)
    assert float(r.aux_loss.detach()) == pytest.approx(0.1 * balance + 0.01 * z, rel=1e-6)
    # A uniform router has balance loss exactly 1.
    uniform, xu = router_with_logits(torch.zeros(8, 4), top_k=1, balance_coef=1.0)
    uniform.select = lambda s: torch.arange(8).remainder(4).view(8, 1)  # type: ignore[method-assign]
    assert float(uniform(xu).balance_loss.detach()) == pytest.approx(1.0)


def test_losses_are_zero_when_their_coefficient_is():
    router, x = router_with_logits(LOGITS)
    r = router(x)
    assert (
        float(r.aux_loss.detach()) == 0.0
        and float(r.balance_loss) == 0.0
        and float(r.z_loss) == 0.0
    )


def test_sigmoid_scores_and_expert_bias_change_only_the_choice():
    router, x = router_with_logits(LOGITS, top_k=1, score="sigmoid", expert_bias=True)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    r = router(x)
    assert r.experts.view(-1).tolist() == [3, 3, 3]  # the bias wins the choice...
    torch.testing.assert_close(r.weights.view(-1), LOGITS[:, 3].sigmoid())  # ...not the weight
    r.weights.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_update_bias_moves_against_the_load():
    router = Router(4, 4, 1, expert_bias=True)
    router.update_bias(torch.tensor([10, 2, 4, 4]), rate=0.25)  # mean 5
    assert router.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25]
    router.update_bias(np.array([5, 5, 5, 5]), rate=0.25)  # balanced: sign 0
    assert router.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25]
    with pytest.raises(ConfigError, match="expert bias"):
        Router(4, 4, 1).update_bias(torch.ones(4), 0.1)
    with pytest.raises(ConfigError, match="counts"):
        router.update_bias(torch.ones(3), 0.1)


def test_capacity_drops_later_choices_first_by_hand():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = capacity_keep(experts, 3, capacity=2)
    # First choices in token order: 0, 0, 0 (third dropped), 1; then second choices:
    # 1 (expert 1's 2nd), 2, 1 (3rd: dropped), 0 (3rd: dropped).
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]


def test_router_capacity_factor():
    router, x = router_with_logits(LOGITS, top_k=2, capacity_factor=1.0)
    assert router.capacity(3) == math.ceil(3 * 2 / 4)
    r = router(x)
    assert r.keep is not None and r.keep.tolist() == [[True, True], [True, True], [True, False]]
    assert r.counts.tolist() == [1, 3, 2, 0]  # counts are before the drop
    assert Router(4, 4, 2).capacity(100) is None  # dropless by default


def test_bad_router_arguments():
    with pytest.raises(ConfigError, match="top_k"):
        Router(4, 4, 5)
    with pytest.raises(ConfigError, match="score"):
        Router(4, 4, 2, score="relu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="capacity_factor"):
        Router(4, 4, 2, capacity_factor=0.0)


# ----------------------------------------------------------------------------- replay
def test_scaled_counts_by_hand():
    assert scaled_counts(np.array([6, 3, 1, 0]), 10, 10).tolist() == [6, 3, 1, 0]
    assert scaled_counts(np.array([6, 3, 1, 0]), 5, 10).tolist() == [3, 2, 0, 0]  # 3, 1.5, .5
    assert scaled_counts(np.array([0, 0, 0, 0]), 6, 10).tolist() == [2, 2, 1, 1]
    # Capped at 4 per expert: the others share the rest in proportion, then evenly.
    assert scaled_counts(np.array([90, 5, 5, 0]), 8, 4).tolist() == [4, 2, 2, 0]
    assert scaled_counts(np.array([90, 0, 0, 0]), 8, 4).tolist() == [4, 2, 1, 1]


def test_replay_experts_are_distinct_per_token_with_exact_counts():
    counts = np.array([7, 7, 3, 2, 2])
    choices = replay_experts(counts, tokens=7, top_k=3, seed=0)
    assert choices.shape == (7, 3)
    assert np.bincount(choices.ravel(), minlength=5).tolist() == counts.tolist()
    assert all(len(set(row)) == 3 for row in choices.tolist())


def make_trace() -> Trace:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(3, 2, 2, 6))
    counts[0, 1, 0] = [10, 20, 0, 6, 4, 0]  # 40 assignments: 20 tokens, top-2
    counts[1, 1, 0] = [60, 0, 0, 0, 0, 4]  # very skewed row
    return Trace(counts, np.arange(3), top_k=2, tokens_per_device=200)


def test_replay_router_follows_the_trace():
    trace = make_trace()
    router = ReplayRouter(8, 6, 2, trace, layer=1, rank=0)
    row = trace.counts[0, 1, 0]
    r = router(torch.randn(20, 8))
    assert r.counts.tolist() == row.tolist()  # exact when T * k equals the trace's total
    router.set_step(1)
    r = router(torch.randn(40, 8))
    assert r.counts.tolist() == [40, 0, 0, 0, 0, 40]  # skewed row, capped at T per expert
    assert (r.experts[:, 0] != r.experts[:, 1]).all()
    router.set_step(4)  # wraps to step 1
    torch.testing.assert_close(router(torch.randn(40, 8)).counts, r.counts)
    r.weights.sum().backward()  # the gate still gets gradients
    assert router.weight.grad is not None


def test_replay_router_is_deterministic_and_scaled():
    trace = make_trace()
    a = ReplayRouter(8, 6, 2, trace, layer=0, rank=1, seed=3)
    b = ReplayRouter(8, 6, 2, trace, layer=0, rank=1, seed=3)
    x = torch.randn(1000, 8)
    ra, rb = a(x), b(x)
    assert torch.equal(ra.experts, rb.experts)
    row = trace.counts[0, 0, 1].astype(float)
    np.testing.assert_allclose(ra.counts.numpy(), row / row.sum() * 2000, atol=1.0)
    assert int(ra.counts.sum()) == 2000


def test_replay_router_refuses_a_trace_that_does_not_fit():
    trace = make_trace()
    with pytest.raises(TraceError, match="experts"):
        ReplayRouter(8, 5, 2, trace)
    with pytest.raises(TraceError, match="rank"):
        ReplayRouter(8, 6, 2, trace, rank=2)
