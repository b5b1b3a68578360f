"""DCP checkpoints (`poise.train.checkpoint`): every rank writes its own shard in parallel
(dense tensors once, each expert by global id from its home), a run resumes exactly on the same
ranks and on fewer, a crash mid-save leaves the previous checkpoint and `latest` usable, and the
old `.pt` format is one clear error. Two ranks train 6 steps (checkpoints at 2, 4 and 6), resume
from step 2 on 2 ranks and on 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import poise.util.atomic
from poise.runtime.launch import run_ranks
from poise.train import checkpoint as ck

from .helpers import slow_gemm_cluster, tiny_train_config

TOL = 1e-5


def _cfg(root: str, name: str, **kw):
    # 6 steps: the plan requested at step 2 and decided at 3 serves 3 steps (`auto` prices no
    # step past the run's end, and moves nothing for one step)
    base = dict(steps=6, policy="auto", checkpoint_every=2, keep_checkpoints=5,
                balance_guard=False, self_calibrate=False)  # fmt: skip
    base.update(kw)
    return tiny_train_config(root, name, **base)


def _two_ranks(rank: int, world: int, root: str) -> dict:
    from poise.train import train

    # priced on a test cluster of slow GEMMs next to fast links (`helpers.slow_gemm_cluster`),
    # where auto's plans move experts (on this machine's calibration, the cpu-2 preset, they
    # keep the static plan)
    slow = f"{root}/slow-gemms.yaml"
    r = train(_cfg(root, "run", cluster=slow), quiet=True)
    again = train(
        _cfg(root, "again", cluster=slow), resume=f"{root}/run/checkpoints/step-00000002",
        quiet=True,
    )  # fmt: skip
    return {"run": (r.steps, r.losses, r.plan_changes), "again": (again.steps, again.losses,
            again.resumed_plan)}  # fmt: skip


def _one_rank(rank: int, world: int, root: str) -> dict:
    from poise.train import train

    r = train(_cfg(root, "one"), resume=f"{root}/run/checkpoints/step-00000002", quiet=True)
    return {"one": (r.steps, r.losses, r.resumed_plan)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("dcp")
    slow_gemm_cluster(2).save(root / "slow-gemms.yaml")  # one link the 2 ranks share
    two = run_ranks(_two_ranks, 2, str(root), timeout_s=300)
    assert two[0] == two[1]
    out = dict(two[0])
    out.update(run_ranks(_one_rank, 1, str(root), timeout_s=300)[0])
    return root, out


@pytest.mark.dist
def test_same_ranks_resume_exactly(runs):
    root, out = runs
    steps, losses, changes = out["run"]
    assert steps == [1, 2, 3, 4, 5, 6] and changes >= 1  # auto moved experts before step 4
    again_steps, again_losses, resumed_plan = out["again"]
    assert again_steps == [3, 4, 5, 6] and resumed_plan
    assert np.max(np.abs(np.array(again_losses) - np.array(losses[2:]))) <= TOL
    a = ck.read_file(root / "run" / "checkpoints" / "step-00000004")
    b = ck.read_file(root / "again" / "checkpoints" / "step-00000004")
    for layer, ws in a["model"]["experts"].items():
        for w, t in ws.items():
            assert t.shape[0] == 8
            assert float((t - b["model"]["experts"][layer][w]).abs().max()) <= TOL


@pytest.mark.dist
def test_fewer_ranks_resume_exactly(runs):
    """The 2-rank checkpoint of step 2 resumes in one process (all 8 experts, read by id)."""
    _, out = runs
    steps, losses, resumed_plan = out["one"]
    assert steps == [3, 4, 5, 6] and not resumed_plan  # another world: the static placement
    assert np.max(np.abs(np.array(losses) - np.array(out["run"][1][2:]))) <= TOL


@pytest.mark.dist
def test_every_rank_writes_its_own_shard(runs):
    """Dense tensors once (rank 0's file); each expert's weights and moments in the file of the
    rank holding its home under the saved plan."""
    import torch.distributed.checkpoint as dcp

    root, _ = runs
    folder = root / "run" / "checkpoints" / "step-00000004"
    assert {p.name for p in folder.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    # the manifest rank 0 writes lists every rank's shard, and the folder verifies against it
    listed = json.loads((folder / ck.MANIFEST).read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ck.META, ".metadata"} <= set(listed)
    ck.verify(folder)
    md = dcp.FileSystemReader(str(folder)).read_metadata()
    where = {idx.fqn: info.relative_path for idx, info in md.storage_data.items()}
    meta = ck.read_meta(folder)
    home = meta["plan"]["home"].numpy()  # [L, E]
    assert meta["world_size"] == 2 and meta["format"] == ck.FORMAT
    seen = 0
    for key, path in where.items():
        if key.startswith(("model.dense.", "optim.dense.")):
            assert path == "__0_0.distcp", key
        elif key.startswith(("model.experts.", "optim.experts.")) and key.split(".")[-1].isdigit():
            layer = int(key.split(".")[3])  # model.experts.blocks.<i>.ffn.<w>.<e>
            e = int(key.split(".")[-1])
            assert path == f"__{home[layer, e]}_0.distcp", key
            seen += 1
    assert seen == 4 * 8 * len(ck.read_file(folder)["model"]["experts"]["blocks.0.ffn"])
    assert len(set(home.ravel().tolist())) == 2


def _small_run(tmp_path: Path):
    """A one-process tiny model after one optimizer step, and a save function."""
    from poise.models.gpt import GPTMoE
    from poise.train.setup import make_optimizer

    cfg = tiny_train_config(str(tmp_path), "solo")
    model = GPTMoE(cfg.model_config(), seed=3)
    opt = make_optimizer(model, cfg)
    x = torch.randint(0, 256, (2, 16))
    model(x).float().square().mean().backward()
    opt.step()

    def save(step: int) -> Path:
        return ck.save(model, opt, None, tmp_path / "solo", step=step, data_position=step,
                       config=cfg.to_dict())  # fmt: skip

    return cfg, model, opt, save


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A crash while DCP writes, while `poise.pt` is written, or at the rename leaves the
    previous checkpoint and `latest` usable; the next save clears the leftovers."""
    cfg, model, opt, save = _small_run(tmp_path)
    first = save(1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    dcp = ck._dcp()  # torch.distributed.checkpoint, imported at first use
    real_save = dcp.save

    def dcp_crashes(state, **kw):
        real_save(dict(list(state.items())[:3]), **kw)  # some files written, then killed
        raise KeyboardInterrupt("killed inside dcp.save")

    monkeypatch.setattr(dcp, "save", dcp_crashes)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    monkeypatch.undo()

    def half_then_crash(obj, fh):
        fh.write(b"half")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ck, "_serialize", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    monkeypatch.undo()

    real_replace = poise.util.atomic._replace

    def rename_fails(src, dst):  # the rename of the finished folder into place
        if Path(src).name.startswith(".step-"):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(poise.util.atomic, "_replace", rename_fails)
    with pytest.raises(ck.CheckpointError, match="cannot write checkpoint"):
        save(1)  # over the existing step: the old folder must survive
    monkeypatch.undo()

    folder = tmp_path / "solo" / "checkpoints"
    assert ck.resolve(tmp_path / "solo") == first  # `latest` still names it
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "latest", "step-00000001"]  # fmt: skip
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    ckpt = ck.load(tmp_path / "solo")
    assert ckpt["step"] == 1
    from poise.models.gpt import GPTMoE
    from poise.train.setup import make_optimizer

    fresh = GPTMoE(cfg.model_config(), seed=9)
    fresh_opt = make_optimizer(fresh, cfg)
    ck.restore(fresh, fresh_opt, ckpt)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    w = model.blocks[0].ffn.experts.w_in
    fw = fresh.blocks[0].ffn.experts.w_in
    assert torch.equal(opt.state[w]["exp_avg_sq"], fresh_opt.state[fw]["exp_avg_sq"])
    second = save(2)  # the leftovers of the crashed saves go
    assert ck.resolve(tmp_path / "solo") == second
    assert not [p for p in folder.iterdir() if p.name.startswith(".step")]


def test_old_format_checkpoints_are_one_clear_error(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    old = folder / "step-00000003.pt"
    torch.save({"format": "poise-train-checkpoint", "version": 1}, old)
    (folder / "latest").write_text(old.name + "\n")
    for path in (old, folder, tmp_path / "run"):
        with pytest.raises(ck.CheckpointError, match=r"poise-train-checkpoint v1 .*\.pt") as e:
            ck.load(path)
        assert str(old) in str(e.value)
    (folder / "latest").unlink()
    with pytest.raises(ck.CheckpointError, match="poise-train-checkpoint v1"):
        ck.resolve(tmp_path / "run")


def test_a_run_that_never_saves_does_not_import_dcp():
    """`torch.distributed.checkpoint` (with DTensor and SymPy, about 1.8 s of a rank's start-up
    on 2 cores) is imported at the first save or load, not with the training loop."""
    import subprocess
    import sys

    code = (
        "import sys, poise.train.loop, poise.train.__main__; "
        "print('torch.distributed.checkpoint' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
