"""The manifest of a dataset folder: what it holds, read field by field with every field's type checked.

`manifest.json` (docs/architecture.md, section "Shards") names the schema version, the target the features come from
(`TargetIdentity`: hidden size, EAGLE-3 layer ids, image vocabulary, grid), the sampling settings
and prompt set, the array fields with their dtypes and widths, and every shard with its sample count,
sha256, size and first global sample index.

Reading checks each field where it is read and raises `ManifestError` naming the file and the field
(`target.hidden_size`, `shards[3].name`) with what was found and what was expected, so a damaged or
hand-edited manifest never surfaces as a bare KeyError or TypeError deep in training. Shard names
must be relative paths that stay inside the dataset folder. Checks that relate fields to each other
(widths against the target, counts, overlapping index ranges) are `Manifest.consistency_problems`,
which both `--validate` and the DataModule apply.

The image vocabulary size that bounds the stored token ids is `target.image_vocab_size`; it has been
part of the target identity since schema version 1, so every manifest carries it.

Schema version 2 adds `checkpoint` (`models.checkpoint_identity.CheckpointIdentity`: the path or hub id of
the target's weights, the hub revision, a fingerprint of its weight files), so a fit refuses features
extracted from other weights than the ones it loads (`Manifest.check_checkpoint`). Version 1 manifests (and
version 2 ones whose extraction could not tell, `checkpoint: null`) are still read: their checkpoint is
unknown, and a fit warns (`UnknownCheckpointWarning`) instead of checking, since re-extracting a terabyte
dataset only to record a field is worse than a named warning. `python -m data.extract --merge` on a folder
whose `.extract/job.json` has no checkpoint keeps it unknown.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from data.errors import ManifestError, ManifestNotFoundError
from models.checkpoint_identity import CheckpointIdentity

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions this code reads; 1 lacks `checkpoint` (read as unknown)."""
MANIFEST_NAME = "manifest.json"
FEATURE_FIELDS = ("tokens", "hidden", "aux", "uncond_hidden", "uncond_aux")
"""Array fields a sample may hold, in member order; `tokens` and `hidden` are always present."""
TOKEN_DTYPES = ("int16", "int32", "int64")
FLOAT_DTYPES = ("float16", "float32", "float8_e4m3fn")
"""float8_e4m3fn: uint8 codes plus a `<field>_scale` member of row scales (`data.fp8`), implied by the dtype."""
FEATURE_MODES = ("full", "tokens")
"""What a dataset's samples hold: `full` the target's states too, `tokens` only what a teacher-forced forward needs."""


def _fix(source: str) -> str:
    """How to repair a damaged manifest: merge rewrites it from the job file and per-shard sidecars of extraction."""
    path = Path(source)
    if path.name != MANIFEST_NAME:
        return "re-extract the dataset"
    return f"rewrite it with `python -m data.extract --merge {path.parent}` (needs its .extract/ folder) or re-extract"


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _kind(value: Any) -> str:
    """`'x' (a string)`: a value and its JSON type, for messages."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    kinds[dict] = "an object"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{shown} ({kinds.get(type(value), 'null' if value is None else type(value).__name__)})"


class UnknownCheckpointWarning(UserWarning):
    """A dataset's manifest does not say which weights its features came from, so a fit cannot check them."""


class _Fields:
    """Typed reads from one JSON object of a manifest, each failure naming the file and the field's path."""

    def __init__(self, values: Any, source: str, where: str) -> None:
        self.source, self.where = source, where
        if not isinstance(values, dict):
            raise self.error(f"{where or 'the top level'} is {_kind(values)}, expected a JSON object")
        self.values: dict[str, Any] = values

    def error(self, message: str) -> ManifestError:
        return ManifestError(f"{self.source}: {message}; {_fix(self.source)}")

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self.values:
            if default is not ...:
                return default
            raise self.error(f"lacks the field {self.path(key)!r}")
        return self.values[key]

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self.get(key)
        if type(value) is not int or value < minimum:
            raise self.error(f"field {self.path(key)!r} is {_kind(value)}, expected an integer >= {minimum}")
        return value

    def string(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise self.error(f"field {self.path(key)!r} is {_kind(value)}, expected a string")
        return value

    def optional_string(self, key: str) -> str | None:
        value = self.get(key, None)
        if value is not None and not isinstance(value, str):
            raise self.error(f"field {self.path(key)!r} is {_kind(value)}, expected a string or null")
        return value

    def obj(self, key: str) -> dict[str, Any]:
        value = self.get(key)
        if not isinstance(value, dict):
            raise self.error(f"field {self.path(key)!r} is {_kind(value)}, expected a JSON object")
        return value

    def integers(self, key: str, minimum: int = 0, length: int | None = None) -> tuple[int, ...]:
        value = self.get(key)
        ok = isinstance(value, list) and all(type(v) is int and v >= minimum for v in value)
        if not ok or (length is not None and len(value) != length):
            count = "a list" if length is None else f"a list of {length}"
            raise self.error(f"field {self.path(key)!r} is {_kind(value)}, expected {count} integers >= {minimum}")
        return tuple(value)

    def no_others(self, known: tuple[str, ...]) -> None:
        unknown = sorted(set(self.values) - set(known))
        if unknown:
            where = f"{self.where!r}" if self.where else "the manifest"
            raise self.error(
                f"{where} has unknown field(s) {unknown} (known: {', '.join(known)}); was it written by another "
                "version of data/extract.py?"
            )


@dataclass(frozen=True, kw_only=True)
class TargetIdentity:
    """What the features depend on: a dataset only fits a drafter trained for the same target."""

    name: str
    family: str
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]
    image_vocab_size: int
    """V: every stored token id lies in 0..V-1."""
    grid: tuple[int, int]
    prefix_length: int

    @classmethod
    def from_target(cls, target: Any) -> TargetIdentity:
        """The identity of an `ImageTarget`."""
        return cls(
            name=target.name,
            family=target.family,
            hidden_size=target.hidden_size,
            num_layers=target.num_layers,
            aux_layer_ids=tuple(target.aux_layer_ids),
            image_vocab_size=target.image_vocab_size,
            grid=tuple(target.geometry.grid),
            prefix_length=target.prefix_length,
        )

    @classmethod
    def from_dict(cls, values: Any, source: str = "manifest", where: str = "target") -> TargetIdentity:
        """Parse and type-check the manifest's `target` object (ManifestError naming `source` and the field)."""
        read = _Fields(values, source, where)
        read.no_others(tuple(cls.__dataclass_fields__))
        grid = read.integers("grid", minimum=1, length=2)
        return cls(
            name=read.string("name"),
            family=read.string("family"),
            hidden_size=read.integer("hidden_size", minimum=1),
            num_layers=read.integer("num_layers", minimum=1),
            aux_layer_ids=read.integers("aux_layer_ids"),
            image_vocab_size=read.integer("image_vocab_size", minimum=1),
            grid=(grid[0], grid[1]),
            prefix_length=read.integer("prefix_length"),
        )

    def mismatches(self, other: TargetIdentity) -> list[str]:
        """`field: self=..., other=...` for every field that differs."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


def checkpoint_from_dict(values: Any, source: str) -> CheckpointIdentity | None:
    """Parse the manifest's `checkpoint` object (null: unknown)."""
    if values is None:
        return None
    read = _Fields(values, source, "checkpoint")
    read.no_others(tuple(CheckpointIdentity.__dataclass_fields__))
    return CheckpointIdentity(
        source=read.string("source"),
        revision=read.optional_string("revision"),
        fingerprint=read.optional_string("fingerprint"),
    )


@dataclass(frozen=True)
class FieldSpec:
    """dtype and row width of one array field; `width` None means a 1-D (L,) array."""

    dtype: str
    width: int | None

    @classmethod
    def from_dict(cls, name: str, values: Any, source: str) -> FieldSpec:
        """Parse `fields.<name>`: tokens are 1-D integers, every other field (L, width) floats."""
        read = _Fields(values, source, f"fields.{name}")
        read.no_others(("dtype", "width"))
        dtype, width = read.string("dtype"), read.get("width")
        allowed = TOKEN_DTYPES if name == "tokens" else FLOAT_DTYPES
        if dtype not in allowed:
            raise read.error(f"field 'fields.{name}.dtype' is {dtype!r}, expected one of {', '.join(allowed)}")
        if name == "tokens" and width is not None:
            raise read.error(f"field 'fields.tokens.width' is {_kind(width)}, expected null (tokens are 1-D)")
        if name != "tokens":
            read.integer("width", minimum=1)
        return cls(dtype, width)


@dataclass(frozen=True)
class ShardInfo:
    """One finished shard."""

    name: str
    """Its path relative to the dataset folder (a plain file name, as extraction writes it)."""
    num_samples: int
    sha256: str
    num_bytes: int
    first_index: int
    """Global index of its first sample; its samples are first_index .. first_index + num_samples - 1."""

    @classmethod
    def from_dict(cls, values: Any, source: str, where: str = "shard") -> ShardInfo:
        """Parse one shard entry; its name must be a relative path that stays inside the dataset folder."""
        read = _Fields(values, source, where)
        read.no_others(tuple(cls.__dataclass_fields__))
        name = read.string("name")
        parts = PurePosixPath(name).parts
        if not parts or name.startswith("/") or "\\" in name or "\0" in name or ".." in parts or ":" in parts[0]:
            raise read.error(
                f"field '{where}.name' is {name!r}: shard paths must be relative and stay inside the dataset "
                "folder (move the shard into it and list it by its file name)"
            )
        sha256 = read.string("sha256")
        if not _SHA256.fullmatch(sha256):
            raise read.error(f"field '{where}.sha256' is {_kind(sha256)}, expected 64 lowercase hex digits")
        return cls(
            name=name,
            num_samples=read.integer("num_samples"),
            sha256=sha256,
            num_bytes=read.integer("num_bytes"),
            first_index=read.integer("first_index"),
        )


@dataclass(kw_only=True)
class Manifest:
    """Everything a reader needs to trust a dataset folder without opening its shards."""

    schema_version: int = SCHEMA_VERSION
    target: TargetIdentity
    sampling: dict[str, Any]
    """The sampling settings and seeding rule extraction used."""
    prompts: dict[str, Any]
    """The prompt set's description (source, path, split, count, ...)."""
    features: str = "full"
    """FEATURE_MODES: `tokens` datasets hold only `tokens` (train them with data.features: online);
    manifests written before the field existed are `full`."""
    fields: dict[str, FieldSpec]
    num_tokens: int
    """G, the image tokens per image; a sample's length L never exceeds it."""
    samples_per_shard: int
    num_samples: int
    shards: list[ShardInfo] = field(default_factory=list)
    checkpoint: CheckpointIdentity | None = None
    """The target's weights the features came from (`models.checkpoint_identity`); None: unknown."""

    def to_json(self) -> str:
        values = asdict(self)
        if self.schema_version < 2:  # a version 1 job file being finished: it has no checkpoint field
            del values["checkpoint"]
        return json.dumps(values, indent=1)

    @classmethod
    def from_dict(cls, values: Any, source: str = "manifest") -> Manifest:
        """Parse and type-check a whole manifest; ManifestError names `source` and the first bad field."""
        read = _Fields(values, source, "")
        version = read.get("schema_version", None)
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise ManifestError(
                f"{source}: schema_version {version!r} is not one of {READABLE_VERSIONS}; re-extract the "
                "dataset with this version of data/extract.py"
            )
        top_level = tuple(cls.__dataclass_fields__)
        read.no_others(top_level if version >= 2 else tuple(k for k in top_level if k != "checkpoint"))
        fields = {}
        for name, spec in read.obj("fields").items():
            if name not in FEATURE_FIELDS:
                known = ", ".join(FEATURE_FIELDS)
                raise read.error(f"'fields' lists the unknown field {name!r} (known fields: {known})")
            fields[name] = FieldSpec.from_dict(name, spec, source)
        features = read.get("features", "full")
        if features not in FEATURE_MODES:
            raise read.error(f"field 'features' is {_kind(features)}, expected one of {', '.join(FEATURE_MODES)}")
        for name in ("tokens", "hidden") if features == "full" else ("tokens",):
            if name not in fields:
                raise read.error(f"'fields' lacks the required field {name!r}")
        if features == "tokens" and set(fields) != {"tokens"}:
            extra = sorted(set(fields) - {"tokens"})
            raise read.error(f"'features' is 'tokens', but 'fields' also lists {extra}; token-only sets hold tokens")
        shards = read.get("shards", [])
        if not isinstance(shards, list):
            raise read.error(f"field 'shards' is {_kind(shards)}, expected a list")
        infos = [ShardInfo.from_dict(entry, source, f"shards[{i}]") for i, entry in enumerate(shards)]
        names = [info.name for info in infos]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise read.error(f"'shards' lists {twice} more than once")
        return cls(
            schema_version=version,
            target=TargetIdentity.from_dict(read.get("target"), source),
            sampling=read.obj("sampling"),
            prompts=read.obj("prompts"),
            features=features,
            fields=fields,
            num_tokens=read.integer("num_tokens", minimum=1),
            samples_per_shard=read.integer("samples_per_shard", minimum=1),
            num_samples=read.integer("num_samples"),
            shards=infos,
            checkpoint=checkpoint_from_dict(read.get("checkpoint", None), source),
        )

    def consistency_problems(self, source: str) -> list[str]:
        """What contradicts itself: field widths against the target, shard counts, overlapping sample ranges."""
        widths, problems = field_widths(self.target), []
        for name, spec in self.fields.items():
            if spec.width != widths[name]:
                problems.append(f"{source}: field {name!r} has width {spec.width}, its target needs {widths[name]}")
        rows, cols = self.target.grid
        if self.num_tokens != rows * cols:
            problems.append(
                f"{source}: num_tokens is {self.num_tokens}, the target's grid {rows} x {cols} has {rows * cols}"
            )
        for shard in self.shards:  # fewer is allowed: datasets merged or filtered by other tools have uneven shards
            if shard.num_samples > self.samples_per_shard:
                problems.append(
                    f"{source}: shard {shard.name} holds {shard.num_samples} samples, more than samples_per_shard "
                    f"{self.samples_per_shard}"
                )
        num_prompts, per_prompt = self.prompts.get("num_prompts"), self.sampling.get("samples_per_prompt")
        if type(num_prompts) is int and type(per_prompt) is int and num_prompts * per_prompt != self.num_samples:
            problems.append(
                f"{source}: the recipe gives prompts.num_prompts {num_prompts} x sampling.samples_per_prompt "
                f"{per_prompt} = {num_prompts * per_prompt} samples, num_samples says {self.num_samples}"
            )
        total = sum(s.num_samples for s in self.shards)
        if total != self.num_samples:
            problems.append(f"{source}: shard counts sum to {total}, num_samples says {self.num_samples}")
        spans = sorted((s.first_index, s.first_index + s.num_samples, s.name) for s in self.shards if s.num_samples)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                problems.append(
                    f"{source}: shards {first} and {second} both claim sample {start} (their first_index and "
                    "num_samples overlap), so sample keys would repeat"
                )
        return problems

    def check_consistent(self, source: str) -> None:
        """Raise ManifestError listing `consistency_problems`, if any."""
        problems = self.consistency_problems(source)
        if problems:
            raise ManifestError("; ".join(problems) + f"; {_fix(source)}")

    def check_target(self, expected: TargetIdentity, source: str = "manifest") -> None:
        """Raise if the dataset was extracted from another target than `expected`."""
        problems = self.target.mismatches(expected)
        if problems:
            raise ManifestError(
                f"{source} was extracted from a different target than the one configured "
                f"(manifest vs configured): {'; '.join(problems)}. Extract features for this "
                "target, or configure the target the dataset was made with"
            )

    def check_checkpoint(self, configured: CheckpointIdentity, source: str = "manifest") -> None:
        """Raise ManifestError if the dataset's features came from other weights than `configured`.

        A manifest that does not record its checkpoint (schema 1, or `checkpoint: null`) passes with an
        `UnknownCheckpointWarning` naming the file and the configured checkpoint.
        """
        if self.checkpoint is None:
            warnings.warn(
                f"{source} does not record the target checkpoint its features came from (schema_version "
                f"{self.schema_version}); training against {configured.describe()} unchecked. Re-extract with "
                "this version of data/extract.py to record it",
                UnknownCheckpointWarning,
                stacklevel=2,
            )
            return
        reason = self.checkpoint.mismatch(configured)
        if reason is not None:
            raise ManifestError(
                f"{source} was extracted from the checkpoint {self.checkpoint.describe()}, but the config loads "
                f"{configured.describe()}: {reason}. Point the config at the weights the dataset was extracted "
                "with (model.target_options, or the JANUS_PRO_PATH / LUMINA_MGPT_PATH / LLAMAGEN_DIR variable the "
                "config's comment names), or re-extract the dataset from the configured weights"
            )


def field_widths(target: TargetIdentity) -> dict[str, int | None]:
    """The row width of every field of FEATURE_FIELDS for a target (None: a 1-D field)."""
    hidden, aux = target.hidden_size, len(target.aux_layer_ids) * target.hidden_size
    return {"tokens": None, "hidden": hidden, "aux": aux, "uncond_hidden": hidden, "uncond_aux": aux}


class _DuplicateKeyError(ValueError):
    """A JSON object names a key twice (json.loads would keep the last value silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise _DuplicateKeyError(f"names the key(s) {twice} twice in one object (JSON keeps only the last)")
    return dict(pairs)


def load_manifest(folder: str | Path) -> Manifest:
    """The manifest of a dataset folder, every field type-checked (ManifestError naming the file otherwise)."""
    path = Path(folder) / MANIFEST_NAME
    if not path.exists():
        raise ManifestNotFoundError(
            f"{path} does not exist: extraction has not finished (run `python -m data.extract "
            f"--merge {folder}` once every rank is done) or the folder is not a dataset"
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ManifestError(f"{path}: cannot be read ({error.strerror or error}); it must be a readable file") from None
    if data[:2] == b"\x1f\x8b":
        raise ManifestError(f"{path}: is gzip-compressed; store it as plain JSON (gunzip it)")
    try:
        values = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as error:
        raise ManifestError(f"{path}: {error}; {_fix(str(path))}") from None
    except UnicodeDecodeError as error:
        raise ManifestError(f"{path}: is not UTF-8 text (byte {error.start}); {_fix(str(path))}") from None
    except json.JSONDecodeError as error:
        raise ManifestError(f"{path}: is not valid JSON: {error}; {_fix(str(path))}") from None
    return Manifest.from_dict(values, source=str(path))
