"""Prompt sets: the files shipped in `data/prompts/`, the embedded worlds' caption splits, and Hub datasets.

    prompts = load_prompts(PromptSetConfig(source="parti"))                 # 1632 PartiPrompts
    prompts = load_prompts(PromptSetConfig(source="toy", count=256, split="train", seed=0))
    prompts = load_prompts(PromptSetConfig(source="texture", count=256, split="heldout", seed=11))
    prompts = load_prompts(PromptSetConfig(source="file", path="my_prompts.jsonl", column="caption"))
    prompts = load_prompts(PromptSetConfig(source="hf", path="nateraw/parti-prompts", column="Prompt"))

Every prompt carries a stable id (`parti:17`, `coco:4999`, `toy-train-s0:3`, `texture-heldout-s11:3`, ...)
that extraction records next to the text, so a sample can always be traced back to its prompt. Licences and
provenance of the shipped files are in `data/prompts/NOTICE.md`.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from models.worlds import EMBEDDED_WORLDS, embedded_world

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
BUILTIN_FILES: dict[str, tuple[str, str | None]] = {
    "parti": ("PartiPrompts.tsv", "Prompt"),
    "coco": ("coco2017_val_captions_longest.txt", None),
}
"""Named prompt sets shipped with the repository: name -> (file in data/prompts/, column)."""
WORLD_SOURCES = tuple(EMBEDDED_WORLDS)
"""Sources drawn from an embedded world's caption grammar (`models.worlds`): toy, texture."""
SOURCES = ("parti", "coco", *WORLD_SOURCES, "file", "hf")


@dataclass(frozen=True)
class Prompt:
    """One prompt and where it came from."""

    id: str
    text: str


@dataclass(kw_only=True)
class PromptSetConfig:
    """Which prompts to run the target on."""

    source: str = "toy"
    """One of parti, coco (shipped files), toy, texture (an embedded world's caption grammar), file (a
    .tsv/.txt/.jsonl) or hf (a Hub dataset)."""
    path: str | None = None
    """source=file: the file; source=hf: the dataset name."""
    column: str | None = None
    """TSV column or JSONL field holding the prompt (default: Prompt / caption_longest / text / prompt)."""
    split: str = "train"
    """source=toy/texture: train, heldout or any caption split; source=hf: the dataset split."""
    count: int | None = None
    """source=toy/texture: how many captions to draw (required); otherwise keep only the first `count` prompts."""
    seed: int = 0
    """source=toy/texture: the scene sampler's seed."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"prompts.source={self.source!r} is unknown; use one of {', '.join(SOURCES)}")
        if self.source in ("file", "hf") and not self.path:
            raise ValueError(f"prompts.source={self.source} needs prompts.path (a file, or a Hub dataset name)")
        if self.source in WORLD_SOURCES and self.count is None:
            raise ValueError(f"prompts.source={self.source} needs prompts.count, the number of captions to draw")
        if self.count is not None and self.count < 1:
            raise ValueError(f"prompts.count must be >= 1, got {self.count}")

    def describe(self) -> dict[str, object]:
        """What the manifest records about the prompt set."""
        return asdict(self)


def read_prompt_file(path: str | Path, column: str | None = None, prefix: str | None = None) -> list[Prompt]:
    """Prompts of a .tsv (header row; `column`, default `Prompt`), .txt (one per line) or .jsonl file.

    Ids are `<prefix>:<row>` with rows counted from 0 over non-empty prompts; JSONL rows with an
    `index` field use it instead, so ids follow the source's own numbering.
    """
    path = Path(path)
    prefix = prefix or path.stem
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".tsv":
        with path.open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        field = column or "Prompt"
        if rows and field not in rows[0]:
            raise ValueError(f"{path}: no column {field!r}; columns are {list(rows[0])}; set prompts.column")
        pairs = [(str(i), row[field]) for i, row in enumerate(rows)]
    elif suffix == ".txt":
        pairs = [(str(i), line) for i, line in enumerate(path.read_text(encoding="utf-8").splitlines())]
    elif suffix == ".jsonl":
        pairs = _read_jsonl(path, column)
    else:
        raise ValueError(f"{path}: unknown prompt file type {suffix!r}; use .tsv, .txt or .jsonl")
    prompts = [Prompt(f"{prefix}:{key}", text.strip()) for key, text in pairs if text and text.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _read_jsonl(path: Path, column: str | None) -> list[tuple[str, str]]:
    pairs = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        record = json.loads(line)
        field = column or next((f for f in ("caption_longest", "text", "prompt") if f in record), None)
        if field is None or field not in record:
            raise ValueError(f"{path}:{line_number + 1}: no field {column or 'text/prompt'!r}; set prompts.column")
        pairs.append((str(record.get("index", line_number)), str(record[field])))
    return pairs


def world_prompts(world: str, count: int, seed: int = 0, split: str = "train") -> list[Prompt]:
    """`count` captions of the embedded world `world`'s `split` (toy, texture), from its deterministic scene
    sampler (`models.worlds.EmbeddedWorld.captions`); ids `<world>-<split>-s<seed>:<i>`."""
    found = embedded_world(world)
    if found is None:
        raise ValueError(f"{world!r} is not an embedded world; known: {', '.join(WORLD_SOURCES)}")
    return [Prompt(f"{world}-{split}-s{seed}:{i}", text) for i, text in enumerate(found.captions(count, seed, split))]


def toy_prompts(count: int, seed: int = 0, split: str = "train") -> list[Prompt]:
    """`count` captions of the toy world's `split`, from its deterministic scene sampler (`models.toy.toy_captions`)."""
    return world_prompts("toy", count, seed, split)


def hub_prompts(name: str, split: str = "train", column: str | None = None) -> list[Prompt]:
    """Prompts of a Hugging Face dataset (needs the network or a local Hub cache)."""
    import datasets  # imported here: only this source needs it

    try:
        table = datasets.load_dataset(name, split=split)
    except Exception as error:  # offline, unknown name, ...: say which and how to avoid it
        raise ValueError(
            f"could not load the Hub dataset {name!r} (split {split!r}): {error}. Offline, use a shipped "
            "set (prompts.source=parti or coco) or a local file (prompts.source=file)"
        ) from error
    field = column or next((c for c in ("Prompt", "prompt", "text", "caption") if c in table.column_names), None)
    if field is None or field not in table.column_names:
        raise ValueError(f"Hub dataset {name!r} has no column {column!r}; columns: {table.column_names}")
    return [Prompt(f"{name}:{i}", str(text).strip()) for i, text in enumerate(table[field]) if str(text).strip()]


def load_prompts(config: PromptSetConfig) -> list[Prompt]:
    """The prompt list `config` describes, in a fixed order (extraction indexes samples by it)."""
    if config.source in WORLD_SOURCES:
        assert config.count is not None  # checked in __post_init__
        return world_prompts(config.source, config.count, config.seed, config.split)
    if config.source in BUILTIN_FILES:
        file, column = BUILTIN_FILES[config.source]
        prompts = read_prompt_file(PROMPT_DIR / file, config.column or column, prefix=config.source)
    elif config.source == "file":
        prompts = read_prompt_file(str(config.path), config.column)
    else:
        prompts = hub_prompts(str(config.path), config.split, config.column)
    return prompts[: config.count] if config.count is not None else prompts
