"""The shard format: schema, manifest and writer of extracted features (reading and validation: `data.shard_reader`).

A dataset is a folder holding `manifest.json` and `shard-NNNNNN.tar` files (see design.md,
"Shards"). Each shard is a WebDataset tar written with `webdataset.TarWriter`; a sample is one key
(its global sample index, `000000042`) with these members:

    000000042.tokens.npy          (L,) int16/int32   generated image tokens
    000000042.hidden.npy          (L, D) fp16        conditional last-layer post-norm features
    000000042.aux.npy             (L, 3D) fp16       optional EAGLE-3 low, mid, high residual streams
    000000042.uncond_hidden.npy   (L, D) fp16        optional unconditional-row features
    000000042.uncond_aux.npy      (L, 3D) fp16       optional unconditional-row EAGLE-3 streams
    000000042.json                                   index, prompt_id, prompt, seed, length

`uncond_aux` is written when both the auxiliary streams and the unconditional features are
requested; datasets without it (or without any optional field) stay readable, since readers take the
fields the manifest lists.

Row j of every feature is the state at the position whose logits give image token j (in the
unconditional CFG row for the `uncond_` fields), so the frozen head recomputes token j's logits from
row j; no logits are stored.

Why raw `.npy` and not safetensors or pickle: a `.npy` member is a short header plus the raw array
bytes, so `decode_npy` returns an `np.frombuffer` view of the bytes read from the tar, with no copy
and no unpickling (safe and fastest, ecosystem.md section 3); any tool that reads WebDataset (or
`numpy.load`) reads it too, and one array per member keeps a sample's fields independently
selectable. safetensors would add a JSON header per sample for the same zero-copy view.

Reading uses a small ustar reader (`data.shard_reader.iter_tar_members`) instead of tarfile's stream
mode (why: that module's docstring).

Shapes: L tokens of a sample (G, the image's token count, for every sample of the toy target),
D hidden size.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
FEATURE_FIELDS = ("tokens", "hidden", "aux", "uncond_hidden", "uncond_aux")
"""Array fields a sample may hold, in member order; `tokens` and `hidden` are always present."""
BLOCK = 512


class ShardError(ValueError):
    """A shard that cannot be read: corrupt, truncated, or not what the manifest says."""


class SampleError(ShardError):
    """One sample of an otherwise readable shard is malformed (missing member, wrong dtype or shape)."""


def shard_name(index: int) -> str:
    """File name of shard `index`: `shard-000007.tar`."""
    return f"shard-{index:06d}.tar"


def sample_key(index: int) -> str:
    """WebDataset key of global sample `index`: `000000042`."""
    return f"{index:09d}"


def write_atomic(path: Path, text: str) -> None:
    """Write a text file under a temporary name, then rename it into place (readers never see half a file)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- .npy members


def encode_npy(array: np.ndarray) -> bytes:
    """An array as `.npy` bytes (C order, no pickle)."""
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def decode_npy(data: bytes | memoryview) -> np.ndarray:
    """A read-only array viewing the bytes of a `.npy` member (zero-copy; no pickle)."""
    head = io.BytesIO(bytes(data[:BLOCK]) if len(data) > BLOCK else bytes(data))
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(head)
    else:
        head = io.BytesIO(bytes(data[: 1 << 16]))
        np.lib.format.read_magic(head)
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(head)
    if dtype.hasobject:
        raise ValueError("object arrays are not allowed in shards (they would need pickle)")
    count = int(np.prod(shape, dtype=np.int64))
    if head.tell() + count * dtype.itemsize != len(data):
        raise ValueError(
            f"npy member holds {len(data) - head.tell()} data bytes, shape {shape} needs {count * dtype.itemsize}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=head.tell())
    return array.reshape(shape[::-1]).T if fortran_order else array.reshape(shape)


# ----------------------------------------------------------------------------- manifest


@dataclass(frozen=True, kw_only=True)
class TargetIdentity:
    """What the features depend on: a dataset only fits a drafter trained for the same target."""

    name: str
    family: str
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]
    image_vocab_size: int
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
    def from_dict(cls, values: dict[str, Any]) -> TargetIdentity:
        values = dict(values, aux_layer_ids=tuple(values["aux_layer_ids"]), grid=tuple(values["grid"]))
        return cls(**values)

    def mismatches(self, other: TargetIdentity) -> list[str]:
        """`field: self=..., other=...` for every field that differs."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass(frozen=True)
class FieldSpec:
    """dtype and row width of one array field; `width` None means a 1-D (L,) array."""

    dtype: str
    width: int | None


@dataclass(frozen=True)
class ShardInfo:
    """One finished shard."""

    name: str
    num_samples: int
    sha256: str
    num_bytes: int
    first_index: int
    """Global index of its first sample; its samples are first_index .. first_index + num_samples - 1."""


@dataclass(kw_only=True)
class Manifest:
    """Everything a reader needs to trust a dataset folder without opening its shards."""

    schema_version: int = SCHEMA_VERSION
    target: TargetIdentity
    sampling: dict[str, Any]
    """The sampling settings and seeding rule extraction used."""
    prompts: dict[str, Any]
    """The prompt set's description (source, path, split, count, ...)."""
    fields: dict[str, FieldSpec]
    num_tokens: int
    """G, the image tokens per image; a sample's length L never exceeds it."""
    samples_per_shard: int
    num_samples: int
    shards: list[ShardInfo] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "manifest") -> Manifest:
        version = values.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"{source}: schema_version {version!r} is not {SCHEMA_VERSION}; re-extract the "
                "dataset with this version of data/extract.py"
            )
        return cls(
            schema_version=version,
            target=TargetIdentity.from_dict(values["target"]),
            sampling=values["sampling"],
            prompts=values["prompts"],
            fields={k: FieldSpec(**v) for k, v in values["fields"].items()},
            num_tokens=values["num_tokens"],
            samples_per_shard=values["samples_per_shard"],
            num_samples=values["num_samples"],
            shards=[ShardInfo(**s) for s in values.get("shards", [])],
        )

    def check_target(self, expected: TargetIdentity, source: str = "manifest") -> None:
        """Raise if the dataset was extracted from another target than `expected`."""
        problems = self.target.mismatches(expected)
        if problems:
            raise ValueError(
                f"{source} was extracted from a different target than the one configured "
                f"(manifest vs configured): {'; '.join(problems)}. Extract features for this "
                "target, or configure the target the dataset was made with"
            )


def load_manifest(folder: str | Path) -> Manifest:
    """The manifest of a dataset folder."""
    path = Path(folder) / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: extraction has not finished (run `python -m data.extract "
            f"--merge {folder}` once every rank is done) or the folder is not a dataset"
        )
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    return Manifest.from_dict(values, source=str(path))


# ----------------------------------------------------------------------------- writing


class _HashingFile:
    """A write-only file wrapper that hashes and counts what goes through it."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self.file, self.sha256, self.num_bytes = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.num_bytes += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class ShardWriter:
    """Writes one shard to `<name>.partial`; `commit` renames it into place.

    Tar headers carry mtime 0, so the same samples always give the same bytes and sha256.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self.partial, "wb")  # truncates a partial file left by a killed run
        self._hashing = _HashingFile(self._file)
        self._tar = wds.TarWriter(self._hashing, encoder=False, mtime=0)
        self.num_samples = 0

    def write(self, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Add one sample: `arrays` maps field names (FEATURE_FIELDS) to arrays, `meta` goes to its json."""
        members: dict[str, Any] = {"__key__": key, "json": json.dumps(meta).encode()}
        members.update({f"{name}.npy": encode_npy(array) for name, array in arrays.items()})
        self._tar.write(members)
        self.num_samples += 1

    def commit(self, first_index: int) -> ShardInfo:
        """Finish the tar, flush it to disk and rename it to its final name."""
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return ShardInfo(
            self.path.name, self.num_samples, self._hashing.sha256.hexdigest(), self._hashing.num_bytes, first_index
        )

    @property
    def num_bytes(self) -> int:
        """Bytes written so far."""
        return self._hashing.num_bytes

    def close(self) -> None:
        """Stop without committing; the .partial file stays (the next writer of this shard truncates it)."""
        self._file.close()
