"""The one checkpoint reader: Lightning `.ckpt` files, DeepSpeed checkpoint folders and exported drafter folders.

    source = read_drafter("runs/demo/version_0/checkpoints/last.ckpt")   # or a DeepSpeed folder, or a drafter folder
    model = drafter_from_checkpoint("runs/demo/version_0/checkpoints/last.ckpt")

Used by `training.export` (and its `training.convert` alias) and by the model card; `training/fit.py`
resumes through Lightning's own loader, which reads the same files. Three layouts:

- a `.ckpt` file (single process, DDP, FSDP full state): a `torch.save`d dict with `state_dict`,
  `hyper_parameters` and the `drafter_config` that `DrafterSystem.on_save_checkpoint` adds;
- a DeepSpeed checkpoint directory (Lightning's `DeepSpeedStrategy`, or `CPUDeepSpeedStrategy`):
  `latest` naming a tag folder (Lightning's is `checkpoint/`) holding `*model_states.pt` and, under
  ZeRO, one `*optim_states.pt` per rank. ZeRO partitions are consolidated into fp32 weights with
  DeepSpeed's `zero_to_fp32` (the same code as Lightning's `convert_zero_checkpoint_to_fp32_state_dict`,
  kept in memory); the Lightning state (hparams, drafter_config) comes from the model-states file.
  The tag folder itself is accepted too;
- a drafter folder (`config.json` with a `drafter_config` section + `model.safetensors`).

The drafter config is the checkpoint's `drafter_config` (it carries the vocabulary-map key of a
reduced draft vocabulary), else `hyper_parameters["drafter"]`. Files are read with
`torch.load(weights_only=True)` (tensors, plain containers and the few DeepSpeed types its checkpoints
hold): a checkpoint that pickles anything else is refused with the object named. ZeRO partitions are
consolidated by DeepSpeed's own loader, which unpickles them fully, so every rank's file is screened
with the safe loader first.
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from models.eagle import CONFIG_NAME, WEIGHTS_NAME, DrafterConfig, EagleDraftModel

MODEL_PREFIX = "model."
WRAPPER_PREFIX = "_forward_module."  # Lightning < 2.1 DeepSpeed checkpoints
DEEPSPEED_STATES = ("module", "optimizer", "lr_scheduler")  # the engine's own entries of the model-states file


class CheckpointError(ValueError):
    """The checkpoint is missing, of an unknown layout, or does not hold a DrafterSystem."""


def _allowed_globals() -> list[Any]:
    """Non-tensor types DeepSpeed writes into its checkpoint files (enums, loss scalers), where importable."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # deepspeed absent: its checkpoints cannot be consolidated anyway
        return []
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_torch_load(path: str | Path) -> Any:
    """`torch.load` that runs no pickled code: tensors, containers and `_allowed_globals` only."""
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        if found is None:  # not a refused object: the file is no pickle at all
            raise
        raise CheckpointError(
            f"{path} holds objects that safe loading refuses (it pickles {found.group(1)}); it was not written "
            "by this project's training, or holds extra objects: load and re-save its state_dict in code you trust"
        ) from error


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(module state dict, Lightning checkpoint fields other than the weights) of a .ckpt file or DeepSpeed folder."""
    path = Path(path)
    if path.is_file():
        return _load_file(path)
    if path.is_dir():
        return _load_deepspeed(path)
    raise CheckpointError(f"checkpoint {path} not found: pass a Lightning .ckpt file or a DeepSpeed checkpoint folder")


def _load_file(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    try:
        checkpoint = safe_torch_load(path)
    except CheckpointError:
        raise
    except Exception as error:  # any other loading failure means: not a checkpoint file
        raise CheckpointError(f"{path} is not a Lightning checkpoint file (torch.load failed: {error})") from error
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = sorted(checkpoint)[:10] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it has no 'state_dict' (found {found})")
    state = checkpoint.pop("state_dict")
    return state, checkpoint


def _deepspeed_tag_folder(path: Path) -> Path | None:
    """The folder holding the model-states files: `path` itself, or the tag its `latest` file names."""
    if any(path.glob("*model_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = path / latest.read_text().strip()
        if not tag.is_dir():
            raise CheckpointError(f"{latest} names the tag folder {tag.name!r}, which does not exist in {path}")
        return tag
    return None


def _load_deepspeed(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    folder = _deepspeed_tag_folder(path)
    if folder is None:
        listed = sorted(p.name for p in path.iterdir())[:10]
        raise CheckpointError(
            f"{path} is a folder but not a DeepSpeed checkpoint: it has neither a 'latest' file nor "
            f"*model_states.pt files (it holds {listed})"
        )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_file

    optim_files = sorted(folder.glob("*optim_states.pt"))
    zero_stage = 0
    if optim_files:
        optim = safe_torch_load(optim_files[0])
        zero_stage = int(optim.get("optimizer_state_dict", {}).get("zero_stage", 0))
    model_file = (
        get_model_state_file(str(folder), zero_stage) if zero_stage else str(folder / "mp_rank_00_model_states.pt")
    )
    if not Path(model_file).is_file():
        raise CheckpointError(f"{path}: the DeepSpeed model-states file {model_file} is missing")
    client_state = safe_torch_load(model_file)
    if zero_stage:  # the weights live in the per-rank fp32 optimizer partitions
        for other in optim_files[1:]:  # DeepSpeed's consolidation unpickles every rank's file: screen them first
            safe_torch_load(other)
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    else:  # no ZeRO: the full module state is saved as is
        state = client_state.get("module")
        if state is None:
            raise CheckpointError(f"{model_file} has no 'module' weights and {folder} no ZeRO optimizer states")
    state = {key.removeprefix(WRAPPER_PREFIX): value for key, value in state.items()}
    fields = {key: value for key, value in client_state.items() if key not in DEEPSPEED_STATES}
    return state, fields


def drafter_config_from(fields: dict[str, Any], source: str) -> DrafterConfig:
    """The drafter config a DrafterSystem checkpoint records (drafter_config, else hyper_parameters.drafter)."""
    values = fields.get("drafter_config")
    if values is None:
        values = (fields.get("hyper_parameters") or {}).get("drafter")
    if values is None:
        raise CheckpointError(
            f"{source} holds no drafter config ('drafter_config' or hyper_parameters.drafter): "
            "is it a checkpoint of training.system.DrafterSystem?"
        )
    return DrafterConfig.from_dict(dict(values), source=source)


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


def read_drafter(path: str | Path) -> DrafterSource:
    """Read a Lightning .ckpt file, a DeepSpeed checkpoint folder or a drafter folder (weights left unchecked)."""
    path = Path(path)
    if is_drafter_folder(path):
        config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not weights_path.is_file():
            raise CheckpointError(f"{weights_path} not found: a drafter folder holds {CONFIG_NAME} and {WEIGHTS_NAME}")
        values = json.loads(config_path.read_text())
        if "drafter_config" not in values:
            raise CheckpointError(f"{config_path} has no 'drafter_config' section: it is not a drafter folder")
        config = DrafterConfig.from_dict(values["drafter_config"], source=str(config_path))
        return DrafterSource(path, "drafter folder", config, load_file(str(weights_path)))
    state, fields = load_checkpoint(path)
    config = drafter_config_from(fields, str(path))
    # The trainer's own prefix is stripped; anything else (another module, an embedding) stays and is refused.
    weights = {name.removeprefix(MODEL_PREFIX): tensor for name, tensor in state.items()}
    kind = "lightning checkpoint" if path.is_file() else "deepspeed checkpoint"
    return DrafterSource(path, kind, config, weights, fields)


def drafter_from_checkpoint(path: str | Path) -> EagleDraftModel:
    """Rebuild the drafter of a checkpoint (file or DeepSpeed folder) or drafter folder, on CPU, weights checked."""
    source = read_drafter(path)
    model = EagleDraftModel(source.config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(source.state)), sorted(set(source.state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing drafter weights {missing}, unexpected weights {unexpected}")
    model.load_state_dict(source.state, strict=True)
    return model
