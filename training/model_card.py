"""The model card of an exported drafter: architecture, data, training recipe and the tau figures of its run."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from torch import Tensor

from models.eagle import (
    CONFIG_NAME,
    SERVING_ARCHITECTURE,
    WEIGHTS_NAME,
    DrafterConfig,
    EagleDraftModel,
    count_parameters,
)
from training.checkpoints import DrafterSource, training_target

LIBRARY_NAME = "cascade-drafters"
RUN_CONFIG_NAME = "config.yaml"
TAU_TAGS = ("val/tau_sim",)
TAU_TAG_PREFIXES = ("decode/tau_",)


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


def logged_scalars(run_dir: Path) -> dict[str, list[Any]]:
    """Every scalar the run logged, by tag, in the order it was written (TensorBoard `ScalarEvent`s).

    A fit writes one event file per phase (the validation before training, then the fit). TensorBoard's
    directory reader takes the files in name order, and the names end in a per-process writer counter
    (`...<pid>.9` sorts after `...<pid>.10`), so each file is read on its own and the events are put back in
    the order of their wall times.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    guidance = {"scalars": 0, "images": 1, "tensors": 1, "histograms": 1, "audio": 1, "compressedHistograms": 1}
    scalars: dict[str, list[Any]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance=guidance)
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(accumulator.Scalars(tag))
    return {tag: sorted(values, key=lambda event: event.wall_time) for tag, values in scalars.items()}


def logged_taus(run_dir: Path, max_step: int | None) -> list[TauFigure]:
    """The last logged value (at or before `max_step`) of every τ tag in the run's TensorBoard logs."""
    if not any(run_dir.glob("events.out.tfevents.*")):
        return []
    try:
        events = {tag: values for tag, values in logged_scalars(run_dir).items() if _is_tau(tag)}
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


def _weights_dtype(model: EagleDraftModel) -> str:
    """The dtype(s) of the exported floating-point weights, e.g. "float32" (the vocabulary maps are integer ids)."""
    floats = [p for p in model.state_dict().values() if p.is_floating_point()]
    return ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in floats}))


def _weights_origin(source: DrafterSource) -> str:
    """Where the exported weights come from, in words."""
    if source.kind == "deepspeed checkpoint":
        return "the optimizer's float32 master weights, consolidated from the DeepSpeed ZeRO partitions"
    if source.kind == "lightning checkpoint":
        return "the checkpoint's module weights"
    return "copied from a drafter folder"


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
        f"- weights: {_weights_dtype(model)} ({_weights_origin(source)})",
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
        "from inference.decoding.eagle import EagleDrafter",
        "from inference.decoding.speculative import DecoderConfig, generate_speculative",
        "from inference.decoding.verify import ExactRule",
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
