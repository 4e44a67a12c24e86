"""The six GPU configs (EAGLE-1/EAGLE-3 for Janus-Pro-7B, LlamaGen-XL, Lumina-mGPT-7B) against their adapters.

- At real size: each config's drafter fits the real architecture of its target, built with random
  weights on the meta device (no memory, no download): vocabulary, hidden size, EAGLE-3 streams and
  the embedding width the drafter reads.
- On a CPU: `training/fit.py --config <that config>` runs a few steps on the family's tiny stand-in
  (`model.target_options: {random_weights: tiny}`), extracting its features first, with only the
  machine-specific settings and the drafter's width overridden.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from data.drafter_data import resolve_config_path
from inference.decoding.eagle import check_compatible
from models.eagle import EagleDraftModel
from models.random_weights import random_target
from models.registry import shared_target
from training.fit import check_config, main

pytest.importorskip("transformers")

REAL_CONFIGS = [f"eagle{v}_{family}" for family in ("janus", "llamagen", "lumina") for v in (1, 3)]
TINY_VOCAB = {"janus-pro-7b": 64, "llamagen-xl": 64, "lumina-mgpt-7b": 16 + 2}  # codes (+ Lumina's 2 layout tokens)


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
def test_fit_runs_the_config_on_the_tiny_stand_in(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    target = yaml.safe_load(resolve_config_path(name).read_text())["model"]["target"]
    shared_target.cache_clear()
    status = main([
        "--config", name,
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--trainer.precision", "32-true", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        "--model.target_options", "{random_weights: tiny}", "--model.preset", "tiny",
        "--model.drafter", f"{{vocab_size: {TINY_VOCAB[target]}}}",
        "--model.objective.ttt_steps", "3", "--model.objective.eval_steps", "3",
        "--model.optimizer.warmup_steps", "1",
        "--data.train_dir", str(tmp_path / "shards"), "--data.extract_config", "extract_toy",
        "--data.extract_overrides", "{prompts.count: 8, samples_per_shard: 4, batch_size: 4}",
        "--data.num_workers", "0", "--data.num_val_shards", "1", "--checkpoint.every_n_train_steps", "2",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0
    assert "steps: 2" in printed and "untrained ->" in printed
    run = tmp_path / "runs" / name / "version_0"  # each run takes the next version folder
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["target"] == target and resolved["model"]["target_options"] == {"random_weights": "tiny"}
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "drafter" / "model.safetensors").is_file()
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2
    assert checkpoint["drafter_config"]["architecture"] == name.split("_")[0]
