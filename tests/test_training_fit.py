"""The training CLI (training/fit.py): config names, validation of every shipped config, unknown keys,
dotted overrides, and tiny end-to-end runs of both command forms in subprocesses.

The parsing tests build no Trainer and load no target, so they take well under a second each. The
end-to-end runs train the registry's "toy" drafter for 3 steps on 8 toy samples extracted once per
module (about 10 s), then each run takes a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from data.drafter_data import resolve_config_path
from data.extract import load_config, run_extraction
from data.shards import load_manifest
from training.fit import build_cli, check_config, main, resolve_config_names

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TRAINING_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("extract_"))
REAL_TARGET_CONFIGS = [f"eagle{v}_{t}.yaml" for v in (1, 3) for t in ("janus", "llamagen", "lumina")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TAGS = ("train/loss", "train/acc_0", "train/ce_0", "train/cfg_ce_0", "train/grad_norm", "lr-AdamW", "val/tau_sim")


def write_yaml(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def nested(dotted: str, value: Any) -> dict[str, Any]:
    """Nest a dotted key: ("a.b.c", 3) -> {"a": {"b": {"c": 3}}}."""
    *parents, leaf = dotted.split(".")
    out: dict[str, Any] = {leaf: value}
    for parent in reversed(parents):
        out = {parent: out}
    return out


@pytest.fixture(autouse=True)
def _bare_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when it gets `args` while sys.argv has arguments too (pytest's own, here)."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


# ----------------------------------------------------------------------------- config names


def test_training_configs_exist():
    assert "demo.yaml" in TRAINING_CONFIGS and len(TRAINING_CONFIGS) >= 9, TRAINING_CONFIGS


@pytest.mark.parametrize("name", TRAINING_CONFIGS)
def test_every_config_parses_and_validates(name: str):
    cli = check_config(["--config", Path(name).stem])
    config_file = yaml.safe_load((CONFIGS / name).read_text())
    system, data = cli.model, cli.datamodule
    assert system.drafter_config.architecture == config_file["model"]["architecture"]
    assert system.target_name == config_file["model"]["target"]
    assert data.target_name == system.target_name  # linked model.target -> data.target
    assert data.config.train_dir == config_file["data"]["train_dir"]
    assert cli.config.trainer.accelerator == config_file["trainer"]["accelerator"]
    assert system.model is None and system.frozen_target is None  # nothing heavy was built


@pytest.mark.parametrize("name", REAL_TARGET_CONFIGS)
def test_every_real_target_config_measures_decode_tau_and_checks_it_at_start(name: str):
    cli = check_config(["--config", Path(name).stem])
    callbacks = cli.config_init["trainer"]["callbacks"] or []
    decoders = [c for c in callbacks if type(c).__name__ == "DecodeValidation"]
    assert len(decoders) == 1, f"{name} has no DecodeValidation callback"
    assert decoders[0].rules == ["exact", "cascade"] and decoders[0].decoder.tree == "static"
    assert 0 < decoders[0].num_prompts <= 16
    with pytest.raises(ValueError, match="unknown"):  # a misspelt rule fails when the run starts
        check_config(["--config", Path(name).stem, "--trainer.callbacks.init_args.rules", "[exact, casade]"])


def test_extraction_overrides_are_a_yaml_mapping_and_the_old_string_list_is_refused():
    from data.drafter_data import DrafterDataModule, dotted_overrides

    nested = {"prompts": {"count": 8, "source": "toy"}, "batch_size": 4, "target_options": {"dtype": "float32"}}
    assert dotted_overrides(nested) == [
        "prompts.count=8",
        'prompts.source="toy"',
        "batch_size=4",
        'target_options={"dtype": "float32"}',
    ]
    cli = check_config(["--config", "demo", "--data.extract_overrides", "{prompts.count: 16, batch_size: 8}"])
    assert cli.datamodule.extract_overrides == {"prompts.count": 16, "batch_size": 8}
    with pytest.raises(ValueError, match=r"it is a mapping now, as in YAML: extract_overrides: \{prompts.count"):
        DrafterDataModule(train_dir="x", extract_overrides=["prompts.count=16"])


def test_bare_names_resolve_in_configs():
    assert resolve_config_path("demo") == CONFIGS / "demo.yaml"
    assert resolve_config_path("demo.yaml") == CONFIGS / "demo.yaml"
    resolved = resolve_config_names(["--config", "demo", "--config=eagle3_toy", "--data.train_dir", "demo"])
    assert resolved == ["--config", str(CONFIGS / "demo.yaml"), f"--config={CONFIGS / 'eagle3_toy.yaml'}",
                        "--data.train_dir", "demo"]  # fmt: skip


def test_an_existing_path_is_kept(tmp_path: Path):
    path = write_yaml(tmp_path / "demo.yaml", {"data": {"train_dir": "x"}})  # shadows the name: the file wins
    assert resolve_config_names(["--config", str(path)]) == ["--config", str(path)]


def test_an_unknown_name_lists_the_known_names(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(FileNotFoundError, match="nope") as error:
        resolve_config_names(["--config", "nope"])
    for name in ("demo", "eagle3_toy", "eagle1_janus"):
        assert name in str(error.value)
    assert main(["--config", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "known names" in err and "demo" in err


# ----------------------------------------------------------------------------- unknown keys, overrides

UNKNOWN_KEYS = [
    "model.objective.ttt_stepz",
    "model.optimizer.lrr",
    "model.presett",
    "trainer.max_stepz",
    "data.batch_sizez",
    "checkpoint.every_n_train_stepz",
    "bogus_top_level",
]


@pytest.mark.parametrize("key", UNKNOWN_KEYS)
def test_an_unknown_yaml_key_is_an_error_naming_it(key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    values = nested(key, 3)
    values.setdefault("data", {})["train_dir"] = "x"
    path = write_yaml(tmp_path / "bad.yaml", values)
    with pytest.raises(SystemExit) as exit_info:
        check_config(["--config", str(path)])
    assert exit_info.value.code != 0
    assert key.rsplit(".", 1)[-1] in capsys.readouterr().err


@pytest.mark.parametrize("key", UNKNOWN_KEYS)
def test_an_unknown_dotted_override_is_an_error_naming_it(key: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        check_config(["--config", "demo", f"--{key}", "3"])
    assert exit_info.value.code != 0
    assert key.rsplit(".", 1)[-1] in capsys.readouterr().err


def test_an_unknown_drafter_override_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]):
    """model.drafter is a free dict (DrafterConfig overrides): the key is caught when the system is built."""
    with pytest.raises((SystemExit, TypeError, ValueError)) as error:
        check_config(["--config", "demo", "--model.drafter", "{num_headz: 4}"])
    assert "num_headz" in str(error.value) + capsys.readouterr().err


def test_dotted_overrides_take_effect():
    cli = check_config([
        "--config", "demo", "--model.objective.ttt_steps", "3", "--model.optimizer.lr", "0.01",
        "--data.batch_size", "2", "--trainer.max_steps", "7", "--model.drafter", "{num_heads: 4}",
    ])  # fmt: skip
    assert cli.model.objective.ttt_steps == 3
    assert cli.config.model.objective.ttt_steps == 3
    assert cli.model.objective.eval_steps == 5  # untouched keys keep the YAML's values
    assert cli.model.optimizer_config.lr == 0.01
    assert cli.model.drafter_config.num_heads == 4
    assert cli.datamodule.config.batch_size == 2
    assert cli.config.trainer.max_steps == 7


def test_a_later_config_overrides_an_earlier_one(tmp_path: Path):
    extra = write_yaml(tmp_path / "extra.yaml", {"model": {"objective": {"ttt_steps": 2}}, "data": {"batch_size": 3}})
    cli = check_config(["--config", "demo", "--config", str(extra)])
    assert cli.model.objective.ttt_steps == 2 and cli.model.objective.eval_steps == 5
    assert cli.datamodule.config.batch_size == 3


def test_an_invalid_value_is_an_error():
    with pytest.raises((SystemExit, ValueError)):
        check_config(["--config", "demo", "--model.optimizer.schedule", "cosinus"])


def test_build_cli_builds_the_trainer_without_loading_the_target(tmp_path: Path):
    cli = build_cli([
        "--config", "demo", "--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
    ])  # fmt: skip
    assert cli.trainer.max_steps == 2
    assert cli.trainer.gradient_clip_val == 0.5
    assert cli.trainer.checkpoint_callback is not None and cli.trainer.checkpoint_callback.monitor == "val/tau_sim"
    assert {type(c).__name__ for c in cli.trainer.callbacks} >= {"LearningRateMonitor", "ExportDrafter"}
    assert cli.model.frozen_target is None


def test_print_config_shows_the_resolved_config(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["--config", "demo", "--model.objective.ttt_steps", "3", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["objective"]["ttt_steps"] == 3
    assert (
        printed["trainer"]["max_steps"]
        == yaml.safe_load(resolve_config_path("demo").read_text())["trainer"]["max_steps"]
    )


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 toy-target samples in 2 shards of 4, with aux, uncond_hidden and uncond_aux (configs/extract_toy.yaml)."""
    folder = tmp_path_factory.mktemp("fit") / "shards"
    overrides = [f"out_dir={folder}", "prompts.count=8", "samples_per_shard=4", "batch_size=4", "num_threads=1"]
    config = load_config(CONFIGS / "extract_toy.yaml", overrides)
    assert config.store_aux and config.store_uncond
    threads = torch.get_num_threads()
    try:
        manifest = run_extraction(config, rank=0, world_size=1, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert manifest is not None and manifest.num_samples == 8 and len(manifest.shards) == 2
    return folder


def test_the_tiny_dataset_has_what_the_demo_recipe_needs(tiny_dataset: Path):
    fields = load_manifest(tiny_dataset).fields
    assert {"tokens", "hidden", "aux", "uncond_hidden", "uncond_aux"} <= set(fields)


def tiny_run_config(tmp_path: Path, dataset: Path) -> Path:
    """A complete standalone config: the demo recipe at tiny size, 3 steps, validating after step 2."""
    return write_yaml(tmp_path / "tiny.yaml", {
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 3, "val_check_interval": 2,
            "check_val_every_n_epoch": None, "log_every_n_steps": 1, "gradient_clip_val": 0.5,
            "enable_progress_bar": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(tmp_path / "runs"), "name": "tiny", "version": "",
                              "default_hp_metric": False},
            },
        },
        "model": {
            "target": "toy", "architecture": "eagle3", "preset": "toy",
            "objective": {"ttt_steps": 3, "eval_steps": 3, "cfg_loss_weight": 1.0},
            "optimizer": {"lr": 1.0e-3, "warmup_steps": 1, "schedule": "cosine"},
        },
        "data": {"train_dir": str(dataset), "num_val_shards": 1, "batch_size": 2, "load_aux": True,
                 "load_uncond": True},
        "checkpoint": {"every_n_train_steps": 3},
    })  # fmt: skip


def demo_overrides(tmp_path: Path, dataset: Path) -> list[str]:
    """configs/demo.yaml itself, shrunk by a logger-only config and dotted overrides."""
    logger = write_yaml(tmp_path / "logger.yaml", {"trainer": {"logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(tmp_path / "runs"), "name": "tiny", "version": "", "default_hp_metric": False},
    }}})  # fmt: skip
    return [
        "--config", "demo", "--config", str(logger), "--data.train_dir", str(dataset), "--trainer.max_steps", "3",
        "--data.batch_size", "2", "--data.num_val_shards", "1", "--trainer.val_check_interval", "2",
        "--trainer.log_every_n_steps", "1", "--checkpoint.every_n_train_steps", "3",
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip


def scalar_tags(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.parametrize("form", ["script", "module"])
def test_fit_end_to_end(form: str, tiny_dataset: Path, tmp_path: Path):
    if form == "script":  # a standalone config; `python training/fit.py` imports `training` from the install
        command = [
            sys.executable,
            str(REPO / "training" / "fit.py"),
            "--config",
            str(tiny_run_config(tmp_path, tiny_dataset)),
        ]
    else:  # configs/demo.yaml by name, shrunk on the command line
        command = [sys.executable, "-m", "training.fit", *demo_overrides(tmp_path, tiny_dataset)]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    run_dir = tmp_path / "runs" / "tiny"

    assert "simulated acceptance length" in result.stdout and "untrained ->" in result.stdout
    assert f"tensorboard --logdir {run_dir}" in result.stdout
    assert "steps: 3" in result.stdout
    # stdout is a pipe, not a terminal: a plain progress line every log_every_n_steps (1) steps
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], lines
    assert all("loss " in line and "steps/s" in line and "left" in line for line in lines), lines
    assert "tau_sim -" in lines[0] and "tau_sim 1." in lines[-1]  # the validation before training, then after step 2

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["trainer"]["max_steps"] == 3
    assert resolved["data"]["train_dir"] == str(tiny_dataset) and resolved["data"]["batch_size"] == 2
    assert resolved["model"]["objective"]["cfg_loss_weight"] == 1.0  # uncond_aux exists: the demo recipe as is

    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file()
    assert list(checkpoints.glob("best-step=*.ckpt"))
    checkpoint = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 3
    assert checkpoint["drafter_config"]["architecture"] == "eagle3"

    drafter = run_dir / "drafter"
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
    exported = load_file(drafter / "model.safetensors")
    trained = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}
    for name, tensor in exported.items():  # the export is the final drafter, weight for weight
        assert torch.equal(tensor, trained[name]), name

    tags = scalar_tags(run_dir)
    missing = [tag for tag in TAGS if tag not in tags]
    assert not missing, f"missing {missing}; logged {sorted(tags)}"
    assert len(tags["train/loss"]) == 3
    # before training (validate_before), after step 2 (val_check_interval) and after the final step 3
    assert len(tags["val/tau_sim"]) == 3 and tags["val/tau_sim"][-1][0] == 3
    assert all(1.0 <= value <= 4.0 for _, value in tags["val/tau_sim"])  # 1 + sum of 3 products of accuracies
