from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.plan.predict import Predictor, parse_predictor, prediction_error


def test_predictors_by_hand() -> None:
    h = np.arange(1, 5, dtype=float).reshape(4, 1, 1, 1)  # 1, 2, 3, 4
    assert Predictor("last").predict(h).item() == 4
    assert Predictor("window", window=2).predict(h).item() == 3.5
    # EMA alpha 0.5: 1 -> 1.5 -> 2.25 -> 3.125
    assert Predictor("ema", alpha=0.5).predict(h).item() == pytest.approx(3.125)
    allw = Predictor("window", window=3).predict_all(h)[:, 0, 0, 0]
    np.testing.assert_allclose(allw, [1, 1.5, 2, 3])


def test_prediction_error() -> None:
    steady = np.ones((5, 1, 2, 3))
    assert prediction_error(steady, Predictor("last")) == 0
    alternating = np.array([1.0, 3.0, 1.0, 3.0]).reshape(4, 1, 1, 1)
    # last predicts 1,3,1 for 3,1,3: errors 2+2+2 over 7.
    assert prediction_error(alternating, Predictor("last")) == pytest.approx(6 / 7)
    assert prediction_error(alternating, Predictor("window", window=2)) < 6 / 7


def test_parse_and_errors() -> None:
    assert parse_predictor("window:20").window == 20
    assert parse_predictor("ema:0.25").alpha == 0.25
    with pytest.raises(ConfigError):
        parse_predictor("oracle")
    with pytest.raises(ConfigError):
        parse_predictor("ema:x")
    with pytest.raises(ConfigError):
        Predictor("ema", alpha=0)
    with pytest.raises(ConfigError):
        Predictor("last").predict(np.zeros((0, 1, 1, 1)))
