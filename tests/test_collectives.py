"""Alpha-beta collectives: the formulas on hand-worked cases, group levels on a cluster, fits
from a cluster and from measured link fits, bad input refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.cluster import Cluster, Link
from poise.core.errors import ConfigError
from poise.cost.collectives import (
    COLLECTIVES,
    AlphaBeta,
    CollectiveFit,
    alpha_beta_from_link_fit,
    collective_time,
    level_alpha_beta,
    span_level,
)

AB = AlphaBeta(alpha_s=1e-5, beta_s_per_byte=1e-9)


def small_cluster() -> Cluster:
    """2 domains x 2 nodes x 4 devices: intra 10 GB/s, 1 us; inter 4 GB/s shared by 4, 5 us;
    wide area 1 GB/s, 1 ms."""
    return Cluster(
        "small",
        4,
        2,
        2,
        1e12,
        1e9,
        Link(10e9, 1e-6),
        Link(4e9, 5e-6, shared_by=4),
        Link(1e9, 1e-3),
    )


@pytest.mark.parametrize(
    ("collective", "n", "nbytes", "seconds"),
    [
        # (n - 1) (alpha + beta m / n): 3 (1e-5 + 1e-9 * 1000) = 3.3e-5
        ("all_gather", 4, 4000.0, 3.3e-5),
        ("reduce_scatter", 4, 4000.0, 3.3e-5),
        ("all_to_all", 4, 4000.0, 3.3e-5),
        # twice the ring: 2 * 3 * (1e-5 + 1e-6) = 6.6e-5
        ("all_reduce", 4, 4000.0, 6.6e-5),
        # 7 (1e-5 + 1e-9 * 8e6 / 8) = 7 * 1.01e-3
        ("all_to_all", 8, 8e6, 7.07e-3),
        ("all_gather", 1, 4000.0, 0.0),
        ("all_reduce", 2, 0.0, 2e-5),
    ],
)
def test_formulas_on_hand_worked_cases(
    collective: str, n: int, nbytes: float, seconds: float
) -> None:
    assert float(collective_time(collective, n, nbytes, AB)) == pytest.approx(seconds, rel=1e-12)


def test_formulas_broadcast_over_sizes() -> None:
    t = collective_time("all_gather", np.array([2, 4, 8]), 8000.0, AB)
    np.testing.assert_allclose(t, [1 * (1e-5 + 4e-6), 3 * (1e-5 + 2e-6), 7 * (1e-5 + 1e-6)])


def test_span_level() -> None:
    c = small_cluster()
    dpn, dpd = c.devices_per_node, c.devices_per_domain
    assert span_level(dpn, dpd, 1) == -1
    assert span_level(dpn, dpd, 4) == 0  # one node
    assert span_level(dpn, dpd, 2, stride=2) == 0  # ranks 0, 2
    assert span_level(dpn, dpd, 5) == 1  # ranks 0..4 cross a node
    assert span_level(dpn, dpd, 2, stride=4) == 1  # ranks 0, 4
    assert span_level(dpn, dpd, 4, stride=4) == 2  # ranks 0, 4, 8, 12 cross a domain
    assert span_level(dpn, dpd, 16) == 2


def test_fit_from_cluster_uses_the_slowest_spanned_level() -> None:
    c = small_cluster()
    fit = CollectiveFit.from_cluster(c)
    assert level_alpha_beta(c, 1) == AlphaBeta(5e-6, 4 / 4e9)  # shared NIC: 1 GB/s per device
    # all-gather over one node: intra-node link
    assert fit.time("all_gather", 4, 4e6) == pytest.approx(3 * (1e-6 + 1e6 / 10e9))
    # all-to-all over the 4 ranks 4 apart: they cross domains, so wide-area figures
    assert fit.time("all_to_all", 4, 4e6, stride=4) == pytest.approx(3 * (1e-3 + 1e6 / 1e9))
    # an EP-like group of 2 ranks in 2 nodes of one domain
    assert fit.time("all_to_all", 2, 2e6, stride=4) == pytest.approx(5e-6 + 1e6 / 1e9)
    assert fit.time("all_reduce", 1, 1e9) == 0.0


def test_fit_round_trips_through_a_dict() -> None:
    fit = CollectiveFit.from_cluster(small_cluster())
    back = CollectiveFit.from_dict(fit.to_dict())
    assert back == fit


def test_link_fit_conversion_reproduces_the_measured_times() -> None:
    """time = lat + bytes / bw measured on W ranks equals the formula with the converted
    alpha-beta, bytes as `poise calibrate` records them for each collective."""
    lat, bw = 4e-5, 2e9
    for w in (2, 4):
        m = np.array([4096.0, 1e6, 16e6])
        for c in COLLECTIVES:
            ab = alpha_beta_from_link_fit(c, lat, bw, w)
            recorded = m * (w - 1) / w if c == "all_to_all" else m
            np.testing.assert_allclose(collective_time(c, w, m, ab), lat + recorded / bw)


def test_a_fit_lacking_a_level_says_which_and_fills_from_a_cluster() -> None:
    only_intra = CollectiveFit({("all_gather", "intra_node"): AB}, 4, 8, "measured")
    assert only_intra.time("all_gather", 4, 4000.0) == pytest.approx(3.3e-5)
    with pytest.raises(ConfigError) as info:
        only_intra.time("all_gather", 8, 4000.0)
    assert info.value.field == "all_gather.inter_node"
    filled = only_intra.filled_from(small_cluster())
    assert filled.alpha_beta("all_gather", 0) == AB  # measured figures kept
    assert filled.alpha_beta("all_to_all", 1) == level_alpha_beta(small_cluster(), 1)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: collective_time("broadcast", 2, 1.0, AB), "collective"),
        (lambda: collective_time("all_gather", 0, 1.0, AB), "collective"),
        (lambda: AlphaBeta(-1.0, 1e-9), "alpha_s"),
        (lambda: AlphaBeta(1e-6, float("nan")), "beta_s_per_byte"),
        (lambda: CollectiveFit({("all_gather", "rack"): AB}, 4, 8), "level"),
        (lambda: CollectiveFit({}, 0, 8), "devices_per_node"),
        (lambda: CollectiveFit.from_dict({"params": {}}), None),
        (lambda: alpha_beta_from_link_fit("all_gather", 1e-5, 1e9, 1), "world"),
        (lambda: span_level(4, 8, 0), "group"),
    ],
)
def test_bad_input_is_one_config_error(make, field: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field
