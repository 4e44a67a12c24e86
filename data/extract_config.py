"""The extraction recipe: `ExtractConfig`, read from YAML with `key=value` or `--key value` overrides.

    config = load_config("configs/extract_toy.yaml", ["prompts.count=16", "batch_size=8"])

Defaults < the YAML file < overrides; an unknown key anywhere is an error that names it and lists the
known ones. `split_dotted_flags` turns LightningCLI-style flags (`--prompts.count 16`) into overrides.
`data.extract` runs a recipe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data.prompts import PromptSetConfig
from models.target import ImageTarget, SamplingDefaults

FEATURE_DTYPES = ("float16", "float32", "float8_e4m3fn")
FEATURE_MODES = ("full", "tokens")


@dataclass(kw_only=True)
class ExtractConfig:
    """One extraction job."""

    target: str = "toy"
    """Target name for `models.registry.load_target`."""
    target_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the target's loader, e.g. {path: /models/Janus-Pro-7B, dtype: bfloat16} for
    janus-pro-7b (see `load_target`); each rank loads its replica on its own GPU."""
    out_dir: str
    """Dataset folder: shards, manifest.json and the .extract/ work folder."""
    prompts: PromptSetConfig = field(default_factory=lambda: PromptSetConfig(source="toy", count=256))
    """The prompt set."""
    samples_per_prompt: int = 1
    """Images generated per prompt."""
    samples_per_shard: int = 64
    """Samples per shard (the last shard may hold fewer)."""
    batch_size: int = 16
    """Prompts per generate_ar call; part of the seeding rule, so changing it changes the samples."""
    seed: int = 0
    """Base seed; each batch's generator is seeded by derive_seed(seed, first sample index)."""
    features: str = "full"
    """full: the image tokens and the target's states (hidden, and store_aux / store_uncond's streams);
    tokens: only what a teacher-forced forward needs (image tokens, prompt, sampling record), for training
    with `data.features: online`, which recomputes the states in the training step (a few KB per sample)."""
    store_aux: bool = True
    """Record the EAGLE-3 auxiliary streams (L, 3D)."""
    store_uncond: bool = False
    """Record the unconditional row's features (L, D), and with store_aux its auxiliary streams (L, 3D); needs CFG."""
    feature_dtype: str = "float16"
    """float16, float32 (numpy's .npy has no bfloat16) or float8_e4m3fn (uint8 codes with a float32 scale per
    row, read back as float16: `data.fp8`)."""
    cfg_scale: float | None = None
    """Sampling overrides; None keeps the target's default."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    num_threads: int | None = None
    """torch CPU threads; None leaves torch's default."""

    def __post_init__(self) -> None:
        for name in ("samples_per_prompt", "samples_per_shard", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.features not in FEATURE_MODES:
            raise ValueError(f"features={self.features!r}; use one of {', '.join(FEATURE_MODES)} (--features tokens)")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature_dtype={self.feature_dtype!r}; use one of {', '.join(FEATURE_DTYPES)}")

    def sampling_settings(self, target: ImageTarget) -> SamplingDefaults:
        overrides = {k: getattr(self, k) for k in ("cfg_scale", "temperature", "top_k", "top_p")}
        return dataclasses.replace(target.sampling, **{k: v for k, v in overrides.items() if v is not None})


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExtractConfig:
    """Defaults < YAML file < `key=value` overrides (`prompts.count=8`); unknown keys are errors."""
    values: dict[str, Any] = {}
    if path is not None:
        values = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    for item in overrides:
        key, equals, text = item.partition("=")
        if not equals:
            raise ValueError(f"override {item!r} is not key=value (e.g. batch_size=8 or prompts.count=16)")
        *parents, leaf = key.split(".")
        node = values
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = yaml.safe_load(text)
    prompts = values.pop("prompts", None)
    _check_keys(ExtractConfig, values, str(path or "config"))
    if prompts is not None:
        _check_keys(PromptSetConfig, prompts, f"{path or 'config'}: prompts")
        values["prompts"] = PromptSetConfig(**prompts)
    if "out_dir" not in values:
        raise ValueError(f"{path or 'config'}: out_dir is required (the dataset folder to write)")
    return ExtractConfig(**values)


def _check_keys(cls: type, values: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")


def split_dotted_flags(argv: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Separate config flags in LightningCLI's style (`--prompts.count 16`, `--batch_size=8`) from the CLI's own.

    Returns (the CLI's arguments, `key=value` overrides); a config flag without a value is an error.
    """
    rest, overrides, index = [], [], 0
    while index < len(argv):
        token = argv[index]
        key, equals, value = token[2:].partition("=")
        if not token.startswith("--") or token == "--" or token.partition("=")[0] in known:
            rest.append(token)
        elif equals:
            overrides.append(f"{key}={value}")
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            overrides.append(f"{key}={argv[index + 1]}")
            index += 1
        else:
            raise ValueError(f"{token} needs a value (e.g. {token} 16)")
        index += 1
    return rest, overrides


def resolve_config_path(name: str | Path) -> Path:
    """A config file path, or a bare name looked up in the repository's `configs/` (`demo` -> configs/demo.yaml)."""
    path = Path(name)
    if path.is_file():
        return path
    configs = Path(__file__).resolve().parent.parent / "configs"
    for candidate in (configs / path, configs / f"{path}.yaml", configs / f"{path}.yml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in configs.glob("*.yaml"))
    raise FileNotFoundError(f"config {str(name)!r} is neither a file nor a name in {configs}; known names: {known}")
