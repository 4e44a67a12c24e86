"""The six GPU configs (EAGLE-1/EAGLE-3 for Janus-Pro-7B, LlamaGen-XL, Lumina-mGPT-7B), run as written.

- At real size: each config's drafter fits the real architecture of its target, built with random
  weights on the meta device (no memory, no download): vocabulary, hidden size, EAGLE-3 streams and
  the embedding width the drafter reads.
- On two CPU ranks: `training/fit.py --config <that config>` trains two steps with the config's own
  strategy (DeepSpeed ZeRO-2, which `training.fit` runs as `CPUDeepSpeedStrategy` on a CPU accelerator:
  same stage, precision and clipping, gloo collectives), precision (`bf16-mixed`), gradient clipping,
  callbacks (`DecodeValidation` decodes with the trained drafter), data mode, objective and optimizer.
  Changed, and nothing else: the accelerator (`cpu`) and device count (2), the target built tiny with
  random weights of the same family (`model.target_options: {random_weights: tiny}`) and the drafter
  shaped for it (`model.preset: tiny`, its vocabulary), the dataset (a tiny token-only extraction), the
  step counts and the log folder. The test compares every other key of the YAML with the resolved
  config the run saved, so an override that sneaks in fails it.
- What cannot run on a CPU (`accelerator: gpu`, `devices: 8`): the strategy is built from the YAML's
  own `trainer.strategy` and its DeepSpeed config checked (ZeRO stage, the process-group timeout,
  clipping by norm, bf16), and a config that puts `gradient_clip_algorithm: value` back is refused,
  naming the key, before any target loads (Lightning would raise in `init_deepspeed`, after every rank
  had loaded the 7B target).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.drafter_data import resolve_config_path
from inference.decoding.eagle import check_compatible
from models.eagle import WEIGHTS_NAME, EagleDraftModel
from models.random_weights import random_target
from training.export import export_drafter
from training.fit import CPU_DEEPSPEED_CLASS, ConfigError, check_config, deepspeed_strategy_args, main

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
REAL_CONFIGS = [f"eagle{v}_{family}" for family in ("janus", "llamagen", "lumina") for v in (1, 3)]
TINY_VOCAB = {"janus-pro-7b": 64, "llamagen-xl": 64, "lumina-mgpt-7b": 16 + 2}  # codes (+ Lumina's 2 layout tokens)
STEPS = 2

# The keys a CPU run changes (dotted paths into the YAML). Everything else must reach the run unchanged.
CHANGED_KEYS = {
    "trainer.accelerator", "trainer.devices", "trainer.strategy",  # the strategy's class only: checked below
    "trainer.max_epochs", "trainer.max_steps", "trainer.val_check_interval", "trainer.log_every_n_steps",
    "trainer.logger.init_args.save_dir",
    "model.target_options", "model.preset", "model.drafter",
    "data.train_dir", "data.extract_config", "data.extract_overrides",
    "checkpoint.every_n_train_steps",
}  # fmt: skip


def load_yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load(resolve_config_path(name).read_text())


def flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.0.c": leaf} of nested mappings and lists (list items by index)."""
    if isinstance(values, dict):
        items = [(str(key), value) for key, value in values.items()]
    elif isinstance(values, list):
        items = [(str(index), value) for index, value in enumerate(values)]
    else:
        return {prefix: values}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return flat


def cpu_overrides(name: str, tmp: Path) -> list[str]:
    """The command-line overrides of a CPU run: only the keys in CHANGED_KEYS."""
    target = load_yaml(name)["model"]["target"]
    return [
        "--config", name,
        "--trainer.accelerator", "cpu", "--trainer.devices", "2",
        "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", str(STEPS),
        "--trainer.log_every_n_steps", "1",
        "--trainer.logger.init_args.save_dir", str(tmp / "runs"),
        "--model.target_options", "{random_weights: tiny}", "--model.preset", "tiny",
        "--model.drafter", f"{{vocab_size: {TINY_VOCAB[target]}}}",
        "--data.train_dir", str(tmp / "shards"), "--data.extract_config", "extract_toy",
        "--data.extract_overrides", "{prompts.count: 48, samples_per_shard: 4, batch_size: 4}",
        "--checkpoint.every_n_train_steps", str(STEPS),
    ]  # fmt: skip


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_config_drafter_fits_the_real_size_target(name: str):
    system = check_config(["--config", name]).model
    with torch.device("meta"):
        drafter = EagleDraftModel(system.drafter_config)
    target = random_target(system.target_name, "real", dtype=torch.bfloat16, device="meta")
    check_compatible(drafter, target)
    width = target.embed_image_tokens(torch.zeros(1, dtype=torch.long, device="meta")).shape[-1]
    assert width == system.drafter_config.hidden_size == target.hidden_size


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_config_strategy_builds_as_written_for_the_gpu(name: str):
    """The YAML's strategy, built as on the GPU node: DeepSpeed ZeRO-2 with an explicit process-group timeout,
    clipping by norm (the only clipping DeepSpeed's engine does), and bf16 mixed precision."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainer = load_yaml(name)["trainer"]
    assert (trainer["accelerator"], trainer["precision"]) == ("gpu", "bf16-mixed")
    init_args = deepspeed_strategy_args(trainer["strategy"])
    assert init_args is not None, f"{name}: trainer.strategy {trainer['strategy']!r} is not DeepSpeed"
    assert "timeout" in init_args, f"{name}: trainer.strategy sets no process-group timeout"
    hours, minutes, seconds = (int(part) for part in str(init_args["timeout"]).split(":"))
    timeout = timedelta(hours=hours, minutes=minutes, seconds=seconds)
    strategy = DeepSpeedStrategy(**{**init_args, "timeout": timeout})
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert strategy._timeout == timeout >= timedelta(minutes=30)
    assert trainer.get("gradient_clip_algorithm", "norm") == "norm" and trainer["gradient_clip_val"] > 0


@pytest.mark.parametrize("name", ["eagle1_janus", "eagle3_lumina"])
def test_value_clipping_under_deepspeed_is_refused_naming_the_key(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    values = load_yaml(name)
    values["trainer"]["gradient_clip_algorithm"] = "value"
    planted = tmp_path / f"{name}.yaml"
    planted.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError, match=r"trainer\.gradient_clip_algorithm: value"):
        check_config(["--config", str(planted)])
    argv = cpu_overrides(name, tmp_path)
    argv[argv.index(name)] = str(planted)
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "trainer.gradient_clip_algorithm: value" in error and str(planted) in error
    assert not (tmp_path / "shards").exists()  # refused before extraction or any target load


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_fit_runs_the_config_as_written_on_two_cpu_ranks(name: str, tmp_path: Path):
    command = [sys.executable, str(REPO / "training" / "fit.py"), *cpu_overrides(name, tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} failed:\n{output[-6000:]}"
    assert f"steps: {STEPS}" in result.stdout and "untrained ->" in result.stdout, output[-3000:]
    assert "decode validation:" in output  # the config's DecodeValidation decoded with the drafter

    run = tmp_path / "runs" / name / "version_0"
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    written, ran = flatten(load_yaml(name)), flatten(resolved)  # the run also records every default
    for key, value in written.items():
        if key in CHANGED_KEYS or any(key.startswith(changed + ".") for changed in CHANGED_KEYS):
            continue
        assert ran.get(key) == value, f"{name}: {key} ran as {ran.get(key)!r}, the YAML says {value!r}"
    strategy = resolved["trainer"]["strategy"]
    assert strategy["class_path"] == CPU_DEEPSPEED_CLASS
    assert strategy["init_args"]["stage"] == 2 and strategy["init_args"]["timeout"] is not None
    assert resolved["trainer"]["precision"] == "bf16-mixed" and int(resolved["trainer"]["devices"]) == 2

    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir(), "a DeepSpeed checkpoint is a folder of ZeRO partitions"
    assert len(list(last.rglob("*optim_states.pt"))) == 2  # one optimizer partition per rank
    # one final drafter: the run's export is `training.export` of last.ckpt, the float32 ZeRO masters
    exported = export_drafter(last, tmp_path / "exported", run_dir=run)
    run_weights = load_file(str(run / "drafter" / WEIGHTS_NAME))
    export_weights = load_file(str(exported.folder / WEIGHTS_NAME))
    assert sorted(run_weights) == sorted(export_weights)
    for key, value in run_weights.items():
        assert torch.equal(value, export_weights[key]) and value.dtype == export_weights[key].dtype, key
        assert value.dtype == torch.float32 or not value.is_floating_point(), (key, value.dtype)  # d2t/t2d: ids
    assert "float32" in (run / "drafter" / "README.md").read_text()
    assert exported.config.architecture == name.split("_")[0]
    # train/grad_norm is logged under ZeRO-2 (the engine's global norm: the parameters' .grad stays empty)
    events = EventAccumulator(str(run))
    events.Reload()
    norms = [event.value for event in events.Scalars("train/grad_norm")]
    assert len(norms) == STEPS and all(math.isfinite(norm) and norm > 0 for norm in norms), norms
