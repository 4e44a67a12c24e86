"""Drafter training under single-process, DDP and DeepSpeed ZeRO-2 on CPU gives one loss curve; checkpoints convert.

The distributed runs go through tests/scripts/fit_distributed.py in subprocesses (Lightning relaunches
the command for rank 1, which under pytest would re-run the suite; docs/architecture.md, section "Distributed runs under
pytest"). DeepSpeed runs through `training.deepspeed_cpu.CPUDeepSpeedStrategy` with its shared-memory op off, so nothing
is compiled (the extension directory is a fresh one under tmp and is checked to stay empty).

Both the loss curves and the norms of the applied (reduced) gradients are compared. They agree to
about 1e-7 relative (float32 rounding). Measured sensitivity: DDP with its gradient all-reduce
replaced by a no-op moves the step-1 loss by only 3.5e-5 relative (AdamW's first update is nearly
sign(gradient), whatever the gradient's scale), but the gradient norm by 10%; summed instead of
averaged gradients would double the norm and leave AdamW's steps almost unchanged. So the loss
curves check the trajectory (init, data split, scheduler, steps) and the gradient norms check the
reduction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import build_tiny_toy_target
from test_training_online import FIRST_LOSS_RTOL, LOSS_RTOL

from data.drafter_data import DrafterDataModule
from models import registry
from models.eagle import EagleDraftModel
from models.registry import shared_target
from training import convert
from training.objective import ObjectiveConfig
from training.system import DrafterSystem, OptimizerConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
STRATEGIES = ("single", "ddp", "deepspeed_stage_2")
SAMPLES = 4  # 2 b with b = 2: single trains batches of 4, each of 2 ranks batches of 2
STEPS = 3
RTOL = 1e-5  # measured agreement ~1e-7; a missing gradient all-reduce moves the losses by >= 3.5e-5


def subprocess_env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(tmp / "torch_extensions"),
        "HF_HUB_OFFLINE": "1",
    }


def run(command: list[str], env: dict[str, str], timeout: float = 300) -> float:
    """Run a command from the repository root; its wall time in seconds. A failure shows its output's tail."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return wall


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "ds"
    env = subprocess_env(folder.parent)
    run([sys.executable, str(SCRIPTS / "extract_tiny.py"), str(folder), "--count", str(SAMPLES)], env)
    return folder


@pytest.fixture(scope="module")
def fits(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The three runs' JSON results (plus "wall_s", the subprocess's wall time)."""
    tmp = tmp_path_factory.mktemp("fits")
    env = subprocess_env(tmp)
    results = {}
    for strategy in STRATEGIES:
        out = tmp / f"{strategy}.json"
        script = [sys.executable, str(SCRIPTS / "fit_distributed.py"), "--strategy", strategy]
        wall = run([*script, "--data", str(tiny_dataset), "--out", str(out), "--steps", str(STEPS)], env)
        results[strategy] = {**json.loads(out.read_text()), "wall_s": wall}
        result = results[strategy]
        print(f"{strategy}: {wall:.1f} s wall, fit {result['fit_s']:.1f} s, {result['losses']}, {result['grad_norms']}")
    # online features under DDP: each rank's target recomputes the stored states of its half of the batch
    out = tmp / "ddp_online.json"
    script = [sys.executable, str(SCRIPTS / "fit_distributed.py"), "--strategy", "ddp", "--features", "online"]
    wall = run([*script, "--data", str(tiny_dataset), "--out", str(out), "--steps", str(STEPS)], env)
    results["ddp_online"] = {**json.loads(out.read_text()), "wall_s": wall}
    print(f"ddp_online: {wall:.1f} s wall, {results['ddp_online']['losses']}")
    extensions = tmp / "torch_extensions"
    results["compiled"] = {"ops": sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []}
    return results


def test_loss_curves_agree_across_single_ddp_and_deepspeed(fits: dict[str, dict[str, Any]]) -> None:
    single = fits["single"]
    assert (single["world_size"], single["batch_size"], single["steps"]) == (1, SAMPLES, STEPS)
    for strategy in ("ddp", "deepspeed_stage_2"):
        assert (fits[strategy]["world_size"], fits[strategy]["batch_size"]) == (2, SAMPLES // 2)
        assert fits[strategy]["steps"] == STEPS
    losses = {strategy: torch.tensor(fits[strategy]["losses"], dtype=torch.float64) for strategy in STRATEGIES}
    assert all(len(curve) == STEPS for curve in losses.values())
    # the comparison can fail: training moves the loss by far more than the tolerance at every step
    steps = losses["single"]
    assert ((steps[1:] - steps[:-1]).abs() > 10 * RTOL * steps[:-1].abs()).all(), steps
    norms = {strategy: torch.tensor(fits[strategy]["grad_norms"], dtype=torch.float64) for strategy in STRATEGIES}
    assert ((norms["single"] > 0) & norms["single"].isfinite()).all(), norms
    for strategy in ("ddp", "deepspeed_stage_2"):
        torch.testing.assert_close(losses[strategy], steps, rtol=RTOL, atol=0, msg=lambda m, s=strategy: f"{s}: {m}")
        torch.testing.assert_close(
            norms[strategy], norms["single"], rtol=RTOL, atol=0, msg=lambda m, s=strategy: f"{s} grad norms: {m}"
        )


def test_online_features_under_ddp_give_the_single_process_offline_curve(fits: dict[str, dict[str, Any]]) -> None:
    """Tolerances as in test_training_online.py: float16 storage of the offline states, AdamW's first updates."""
    online, single = fits["ddp_online"], fits["single"]
    assert (online["features"], online["world_size"], online["steps"]) == ("online", 2, STEPS)
    losses = torch.tensor(online["losses"], dtype=torch.float64)
    reference = torch.tensor(single["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses[0], reference[0], rtol=FIRST_LOSS_RTOL, atol=0)
    torch.testing.assert_close(losses, reference, rtol=LOSS_RTOL, atol=0)


def test_decode_validation_splits_prompts_across_ranks_and_reduces(fits: dict[str, dict[str, Any]]) -> None:
    for strategy in STRATEGIES:
        decode = fits[strategy]["decode"]
        assert decode["decode/target_forwards_ar"] == 16  # every image of every rank counted: 16 tokens each
        for rule in ("exact", "cascade"):
            assert 1.0 <= decode[f"decode/tau_{rule}"] <= 4.0  # 1 + at most depth accepted drafts per forward
            assert 1 + 16 / 4 <= decode[f"decode/target_forwards_{rule}"] <= 16


def test_deepspeed_really_ran_zero_2_without_compiling(fits: dict[str, dict[str, Any]]) -> None:
    deepspeed = fits["deepspeed_stage_2"]
    assert deepspeed["zero_stage"] == 2
    assert deepspeed["optimizer"] == "DeepSpeedZeroOptimizer"
    assert fits["ddp"]["optimizer"] == fits["single"]["optimizer"] == "AdamW"
    assert fits["compiled"]["ops"] == []  # the shm comm op was skipped, FusedAdam never built


def test_checkpoints_of_every_strategy_convert_to_the_live_weights(fits: dict[str, dict[str, Any]]) -> None:
    layout = fits["deepspeed_stage_2"]["checkpoint"]["layout"]
    assert fits["deepspeed_stage_2"]["checkpoint"]["is_dir"]
    assert {"latest", "checkpoint/mp_rank_00_model_states.pt"} <= set(layout)
    assert {f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= set(layout)
    for strategy in STRATEGIES:
        checkpoint = fits[strategy]["checkpoint"]
        assert checkpoint["same_keys"] and checkpoint["equal"], (strategy, checkpoint)
        EagleDraftModel.from_pretrained(checkpoint["drafter_dir"])


# ----------------------------------------------------------------------------- training.convert in process


@pytest.fixture
def tiny_registered(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(registry.TARGET_LOADERS, "tiny-toy", lambda **kwargs: build_tiny_toy_target())
    shared_target.cache_clear()
    yield
    shared_target.cache_clear()


def test_convert_a_ckpt_file_of_a_two_step_fit(tiny_dataset: Path, tmp_path: Path, tiny_registered: None) -> None:
    system = DrafterSystem(
        target="tiny-toy",
        architecture="eagle3",
        preset="tiny",
        objective=ObjectiveConfig(ttt_steps=2),
        optimizer=OptimizerConfig(lr=1e-2),
    )
    data = DrafterDataModule(train_dir=str(tiny_dataset), batch_size=2, target="tiny-toy")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)  # fmt: skip
    initial = {k: v.clone() for k, v in system.drafter.state_dict().items()}
    trainer.fit(system, datamodule=data)
    assert trainer.global_step == 2
    trainer.save_checkpoint(tmp_path / "last.ckpt")

    assert convert.main(["--ckpt", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "drafter")]) == 0
    loaded = EagleDraftModel.from_pretrained(tmp_path / "drafter")
    assert loaded.config == system.drafter.config
    live = system.drafter.state_dict()
    assert sorted(loaded.state_dict()) == sorted(live)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, live[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(initial[k], live[k]) for k in live)  # it trained: the check compares real updates


def test_convert_refuses_what_is_not_a_drafter_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nowhere.ckpt"
    assert convert.main(["--ckpt", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert str(missing) in capsys.readouterr().err
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    with pytest.raises(convert.CheckpointError, match="not a DeepSpeed checkpoint.*notes.txt") as error:
        convert.convert_checkpoint(folder, tmp_path / "out")
    assert str(folder) in str(error.value)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a pickle")
    with pytest.raises(convert.CheckpointError, match="not a Lightning checkpoint file"):
        convert.convert_checkpoint(garbage, tmp_path / "out")
    weights = tmp_path / "weights.pt"
    torch.save({"fc.weight": torch.zeros(1)}, weights)
    with pytest.raises(convert.CheckpointError, match="no 'state_dict'"):
        convert.convert_checkpoint(weights, tmp_path / "out")
    not_a_drafter = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(1)}, "hyper_parameters": {}}, not_a_drafter)
    with pytest.raises(convert.CheckpointError, match="no drafter config"):
        convert.convert_checkpoint(not_a_drafter, tmp_path / "out")
    hostile = tmp_path / "hostile.ckpt"  # unpickling it would touch a file: safe loading refuses it first
    torch.save({"state_dict": {}, "payload": RunsCodeWhenUnpickled(str(tmp_path / "ran"))}, hostile)
    with pytest.raises(convert.CheckpointError, match=r"safe loading refuses \(it pickles "):
        convert.convert_checkpoint(hostile, tmp_path / "out")
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "out").exists()


class RunsCodeWhenUnpickled:
    """An object whose unpickling touches a file: what weights_only=False loading would execute."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path(self.marker).touch, ())
