"""What `training.export` exports from: a Lightning checkpoint, a DeepSpeed checkpoint folder or a drafter folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor

from models.eagle import CONFIG_NAME, WEIGHTS_NAME, DrafterConfig
from training.convert import MODEL_PREFIX, drafter_config_from, load_checkpoint


class ExportError(ValueError):
    """The source cannot be exported as is (wrong weights, existing output, no token, failed upload)."""


@dataclass
class DrafterSource:
    """A drafter read from a checkpoint or a drafter folder: its config, weights and what the checkpoint recorded."""

    path: Path
    kind: str
    """"lightning checkpoint", "deepspeed checkpoint" or "drafter folder"."""
    config: DrafterConfig
    state: dict[str, Tensor]
    """Weights under their serving names (the trainer's `model.` prefix already stripped)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's other fields (hyper_parameters, global_step, callbacks, ...); empty for a drafter folder."""

    @property
    def global_step(self) -> int | None:
        step = self.fields.get("global_step")
        return int(step) if step is not None else None


def training_target(source: DrafterSource) -> str:
    """The target's registry name: the run's `model.target` (the drafter config names its shape preset)."""
    return (source.fields.get("hyper_parameters") or {}).get("target") or source.config.target or "unknown"


def is_drafter_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_NAME).is_file()


def read_source(path: str | Path) -> DrafterSource:
    """Read a Lightning .ckpt file, a DeepSpeed checkpoint folder or a drafter folder (weights left unchecked)."""
    path = Path(path)
    if is_drafter_folder(path):
        config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not weights_path.is_file():
            raise ExportError(f"{weights_path} not found: a drafter folder holds {CONFIG_NAME} and {WEIGHTS_NAME}")
        values = json.loads(config_path.read_text())
        if "drafter_config" not in values:
            raise ExportError(f"{config_path} has no 'drafter_config' section: it is not a drafter folder")
        config = DrafterConfig.from_dict(values["drafter_config"], source=str(config_path))
        return DrafterSource(path, "drafter folder", config, load_file(str(weights_path)))
    state, fields = load_checkpoint(path)
    config = drafter_config_from(fields, str(path))
    # The trainer's own prefix is stripped; anything else (another module, an embedding) stays and is refused.
    weights = {name.removeprefix(MODEL_PREFIX): tensor for name, tensor in state.items()}
    kind = "lightning checkpoint" if path.is_file() else "deepspeed checkpoint"
    return DrafterSource(path, kind, config, weights, fields)
