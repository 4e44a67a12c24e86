"""Safe runs: a second fit never touches the first run's files, resume never silently starts over, a
non-finite loss stops training before anything is exported, and the run folder rules of
`training.run_folder` (explicit version, version_N, --overwrite, --ckpt_path last).

The fits train the toy drafter for a few steps on 8 extracted toy samples (fixture shared with
tests/test_training_fit.py); the kill test runs training in a subprocess and SIGKILLs it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from test_training_fit import ENV, REPO, tiny_dataset, tiny_run_config, write_yaml  # noqa: F401 (fixture)

from data.drafter_data import DrafterDataModule
from training.fit import ExportDrafter, main
from training.run_folder import RunFolderError, clear_run, plan_run
from training.system import DrafterSystem


@pytest.fixture(autouse=True)
def _bare_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


# ----------------------------------------------------------------------------- the folder rules


def test_an_explicit_folder_holding_a_run_is_refused_and_left_alone(tmp_path: Path):
    run = tmp_path / "demo"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    with pytest.raises(RunFolderError, match=str(run)) as error:
        plan_run(tmp_path / "demo", "", None)
    assert "checkpoints" in str(error.value) and "--ckpt_path last" in str(error.value)
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"weights"


def test_overwrite_clears_only_what_a_run_left(tmp_path: Path):
    run = tmp_path / "demo"
    (run / "drafter").mkdir(parents=True)
    (run / "config.yaml").write_text("a: 1")
    (run / "events.out.tfevents.1.host").write_bytes(b"")
    (run / "notes.txt").write_text("mine")
    plan = plan_run(run, "", None, overwrite=True)
    assert sorted(plan.to_clear) == ["config.yaml", "drafter", "events.out.tfevents.1.host"]
    assert len(list(run.iterdir())) == 4  # planning deletes nothing: a config error must leave the run in place
    clear_run(plan)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_resume_last_picks_the_newest_version_and_continues_there(tmp_path: Path):
    for version, stamp in ((0, 1_000_000_000), (1, 3_000_000_000), (2, 2_000_000_000)):
        checkpoints = tmp_path / f"version_{version}" / "checkpoints"
        checkpoints.mkdir(parents=True)
        (checkpoints / "last.ckpt").write_bytes(b"x")
        os.utime(checkpoints / "last.ckpt", ns=(stamp, stamp))
    plan = plan_run(tmp_path, None, "last")
    assert plan.version == 1 and plan.ckpt_path == str(tmp_path / "version_1" / "checkpoints" / "last.ckpt")
    assert plan_run(tmp_path, None, str(tmp_path / "version_2" / "checkpoints" / "last.ckpt")).version == 2
    relative = os.path.relpath(tmp_path / "version_2" / "checkpoints" / "last.ckpt")  # the same file, spelt otherwise
    assert plan_run(tmp_path, None, relative).version == 2
    best = tmp_path / "version_0" / "checkpoints" / "best-step=4.ckpt"
    best.write_bytes(b"x")  # not the run's resume point: a new version, so version_0's last.ckpt stays
    assert plan_run(tmp_path, None, str(best)).version is None


def test_resume_last_without_a_checkpoint_names_where_it_looked(tmp_path: Path):
    with pytest.raises(RunFolderError, match="no checkpoint to resume") as error:
        plan_run(tmp_path / "demo", None, "last")
    assert str(tmp_path / "demo") in str(error.value)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.yaml").write_text("a: 1")  # killed before its first checkpoint
    with pytest.raises(RunFolderError, match=str(tmp_path / "demo" / "checkpoints" / "last.ckpt")):
        plan_run(tmp_path / "demo", "", "last")
    with pytest.raises(RunFolderError, match="no such checkpoint"):
        plan_run(tmp_path / "demo", None, str(tmp_path / "missing.ckpt"))


# ----------------------------------------------------------------------------- real fits


@pytest.mark.slow
def test_a_second_fit_leaves_the_first_run_byte_identical(tiny_dataset: Path, tmp_path: Path, capsys):  # noqa: F811
    config = str(tiny_run_config(tmp_path, tiny_dataset))  # explicit version "": runs/tiny itself
    assert main(["--config", config]) == 0
    first = tmp_path / "runs" / "tiny"
    before = file_hashes(first)
    assert "drafter/model.safetensors" in before and "checkpoints/last.ckpt" in before

    capsys.readouterr()
    assert main(["--config", config, "--trainer.max_steps", "1"]) == 2
    assert f"{first} already holds a run" in capsys.readouterr().err
    assert file_hashes(first) == before

    assert main(["--config", config, "--trainer.max_steps", "1", "--trainer.logger.init_args.version", "null"]) == 0
    second = first / "version_0"
    assert (second / "drafter" / "model.safetensors").is_file()
    assert {k: v for k, v in file_hashes(first).items() if not k.startswith("version_0/")} == before

    with pytest.raises(ValueError, match="preset"):  # --overwrite with a broken config: the old run stays
        main(["--config", config, "--overwrite", "true", "--model.preset", "no-such-preset"])
    assert {k: v for k, v in file_hashes(first).items() if not k.startswith("version_0/")} == before
    assert main(["--config", config, "--overwrite", "true", "--trainer.max_steps", "1"]) == 0  # asked: replaced
    assert torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 1


@pytest.mark.slow
def test_killed_before_the_first_validation_resumes_from_the_interval_checkpoint(
    tiny_dataset: Path,  # noqa: F811
    tmp_path: Path,
):
    base = tiny_run_config(tmp_path, tiny_dataset)  # 3 steps; this run: 6 steps, validation at 5, checkpoints every 2
    overrides = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "5", "--checkpoint.every_n_train_steps",
                 "2", "--validate_before", "false"]  # fmt: skip
    killer = write_yaml(tmp_path / "kill.yaml", {"trainer": {"callbacks": [
        {"class_path": "kill_switch.KillAtStep", "init_args": {"step": 3}}]}})  # fmt: skip
    env = {**ENV, "PYTHONPATH": f"{REPO / 'tests'}:{ENV.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "training.fit", "--config", str(base), "--config", str(killer), *overrides]
    killed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-3000:]
    run = tmp_path / "runs" / "tiny"
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    assert not list((run / "checkpoints").glob("best-*")) and not (run / "drafter").exists()  # no validation yet

    started = tmp_path / "started_at.txt"
    recorder = write_yaml(tmp_path / "record.yaml", {"trainer": {"callbacks": [
        {"class_path": "kill_switch.RecordStartStep", "init_args": {"path": str(started)}}]}})  # fmt: skip
    sys.path.insert(0, str(REPO / "tests"))  # kill_switch is importable by class path in this process too
    try:
        assert main(["--config", str(base), "--config", str(recorder), *overrides, "--ckpt_path", "last"]) == 0
    finally:
        sys.path.remove(str(REPO / "tests"))
    assert started.read_text() == "2"  # continued from the interval checkpoint, not from step 0
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6
    assert (run / "drafter" / "model.safetensors").is_file()


def test_resume_last_with_nothing_to_resume_fails_naming_the_folder(tmp_path: Path, capsys):
    logger = write_yaml(tmp_path / "logger.yaml", {"trainer": {"logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(tmp_path / "runs"), "name": "demo", "version": None}}}})  # fmt: skip
    assert main(["--config", "demo", "--config", str(logger), "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint to resume" in err and str(tmp_path / "runs" / "demo") in err


def test_a_non_finite_loss_stops_training_naming_step_and_keys_and_exports_nothing(
    tiny_dataset: Path,  # noqa: F811
    tmp_path: Path,
):
    system = DrafterSystem(target="toy", architecture="eagle3", preset="toy")
    with torch.no_grad():
        next(system.drafter.parameters()).fill_(float("nan"))  # every loss is NaN from the first step
    data = DrafterDataModule(train_dir=str(tiny_dataset), batch_size=2, load_uncond=True)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[ExportDrafter()],
    )
    with pytest.raises(FloatingPointError, match=r"not finite \(nan on this rank\) at global step 0, batch ") as error:
        trainer.fit(system, datamodule=data)
    assert "--validate" in str(error.value)
    assert not any(tmp_path.rglob("model.safetensors"))


def test_uncond_rate_and_cfg_loss_weight_are_rejected_together():
    from training.objective import ObjectiveConfig

    with pytest.raises(ValueError, match="uncond_rate=0.1 and objective.cfg_loss_weight=1.0 are alternatives"):
        ObjectiveConfig(uncond_rate=0.1, cfg_loss_weight=1.0)
    ObjectiveConfig(uncond_rate=0.1)  # each alone is fine
    ObjectiveConfig(cfg_loss_weight=1.0)


def test_the_progress_bar_shows_no_negative_epoch_count_when_bounded_by_steps():
    from training.callbacks import StepBoundedProgressBar

    bar = StepBoundedProgressBar()
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, callbacks=[bar])
    trainer.fit_loop.max_epochs = -1  # what fit sets for a run bounded by max_steps alone
    bar._trainer = trainer  # what the bar's setup hook does when fit starts
    assert bar._get_train_description(6).strip() == "Epoch 6"
    bounded = StepBoundedProgressBar()
    bounded._trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, callbacks=[bounded])
    assert bounded._get_train_description(1).strip() == "Epoch 1/2"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["nan feature", "token out of range"])
def test_a_damaged_shard_stops_fit_naming_shard_key_and_field_and_nothing_is_exported(
    damage: str,
    tiny_dataset: Path,  # noqa: F811
    tmp_path: Path,
    capsys,
):
    from data_damage import edit_sample, read_shard, rewrite_shard

    from data.shards import load_manifest

    shards = tmp_path / "shards"
    shutil.copytree(tiny_dataset, shards)
    info = load_manifest(shards).shards[1]
    key = read_shard(shards / info.name)[1][0]  # the second sample of the second shard
    if damage == "nan feature":
        field, change = "aux", lambda arrays, meta: arrays["aux"].__setitem__((2, 3), float("nan"))
    else:
        field, change = "tokens", lambda arrays, meta: arrays["tokens"].__setitem__(1, 10**4)
    rewrite_shard(shards, 1, edit_sample(key, change))
    config = tiny_run_config(tmp_path, shards)
    capsys.readouterr()
    # training stops at the sample, before any export: exit code 2 and the data layer's message
    assert main(["--config", str(config), "--validate_before", "false", "--data.num_val_shards", "0"]) == 2
    assert f"{info.name}: sample {key}, field '{field}'" in capsys.readouterr().err
    assert not any((tmp_path / "runs").rglob("model.safetensors"))
    from data.extract import main as extract_main

    capsys.readouterr()
    assert extract_main(["--validate", str(shards), "--no-progress"]) == 1
    assert f"sample {key}, field '{field}'" in capsys.readouterr().err
