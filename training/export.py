"""Export a trained drafter as a Hugging Face model folder, and optionally push it to the Hub.

    python -m training.export --ckpt runs/demo/checkpoints/last.ckpt --out exports/demo
    python -m training.export --ckpt runs/demo/checkpoints/last.ckpt/ --out exports/demo     # DeepSpeed folder
    python -m training.export --ckpt runs/demo/drafter --out exports/demo                    # a drafter folder
    python -m training.export --ckpt runs/demo/checkpoints/last.ckpt --out exports/demo \\
        --push-to-hub my-org/eagle3-toy --private             # token: HF_TOKEN or `hf auth login`

The source is a Lightning `.ckpt` file, a DeepSpeed checkpoint folder (ZeRO partitions consolidated
first; `training.convert.load_checkpoint`) or an existing drafter folder (config.json + model.safetensors).
The folder written holds

- `model.safetensors`: the drafter's weights only, never the target's embedding or image head;
- `config.json`: `EagleDraftModel.serving_config()` (architectures `LlamaForCausalLMEagle3` for EAGLE-3,
  `EagleLlamaForCausalLM` for EAGLE-1, the LlamaConfig fields engines read, and our `drafter_config`);
- `README.md`: a model card (YAML front matter, then target, architecture, parameters, training data,
  objective and optimizer, acceptance lengths when the run logged them, and how to load it).

Before anything is written the weight names are checked against the serving layout (peers.md §4;
SGLang skips unknown keys silently, so exports must be right by construction): a missing or extra key,
such as a trainer prefix (`model.`) or an embedding, is an error naming the keys. The folder is
written into a temporary sibling and renamed into place, so `--out` never holds a partial export.

The model card reads the run directory (by default the checkpoint's parent's parent, where
`training/fit.py` writes `config.yaml`, `checkpoints/` and the TensorBoard logs): the resolved config,
the training data's `manifest.json`, and the logged `val/tau_sim` and `decode/tau_*` values.

Uploads use huggingface_hub (`create_repo(exist_ok=True)` + `upload_folder`). The token comes from
`HF_TOKEN` or the login cache (`hf auth login`) and is never printed or logged. Checkpoints are
unpickled (as Lightning loads them): export only checkpoints you trust.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from models.eagle import (
    CONFIG_NAME,
    SERVING_ARCHITECTURE,
    WEIGHTS_NAME,
    DrafterConfig,
    EagleDraftModel,
    count_parameters,
)
from training.convert import MODEL_PREFIX, CheckpointError, drafter_config_from, load_checkpoint

CARD_NAME = "README.md"
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
LIBRARY_NAME = "cascade-drafters"
RUN_CONFIG_NAME = "config.yaml"
TAU_TAGS = ("val/tau_sim",)
TAU_TAG_PREFIXES = ("decode/tau_",)
# Hub ids of the real targets (targets.md); the toy targets have none.
BASE_MODELS = {
    "janus-pro-7b": "deepseek-ai/Janus-Pro-7B",
    "llamagen-xl": "peizesun/llamagen_t2i",
    "lumina-mgpt-7b": "Alpha-VLLM/Lumina-mGPT-7B-768",
}
TRAINER_PREFIXES = (MODEL_PREFIX, "draft_model.", "module.", "_forward_module.", "drafter.")


class ExportError(ValueError):
    """The source cannot be exported as is (wrong weights, existing output, no token, failed upload)."""


# ----------------------------------------------------------------------------- the serving layout


def serving_weight_names(config: DrafterConfig) -> set[str]:
    """The exact weight names a serving engine reads for this drafter (peers.md §4.1, §4.2)."""
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


# ----------------------------------------------------------------------------- reading the source


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


# ----------------------------------------------------------------------------- the model card


@dataclass
class TauFigure:
    """An acceptance-length figure for the card: a metric's value, the step it was measured at, and where from."""

    name: str
    value: float
    step: int | None
    origin: str


@dataclass
class RunInfo:
    """What the run recorded about how the drafter was trained (every field optional)."""

    run_dir: Path | None = None
    run_config: dict[str, Any] = field(default_factory=dict)
    data_dir: Path | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    taus: list[TauFigure] = field(default_factory=list)


def find_run_dir(source: Path) -> Path | None:
    """The training run's directory: the checkpoint's parent's parent (a drafter folder's parent) with config.yaml."""
    source = source.resolve()
    for candidate in (source.parent.parent, source.parent):
        if (candidate / RUN_CONFIG_NAME).is_file():
            return candidate
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def _is_tau(name: str) -> bool:
    return name in TAU_TAGS or name.startswith(TAU_TAG_PREFIXES)


def checkpoint_taus(fields: dict[str, Any]) -> tuple[list[TauFigure], list[TauFigure]]:
    """τ values stored in the checkpoint: (its `callback_metrics`, if saved; ModelCheckpoint's monitored scores).

    A ModelCheckpoint saving every n training steps records the score of the validation *before* the
    save, so its score is only a fallback for runs without logs.
    """
    step = fields.get("global_step")
    metrics = []
    for name, value in (fields.get("callback_metrics") or {}).items():
        number = _as_float(value)
        if _is_tau(str(name)) and number is not None:
            metrics.append(TauFigure(str(name), number, step, "checkpoint callback_metrics"))
    scores = []
    for state in (fields.get("callbacks") or {}).values():
        if isinstance(state, dict) and _is_tau(str(state.get("monitor", ""))):
            number = _as_float(state.get("current_score"))
            if number is not None:
                scores.append(TauFigure(state["monitor"], number, None, "ModelCheckpoint's last monitored score"))
    return metrics, scores


def logged_taus(run_dir: Path, max_step: int | None) -> list[TauFigure]:
    """The last logged value (at or before `max_step`) of every τ tag in the run's TensorBoard logs."""
    if not any(run_dir.glob("events.out.tfevents.*")):
        return []
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        guidance = {"scalars": 0, "images": 1, "tensors": 1, "histograms": 1, "audio": 1, "compressedHistograms": 1}
        accumulator = EventAccumulator(str(run_dir), size_guidance=guidance)
        accumulator.Reload()
        tags = [tag for tag in accumulator.Tags()["scalars"] if _is_tau(tag)]
        events = {tag: accumulator.Scalars(tag) for tag in tags}
    except Exception as error:  # the card is still useful without the logs: say why they are missing
        print(f"warning: could not read the TensorBoard logs in {run_dir}: {error}", file=sys.stderr)
        return []
    figures = []
    for tag in sorted(events):
        usable = [event for event in events[tag] if max_step is None or event.step <= max_step]
        if not usable:
            continue
        first, last = usable[0], usable[-1]
        if tag in TAU_TAGS and first.step == 0 and last.step != 0:  # fit.py validates the untrained drafter first
            figures.append(TauFigure(tag, float(first.value), 0, "TensorBoard log, before training"))
        figures.append(TauFigure(tag, float(last.value), int(last.step), "TensorBoard log"))
    return figures


def _resolve_data_dir(train_dir: str, run_dir: Path) -> Path:
    """A data dir as recorded in config.yaml (relative to where training ran, usually the repository root)."""
    path = Path(train_dir)
    if path.is_absolute():
        return path
    for base in (Path.cwd(), run_dir.parent.parent, run_dir.parent, run_dir):
        if (base / path).exists():
            return base / path
    return path


def collect_run_info(source: DrafterSource, run_dir: Path | None = None) -> RunInfo:
    """Read the run's resolved config, its data manifest and τ figures, as far as they exist."""
    run_dir = run_dir if run_dir is not None else find_run_dir(source.path)
    metrics, scores = checkpoint_taus(source.fields)
    info = RunInfo(run_dir=run_dir, taus=metrics)
    if run_dir is not None:
        config_path = run_dir / RUN_CONFIG_NAME
        if config_path.is_file():
            info.run_config = yaml.safe_load(config_path.read_text()) or {}
        train_dir = (info.run_config.get("data") or {}).get("train_dir")
        if train_dir:
            info.data_dir = _resolve_data_dir(str(train_dir), run_dir)
            manifest = info.data_dir / "manifest.json"
            if manifest.is_file():
                info.manifest = json.loads(manifest.read_text())
        known = {figure.name for figure in metrics}
        info.taus += [figure for figure in logged_taus(run_dir, source.global_step) if figure.name not in known]
    known = {figure.name for figure in info.taus}
    info.taus += [figure for figure in scores if figure.name not in known]
    return info


def _settings(values: dict[str, Any] | None) -> str:
    if not values:
        return "not recorded"
    return ", ".join(f"`{key}={value}`" for key, value in values.items())


def _architecture_lines(config: DrafterConfig) -> list[str]:
    shape = (
        f"one decoder layer: hidden {config.hidden_size}, {config.num_heads} heads ({config.kv_heads} key/value heads, "
        f"head dim {config.head_dim}), SwiGLU FFN {config.intermediate_size}, RoPE θ {config.rope_theta:g}, "
        f"RMSNorm ε {config.rms_norm_eps:g}"
    )
    if config.architecture == "eagle3":
        vocab = (
            f"{config.draft_vocab} of the {config.vocab_size} image tokens (`d2t`/`t2d` map them)"
            if config.draft_vocab != config.vocab_size
            else f"all {config.vocab_size} image tokens"
        )
        return [
            f"- EAGLE-3 draft head, serving layout `{SERVING_ARCHITECTURE['eagle3']}` (vLLM / SGLang key names)",
            f"- `fc` fuses {config.num_aux_layers} target streams "
            f"({config.num_aux_layers} x {config.target_hidden_size}) into hidden size {config.hidden_size}",
            f"- {shape}",
            f"- own head (`norm`, `lm_head`) over a draft vocabulary of {vocab}",
        ]
    return [
        f"- EAGLE-1 draft head, serving layout `{SERVING_ARCHITECTURE['eagle1']}` (vLLM key names)",
        f"- `fc` maps [token embedding, target feature] (2 x {config.hidden_size}) to {config.hidden_size}"
        f" ({'with' if config.fc_bias else 'without'} bias); the layer has no input norm",
        f"- {shape}",
        "- logits come from the target's frozen image head, which is not part of this export",
    ]


def _data_lines(info: RunInfo) -> list[str]:
    data = info.run_config.get("data") or {}
    if not data and not info.manifest:
        return ["Not recorded (no `config.yaml` was found next to the checkpoint)."]
    lines = []
    if data.get("train_dir"):
        lines.append(
            f"- features: `{data['train_dir']}`"
            + (f" (batch size {data['batch_size']})" if "batch_size" in data else "")
        )
    manifest = info.manifest
    if not manifest:
        lines.append("- the data's `manifest.json` was not found, so prompts and sampling are not recorded here")
        return lines
    prompts, sampling = manifest.get("prompts") or {}, manifest.get("sampling") or {}
    count = prompts.get("num_prompts", prompts.get("count"))
    origin = prompts.get("path") or prompts.get("source")
    lines.append(
        f"- prompts: {count} from `{origin}`"
        + (f" (split `{prompts['split']}`, seed {prompts.get('seed')})" if prompts.get("split") else "")
    )
    lines.append(
        f"- {manifest.get('num_samples')} images of {manifest.get('num_tokens')} tokens sampled from the target"
        f" ({sampling.get('samples_per_prompt', 1)} per prompt): "
        + ", ".join(
            f"{key} {sampling[key]}"
            for key in ("cfg_scale", "temperature", "top_k", "top_p")
            if sampling.get(key) is not None
        )
    )
    target = manifest.get("target") or {}
    if target.get("aux_layer_ids"):
        lines.append(f"- target streams: hidden states of layers {target['aux_layer_ids']} (EAGLE-3 low/mid/high)")
    return lines


def _training_lines(source: DrafterSource, info: RunInfo) -> list[str]:
    hparams = source.fields.get("hyper_parameters") or {}
    model = info.run_config.get("model") or {}
    trainer = info.run_config.get("trainer") or {}
    objective = hparams.get("objective") or model.get("objective")
    optimizer = hparams.get("optimizer") or model.get("optimizer")
    lines = [f"- objective: {_settings(objective)}", f"- optimizer (AdamW): {_settings(optimizer)}"]
    if source.global_step is not None:
        lines.append(f"- checkpoint at step {source.global_step} (epoch {source.fields.get('epoch')})")
    if trainer:
        strategy = trainer.get("strategy")
        if isinstance(strategy, dict):
            strategy = strategy.get("class_path")
        keys = ("max_steps", "precision", "devices", "num_nodes", "accumulate_grad_batches", "gradient_clip_val")
        run = {key: trainer[key] for key in keys if trainer.get(key) is not None}
        lines.append(f"- trainer: {_settings({**run, 'strategy': strategy})}")
    return lines


def _tau_lines(info: RunInfo) -> list[str]:
    if not info.taus:
        return ["Not recorded: the run logged no `val/tau_sim` or `decode/tau_*` values next to this checkpoint."]
    lines = [
        "τ is the mean number of tokens per target forward (accepted drafts + the bonus token). `val/tau_sim` "
        "simulates a greedy chain draft on held-out features; `decode/tau_<rule>` comes from real tree decoding.",
        "",
        "| metric | value | step | from |",
        "|---|---|---|---|",
    ]
    for figure in info.taus:
        step = "" if figure.step is None else str(figure.step)
        lines.append(f"| `{figure.name}` | {figure.value:.3f} | {step} | {figure.origin} |")
    return lines


def render_model_card(
    model: EagleDraftModel,
    source: DrafterSource,
    info: RunInfo,
    *,
    repo_id: str | None,
    base_model: str | None,
    revision: str = "main",
) -> str:
    """README.md: YAML front matter (library_name, tags, license, base_model) and the card's body."""
    from huggingface_hub import ModelCardData

    config = model.config
    metadata = ModelCardData(
        library_name=LIBRARY_NAME,
        license="apache-2.0",
        base_model=base_model,
        tags=["speculative-decoding", "eagle", config.architecture, "drafter", "text-to-image", "safetensors"],
    )
    parameters = count_parameters(model)
    name = repo_id or "path/to/this/folder"
    revision_arg = f', revision="{revision}"' if repo_id and revision != "main" else ""
    target = training_target(source)
    title = f"{'EAGLE-3' if config.architecture == 'eagle3' else 'EAGLE-1'} drafter for `{target}`"
    body = [
        f"# {title}",
        "",
        "A speculative-decoding draft head for an autoregressive text-to-image model, trained with the "
        "cascade-drafters pipeline. It proposes image tokens that the target verifies, so the target runs "
        "fewer forwards per image; with exact verification the images are the target's own samples.",
        "",
        "## Target",
        "",
        f"- `{target}`" + (f" ([{base_model}](https://huggingface.co/{base_model}))" if base_model else ""),
        f"- image vocabulary {config.vocab_size}, target hidden size {config.target_hidden_size}",
        "- the target's embedding and image head are not included: load the target alongside",
        "",
        "## Architecture",
        "",
        *_architecture_lines(config),
        f"- parameters: {parameters:,} ({parameters / 1e6:.2f} M)",
        f"- files: `{WEIGHTS_NAME}` (drafter weights only), `{CONFIG_NAME}` (serving config plus `drafter_config`)",
        "",
        "## Training data",
        "",
        *_data_lines(info),
        "",
        "## Training",
        "",
        *_training_lines(source, info),
        "",
        "## Acceptance length",
        "",
        *_tau_lines(info),
        "",
        "## Usage",
        "",
        "With this repository's tree speculative decoder:",
        "",
        "```python",
        "from inference.eagle import EagleDrafter",
        "from inference.speculative import DecoderConfig, generate_speculative",
        "from inference.verify import ExactRule",
        "from models.registry import load_target",
        "",
        f'target = load_target("{target}")',
        f'drafter = EagleDrafter.from_pretrained("{name}", target{revision_arg})  # a Hub id or a local folder',
        'result = generate_speculative(target, drafter, ["a red circle on a blue background"], ExactRule(),',
        '                              DecoderConfig(tree="static"))',
        "print(result.tokens.shape, result.tau)  # image tokens, tokens per target forward",
        "```",
        "",
        "The key names follow the serving layouts of vLLM and SGLang, which do not serve image targets: that "
        "is format compatibility, not an end-to-end serving path.",
        "",
        "## License",
        "",
        "The drafter weights are released under Apache-2.0; the target model keeps its own license.",
        "",
    ]
    return f"---\n{metadata.to_yaml()}\n---\n\n" + "\n".join(body)


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
    source = read_source(ckpt)
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
