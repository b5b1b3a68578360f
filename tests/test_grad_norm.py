"""The gradient norm's sums of squares (`poise.nn.grad_norm`) and the train loop's clipping norm.

References: the naive float64 sum of squares; the naive float64 norm of every gradient on one
rank (every expert slot a home slot there), and `torch.nn.utils.get_total_norm` after
clipping."""

from __future__ import annotations

import pytest
import torch

from poise.nn.grad_norm import squared_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_squared_norm_is_the_float64_sum_of_squares(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(6, 40, 33, generator=gen) * 3).to(dtype)
    for t in (g, g[:4], g[2:, 5], torch.zeros(3, dtype=dtype)):
        got = squared_norm(t)
        assert got.dtype == torch.float64 and got.shape == ()
        want = t.double().square().sum()
        assert float(got) == pytest.approx(float(want), rel=1e-12, abs=0.0)


def test_the_train_loops_clipping_norm_is_the_global_norm(tmp_path) -> None:
    """One rank, a `tiny` model after one backward: the loop's norm equals the float64 norm of
    every gradient, and clipping scales them to `clip`."""
    from poise.train.config import TrainConfig
    from poise.train.grad_sync import clip_global_norm
    from poise.train.loop import _Trainer

    cfg = TrainConfig(
        model="tiny", context=32, batch=2, steps=1, out=str(tmp_path / "run"), policy="static",
        progress=False, tensorboard=False, eval_every=0, checkpoint_every=0, threads=1,
        clip=1e-3,
    )  # fmt: skip
    trainer = _Trainer(cfg, None, quiet=True)
    x, y = trainer.sampler.batch(0, trainer.rows, trainer.device)
    logits = trainer.model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    (loss + trainer.model.aux_loss()).backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    want = float(torch.stack([g.double().square().sum() for g in grads]).sum().sqrt())
    assert want > cfg.clip  # clipping is active
    norm = clip_global_norm(
        trainer.model, trainer.dense, trainer.ep, trainer.ep_group, trainer.device, cfg.clip
    )
    assert norm == pytest.approx(want, rel=1e-12)
    after = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
    assert after == pytest.approx(cfg.clip, rel=1e-3)
    trainer.balancer.close()
    trainer.log.close()
