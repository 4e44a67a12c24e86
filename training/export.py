"""Export a trained drafter as a Hugging Face model folder, and optionally push it to the Hub.

    python -m training.export --ckpt runs/demo/version_0/checkpoints/last.ckpt --out exports/demo
    python -m training.export --ckpt runs/demo/version_0/checkpoints/last.ckpt/ --out exports/demo   # DeepSpeed
    python -m training.export --ckpt runs/demo/version_0/drafter --out exports/demo                  # drafter folder
    python -m training.export --ckpt runs/demo/version_0/checkpoints/last.ckpt --out exports/demo \\
        --push-to-hub my-org/eagle3-toy --private             # token: HF_TOKEN or `hf auth login`

The source is a Lightning `.ckpt` file, a DeepSpeed checkpoint folder (ZeRO partitions consolidated
first) or an existing drafter folder (config.json + model.safetensors), read by `training.checkpoints`,
the one checkpoint reader; `python -m training.convert` is this command under its old name.
The folder written holds

- `model.safetensors`: the drafter's weights only, never the target's embedding or image head;
- `config.json`: `EagleDraftModel.serving_config()` (architectures `LlamaForCausalLMEagle3` for EAGLE-3,
  `EagleLlamaForCausalLM` for EAGLE-1, the LlamaConfig fields engines read, and our `drafter_config`);
- `README.md`: a model card (YAML front matter, then target, architecture, parameters, training data,
  objective and optimizer, acceptance lengths when the run logged them, and how to load it).

Before anything is written the weight names are checked against the serving layout (docs/method.md, section "Serving
layouts"; SGLang skips unknown keys silently, so exports must be right by construction): a missing or extra key, such as
a trainer prefix (`model.`) or an embedding, is an error naming the keys. The folder is written into a temporary sibling
and renamed into place, so `--out` never holds a partial export.

The model card reads the run directory (by default the checkpoint's parent's parent, where
`training/fit.py` writes `config.yaml`, `checkpoints/` and the TensorBoard logs): the resolved config,
the training data's `manifest.json`, and the logged `val/tau_sim` and `decode/tau_*` values.

Uploads use huggingface_hub (`create_repo(exist_ok=True)` + `upload_folder`). The token comes from
`HF_TOKEN` or the login cache (`hf auth login`) and is never printed or logged. Checkpoint files are
read with `torch.load(weights_only=True)`: one that pickles code is refused, naming the object.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from models.eagle import (
    CONFIG_NAME,
    SERVING_ARCHITECTURE,
    WEIGHTS_NAME,
    DrafterConfig,
    EagleDraftModel,
    count_parameters,
)
from training.checkpoints import MODEL_PREFIX, CheckpointError, read_drafter, training_target
from training.model_card import RunInfo, collect_run_info, render_model_card


class ExportError(ValueError):
    """The source cannot be exported as is (wrong weights, existing output, no token, failed upload)."""


CARD_NAME = "README.md"
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
# Hub ids of the real targets (targets.md); the toy targets have none.
BASE_MODELS = {
    "janus-pro-7b": "deepseek-ai/Janus-Pro-7B",
    "llamagen-xl": "peizesun/llamagen_t2i",
    "lumina-mgpt-7b": "Alpha-VLLM/Lumina-mGPT-7B-768",
}
TRAINER_PREFIXES = (MODEL_PREFIX, "draft_model.", "module.", "_forward_module.", "drafter.")


# ----------------------------------------------------------------------------- the serving layout


def serving_weight_names(config: DrafterConfig) -> set[str]:
    """The exact weight names a serving engine reads for this drafter (docs/method.md, section "Serving layouts")."""
    attention = {f"self_attn.{name}_proj.weight" for name in "qkvo"}
    mlp = {f"mlp.{name}_proj.weight" for name in ("gate", "up", "down")}
    if config.architecture == "eagle3":
        norms = {f"{name}.weight" for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
        layer = {f"midlayer.{name}" for name in attention | mlp | norms}
        return {"fc.weight", *layer, "norm.weight", "lm_head.weight", "d2t", "t2d"}
    layer = {f"layers.0.{name}" for name in attention | mlp | {"post_attention_layernorm.weight"}}
    return {"fc.weight", *(["fc.bias"] if config.fc_bias else []), *layer}


def check_serving_layout(state: dict[str, Tensor], config: DrafterConfig, source: str) -> None:
    """Refuse weights whose names, shapes or dtypes differ from the serving layout, naming each offender."""
    expected = serving_weight_names(config)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        layout = SERVING_ARCHITECTURE[config.architecture]
        hints = []
        if any(name.startswith(TRAINER_PREFIXES) for name in unexpected):
            hints.append("trainer prefixes (e.g. 'model.') must be stripped")
        if any("embed" in name for name in unexpected):
            hints.append("the target's token embedding is not part of a drafter export (engines share the target's)")
        if config.architecture == "eagle1" and any(name.startswith("lm_head") for name in unexpected):
            hints.append("EAGLE-1 drafters use the target's image head, which is not exported")
        raise ExportError(
            f"{source}: the weights do not match the {config.architecture} serving layout ({layout}): "
            f"missing keys {missing}, unexpected keys {unexpected}" + (f" ({'; '.join(hints)})" if hints else "")
        )
    with torch.device("meta"):  # shapes and dtypes only: no memory, even for a 7B target's drafter
        reference = EagleDraftModel(config).state_dict()
    wrong = [
        f"{name}: {tuple(tensor.shape)} {tensor.dtype} "
        f"(expected {tuple(reference[name].shape)} {reference[name].dtype})"
        for name, tensor in sorted(state.items())
        if tensor.shape != reference[name].shape
        or (not tensor.is_floating_point() and tensor.dtype != reference[name].dtype)
    ]
    if wrong:
        raise ExportError(f"{source}: weights of the wrong shape or dtype for this drafter config: {'; '.join(wrong)}")


# ----------------------------------------------------------------------------- writing


@dataclass
class ExportResult:
    folder: Path
    parameters: int
    config: DrafterConfig
    info: RunInfo


def _check_written(folder: Path, config: DrafterConfig) -> None:
    """Re-read the written weights' names: the file itself must hold exactly the serving layout."""
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as handle:
        names = set(handle.keys())
    expected = serving_weight_names(config)
    if names != expected:
        raise ExportError(f"the written {WEIGHTS_NAME} holds {sorted(names ^ expected)} unexpectedly")


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and safetensors writes 0600 files: give the export the usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _replace_folder(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished `tmp` into place as `out` (renames on one filesystem)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        tmp.rename(out)
        return
    if not overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite to replace it")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    tmp.rename(out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def export_drafter(
    ckpt: str | Path,
    out: str | Path,
    *,
    repo_id: str | None = None,
    revision: str = "main",
    base_model: str | None = None,
    run_dir: str | Path | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the drafter of `ckpt` (checkpoint or drafter folder) as a Hugging Face model folder `out`."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite to replace it")
    source = read_drafter(ckpt)
    check_serving_layout(source.state, source.config, str(source.path))
    model = EagleDraftModel(source.config)
    model.load_state_dict(source.state, strict=True)
    info = collect_run_info(source, Path(run_dir) if run_dir is not None else None)
    base_model = base_model or BASE_MODELS.get(training_target(source))
    card = render_model_card(model, source, info, repo_id=repo_id, base_model=base_model, revision=revision)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        (tmp / CARD_NAME).write_text(card)
        _check_written(tmp, source.config)
        _apply_umask(tmp)
        _replace_folder(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(out, count_parameters(model), source.config, info)


# ----------------------------------------------------------------------------- the Hub


def _redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "<token>") if secret else text


def hub_token() -> str:
    """The Hub token (HF_TOKEN, else the login cache), or an error saying how to get one; never printed."""
    from huggingface_hub import constants, get_token

    if constants.is_offline_mode():
        raise ExportError("cannot push to the Hub in offline mode: unset HF_HUB_OFFLINE to upload")
    token = get_token()
    if not token:
        raise ExportError(
            "no Hugging Face token found: set the HF_TOKEN environment variable to a write token, "
            "or run `hf auth login` once, then rerun"
        )
    return token


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str = "main",
    endpoint: str | None = None,
    commit_message: str | None = None,
    files: Iterable[str] = EXPORT_FILES,
) -> str:
    """Create `repo_id` if needed and upload the export's files to `revision`; returns the commit URL."""
    from huggingface_hub import HfApi, constants

    token = hub_token()
    api = HfApi(endpoint=endpoint, token=token)
    try:
        # private=None: a new repo gets the namespace's default visibility; an existing one keeps its own
        api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")
        if revision != constants.DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            revision=revision,
            allow_patterns=list(files),
            commit_message=commit_message or f"Upload drafter exported from {Path(folder).name}",
        )
    except Exception as error:  # any Hub failure becomes one clean message, never echoing the token
        # `from None`: an uncaught chained traceback would print the original message unredacted
        raise ExportError(f"upload to {repo_id} failed: {_redact(str(error), token)}") from None
    return str(commit.commit_url)  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt", required=True, help="a Lightning .ckpt file, a DeepSpeed checkpoint folder or a drafter folder"
    )
    parser.add_argument(
        "--out", required=True, help="the model folder to write (model.safetensors, config.json, README.md)"
    )
    parser.add_argument("--push-to-hub", metavar="ORG/NAME", help="also upload the folder to this Hub model repo")
    parser.add_argument(
        "--private", action="store_true", help="create the Hub repo private (an existing repo keeps its visibility)"
    )
    parser.add_argument("--revision", default="main", help="the Hub branch to upload to (created if missing)")
    parser.add_argument("--base-model", help="the target's Hub id for the card (default: known for the real targets)")
    parser.add_argument("--run-dir", help="the training run's directory (default: the checkpoint's parent's parent)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    try:
        if args.push_to_hub:
            hub_token()  # no token or offline: say so before exporting, so the same command can simply be rerun
        result = export_drafter(
            args.ckpt, args.out, repo_id=args.push_to_hub, revision=args.revision, base_model=args.base_model,
            run_dir=args.run_dir, overwrite=args.overwrite,
        )  # fmt: skip
        print(
            f"wrote the {result.config.architecture} drafter of {args.ckpt} ({result.parameters:,} parameters) "
            f"to {result.folder}" + (f" (run dir {result.info.run_dir})" if result.info.run_dir else "")
        )
        if args.push_to_hub:
            try:
                url = push_to_hub(result.folder, args.push_to_hub, private=args.private, revision=args.revision)
            except ExportError as error:
                raise ExportError(f"{error} (the export in {result.folder} stands: rerun with --overwrite)") from None
            print(f"pushed to {args.push_to_hub} (revision {args.revision}): {url}")
    except (ExportError, CheckpointError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
