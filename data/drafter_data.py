"""The DataModule `training/fit.py` builds from YAML: the feature stream plus extraction on first use.

    data = DrafterDataModule(train_dir="outputs/shards/toy", target="toy", num_val_shards=1)
    data = DrafterDataModule(train_dir="outputs/shards/toy-demo", extract_config="extract_toy",
                             extract_overrides={"prompts": {"count": 3072}})   # extracted when missing

`FeatureDataModule` (data/datamodule.py) takes a `DataConfig` and a loaded target's identity; this
subclass takes plain arguments (what LightningCLI and YAML configs give), loads the target only in
`setup` (building the module never loads a 7B model), and with `extract_config` runs the extraction
recipe once per node in `prepare_data` when `train_dir` has no manifest, so `python training/fit.py
--config demo` runs on a fresh machine. `resolve_config_path` finds configs by bare name in `configs/`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch

from data.data_config import DataConfig
from data.datamodule import FeatureDataModule
from data.extract_config import resolve_config_path
from data.shards import TargetIdentity
from models.registry import shared_target


class DrafterDataModule(FeatureDataModule):
    """The feature stream for drafter training, configured by plain arguments (for YAML / LightningCLI).

    With `extract_config` set, a missing dataset is extracted first (`prepare_data`, once per node),
    so `python training/fit.py --config demo` runs on a fresh machine.

    Args:
        train_dir, val_dir, num_val_shards, batch_size, num_workers, shuffle_buffer, seed, load_aux,
            load_uncond, features, verify, on_error: see `data.data_config.DataConfig`.
        target: registry name of the target the features must come from (linked to model.target by fit.py).
        target_options: its loader's keyword arguments (linked to model.target_options by fit.py).
        extract_config: extraction YAML to run when train_dir has no manifest.json; None = fail instead.
        extract_overrides: a mapping of that recipe's keys to override, nested or dotted, as in YAML:
            `{prompts: {count: 512}}` or `{prompts.count: 512}` (out_dir, target and target_options
            always come from this module).
    """

    def __init__(
        self,
        train_dir: str,
        val_dir: str | None = None,
        num_val_shards: int = 0,
        batch_size: int = 8,
        num_workers: int = 0,
        shuffle_buffer: int = 16,
        seed: int = 0,
        load_aux: bool = True,
        load_uncond: bool = False,
        features: str = "offline",
        verify: bool = True,
        on_error: str = "raise",
        target: str = "toy",
        target_options: dict[str, Any] | None = None,
        extract_config: str | None = None,
        extract_overrides: dict[str, Any] | list[str] | None = None,
    ) -> None:
        config = DataConfig(
            train_dir=train_dir,
            val_dir=val_dir,
            num_val_shards=num_val_shards,
            batch_size=batch_size,
            num_workers=num_workers,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
            load_aux=load_aux,
            load_uncond=load_uncond,
            features=features,
            verify=verify,
            on_error=on_error,
        )
        L.LightningDataModule.__init__(self)  # FeatureDataModule's init wants the target; it loads in setup
        self.config = config
        self.target = None  # type: ignore[assignment]
        self.train_stream = self.val_stream = None
        self._verified: set[str] = set()
        self.target_name = target
        self.target_options = dict(target_options or {})
        self.extract_config = extract_config
        if isinstance(extract_overrides, list):
            raise ValueError(
                f"data.extract_overrides={extract_overrides} is a list of key=value strings; it is a mapping now, "
                "as in YAML: extract_overrides: {prompts.count: 3072} (or {prompts: {count: 3072}})"
            )
        self.extract_overrides = dict(extract_overrides or {})

    def target_placement(self) -> torch.device | None:
        """The trainer's root device (None without a trainer): the device `DrafterSystem` places the target on, so
        both load the one shared instance (`models.registry.shared_target`) on this process's GPU."""
        strategy = getattr(self.trainer, "strategy", None)
        return None if strategy is None else strategy.root_device

    def prepare_data(self) -> None:
        """Once per node, before any rank's setup: extract a missing dataset, then verify its shards (`data.verify`)."""
        self._extract_if_missing()
        if self.config.verify:
            self.verify_datasets()

    def _extract_if_missing(self) -> None:
        manifest = Path(self.config.train_dir) / "manifest.json"
        if manifest.exists():
            return
        if self.extract_config is None:
            raise FileNotFoundError(
                f"{manifest} not found: extract features first (python -m data.extract --config ...) "
                "or set data.extract_config to extract them automatically"
            )
        from data.extract import load_config, run_extraction

        recipe = dict(self.extract_overrides)
        if self.config.features == "online":  # the training step computes the states: store tokens only
            recipe.setdefault("features", "tokens")
        overrides = [*dotted_overrides(recipe), f"out_dir={self.config.train_dir}",
                     f"target={self.target_name}", f"target_options={json.dumps(self.target_options)}"]  # fmt: skip
        config = load_config(resolve_config_path(self.extract_config), overrides)
        print(f"{manifest} is missing: extracting features with {self.extract_config} -> {config.out_dir}")
        target = shared_target(self.target_name, self.target_options, device=self.target_placement())
        if run_extraction(config, target, rank=0, world_size=1) is None:
            raise RuntimeError(f"extraction into {config.out_dir} did not finish; rerun to resume it")

    def setup(self, stage: str | None = None) -> None:
        if self.target is None:  # loaded here, not in __init__: building the DataModule must not load a 7B model
            target = shared_target(self.target_name, self.target_options, device=self.target_placement())
            self.target = TargetIdentity.from_target(target)
        super().setup(stage)
        # DeepSpeed reads the micro-batch size from the loader's batch_sampler, which an iterable stream
        # (batch_size=None) lacks: state it before the strategy formats its config (which runs after setup).
        config = getattr(getattr(self.trainer, "strategy", None), "config", None)
        if isinstance(config, dict) and "zero_optimization" in config:
            config.setdefault("train_micro_batch_size_per_gpu", self.config.batch_size)


def dotted_overrides(values: dict[str, Any], prefix: str = "") -> list[str]:
    """A nested mapping as `key.sub=value` override strings: {prompts: {count: 8}} -> ["prompts.count=8"]."""
    overrides = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "target_options":
            overrides += dotted_overrides(value, f"{name}.")
        else:
            overrides.append(f"{name}={json.dumps(value)}")
    return overrides


__all__ = ["DrafterDataModule", "dotted_overrides", "resolve_config_path"]
