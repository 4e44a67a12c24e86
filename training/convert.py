"""Turn a Lightning checkpoint of `DrafterSystem` into a plain drafter folder (config.json + model.safetensors).

    python -m training.convert --ckpt runs/drafter/checkpoints/last.ckpt --out drafters/toy
    python -m training.convert --ckpt runs/drafter/checkpoints/last.ckpt/ --out drafters/toy   # DeepSpeed

Two checkpoint layouts are read:

- a `.ckpt` file (single process, DDP, FSDP full state): a `torch.save`d dict with `state_dict`,
  `hyper_parameters` and the `drafter_config` that `DrafterSystem.on_save_checkpoint` adds;
- a DeepSpeed checkpoint directory (Lightning's `DeepSpeedStrategy`, or `CPUDeepSpeedStrategy`):
  `latest` naming a tag folder (Lightning's is `checkpoint/`) holding `*model_states.pt` and, under
  ZeRO, one `*optim_states.pt` per rank. ZeRO partitions are consolidated into fp32 weights with
  DeepSpeed's `zero_to_fp32` (the same code as Lightning's `convert_zero_checkpoint_to_fp32_state_dict`,
  kept in memory); the Lightning state (hparams, drafter_config) comes from the model-states file.
  The tag folder itself is accepted too.

The drafter config is the checkpoint's `drafter_config` (it carries the vocabulary-map key of a
reduced draft vocabulary), else `hyper_parameters["drafter"]`. Weights are the `model.` entries of
the module's state dict, prefix stripped; a missing or unexpected weight is an error naming the
checkpoint. Files are read with `torch.load(weights_only=True)` (tensors, plain containers and the few
DeepSpeed enums its checkpoints hold): a checkpoint that pickles anything else is refused with the
object named. ZeRO partitions are consolidated by DeepSpeed's own loader.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.eagle import DrafterConfig, EagleDraftModel

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


def drafter_from_checkpoint(path: str | Path) -> EagleDraftModel:
    """Rebuild the trained drafter of a DrafterSystem checkpoint (file or DeepSpeed folder), on CPU."""
    state, fields = load_checkpoint(path)
    config = drafter_config_from(fields, str(path))
    weights = {key.removeprefix(MODEL_PREFIX): value for key, value in state.items() if key.startswith(MODEL_PREFIX)}
    if not weights:
        raise CheckpointError(f"{path} has no '{MODEL_PREFIX}*' weights (found {sorted(state)[:10]})")
    model = EagleDraftModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing drafter weights {missing}, unexpected weights {unexpected}")
    model.load_state_dict(weights, strict=True)
    return model


def convert_checkpoint(ckpt: str | Path, out: str | Path) -> Path:
    """Write the drafter of checkpoint `ckpt` to folder `out` (`EagleDraftModel.save_pretrained`); returns `out`."""
    return drafter_from_checkpoint(ckpt).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt file or a DeepSpeed checkpoint folder")
    parser.add_argument("--out", required=True, help="the drafter folder to write (config.json + model.safetensors)")
    args = parser.parse_args(argv)
    try:
        folder = convert_checkpoint(args.ckpt, args.out)
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote the drafter of {args.ckpt} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
