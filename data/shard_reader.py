"""Reading and validating shards: a small ustar reader, samples as raw members, decoded and checked samples.

Reading uses a small ustar reader (`iter_tar_members`) instead of tarfile's stream mode: it reads
each member with one `read` (tarfile copies it three times in 10 KB pieces), checks header
checksums, and reports truncation with the shard name and byte offset. The format itself (manifest,
fields, writer) is `data.shards`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.shards import (
    BLOCK,
    FEATURE_FIELDS,
    MANIFEST_NAME,
    FieldSpec,
    Manifest,
    SampleError,
    ShardError,
    ShardInfo,
    TargetIdentity,
    decode_npy,
    load_manifest,
)

_ZERO_BLOCK = bytes(BLOCK)  # two of them end a tar


class BufferPool:
    """Recycled buffers for large tar members.

    Reading a 5-15 MB member into a fresh `bytes` makes the kernel map and zero new pages (one page
    fault per 4 KB), which costs more than the copy itself; memory that is recycled is already
    mapped. The reader takes a buffer per large member, and whoever consumed the sample (the
    collate step) gives it back; nothing may keep a view of a buffer after giving it back.
    """

    def __init__(self, min_size: int = 1 << 20) -> None:
        self.min_size = min_size
        """Members smaller than this are read into plain bytes."""
        self.free: list[bytearray] = []
        self.owned: list[bytearray] = []
        """Batch buffers handed out by `take_unused`, reusable once no tensor refers to them."""

    def take(self, size: int) -> bytearray:
        """A buffer of at least `size` bytes: the smallest free one that fits, else a new one."""
        fits = [i for i, buffer in enumerate(self.free) if len(buffer) >= size]
        if not fits:
            return bytearray(size)
        return self.free.pop(min(fits, key=lambda i: len(self.free[i])))

    def give(self, buffers: list[bytearray]) -> None:
        self.free.extend(buffers)

    def take_unused(self, size: int, max_owned: int = 16) -> bytearray:
        """A buffer of `size` or more bytes that no tensor refers to any more, for a batch.

        A tensor made by `torch.frombuffer` holds a reference to its buffer until the tensor and all
        its views are gone, so a buffer whose only reference is this pool is free to reuse.
        """
        for buffer in self.owned:
            if len(buffer) >= size and sys.getrefcount(buffer) <= 3:  # self.owned, `buffer`, the call's argument
                return buffer
        buffer = bytearray(size)
        self.owned = [*self.owned[-(max_owned - 1) :], buffer]  # forget the oldest: its holder keeps it alive
        return buffer


def _read_exact(file: io.RawIOBase, size: int) -> bytes:
    data = file.read(size)
    if data is None or len(data) == size:
        return data or b""
    parts = [data]  # a short read: keep reading until EOF or `size` bytes
    while sum(map(len, parts)) < size and (more := file.read(size - sum(map(len, parts)))):
        parts.append(more)
    return b"".join(parts)


def _header_number(field_bytes: bytes) -> int:
    if field_bytes[0] & 0x80:  # GNU base-256 for large values
        return int.from_bytes(field_bytes[1:], "big")
    text = field_bytes.rstrip(b"\0 ").strip()
    return int(text, 8) if text else 0


def _read_into(file: io.RawIOBase, buffer: bytearray, size: int) -> memoryview:
    view = memoryview(buffer)[:size]
    filled = 0
    while filled < size and (count := file.readinto(view[filled:])):
        filled += count
    return view[:filled]


def iter_tar_members(
    path: str | Path, sha256: Any = None, keep: Callable[[str], bool] | None = None, pool: BufferPool | None = None
) -> Iterator[tuple[str, bytes | memoryview | None]]:
    """(member name, bytes) of every regular file of an uncompressed tar, in order.

    Args:
        path: the tar file.
        sha256: optional hashlib object updated with every byte of the file.
        keep: optional predicate on member names; other members are skipped with a seek and
            yielded as (name, None). Not combinable with `sha256`.
        pool: read members of at least `pool.min_size` bytes into its recycled buffers; the data is
            then a memoryview of a buffer from `pool.take`, to be given back by the consumer.

    Raises:
        ShardError: naming the file and offset, on a bad header checksum or a truncated file.
    """
    path = Path(path)
    if sha256 is not None and keep is not None:
        raise ValueError("iter_tar_members: hashing needs every byte, so `keep` cannot skip members")
    with open(path, "rb", buffering=0) as file:
        file_size = os.fstat(file.fileno()).st_size

        def read(size: int) -> bytes:
            data = _read_exact(file, size)
            if sha256 is not None:
                sha256.update(data)
            return data

        offset = 0
        while True:
            header = read(BLOCK)
            if len(header) < BLOCK:
                raise ShardError(f"{path}: truncated at byte {offset + len(header)} (no end-of-archive marker)")
            if header == _ZERO_BLOCK:
                break
            stored = _header_number(header[148:156])
            if stored != sum(header[:148]) + 256 + sum(header[156:]):
                raise ShardError(f"{path}: corrupt tar header at byte {offset} (checksum mismatch)")
            size = _header_number(header[124:136])
            end = offset + BLOCK + size + (-size % BLOCK)
            if end > file_size:
                raise ShardError(f"{path}: truncated inside the member at byte {offset} (file ends at {file_size})")
            if header[156:157] in (b"x", b"g", b"L", b"K"):  # TarWriter writes ustar: names fit the header
                raise ShardError(f"{path}: pax or GNU extended header at byte {offset}; shards are plain ustar")
            if header[156:157] not in (b"0", b"\0", b"7"):  # directories, links: not sample members
                read(end - offset - BLOCK)
                offset = end
                continue
            name = header[:100].split(b"\0", 1)[0].decode()
            if header[257:262] == b"ustar" and header[345] != 0:
                name = header[345:500].split(b"\0", 1)[0].decode() + "/" + name
            if keep is None or keep(name):
                data: bytes | memoryview
                if pool is not None and size >= pool.min_size and sha256 is None:
                    data = _read_into(file, pool.take(size), size)
                    file.seek(end)
                else:
                    data = read(size)
                    read(-size % BLOCK)
                yield name, data
            else:
                file.seek(end)
                yield name, None
            offset = end
        if sha256 is not None:
            while chunk := file.read(1 << 20):
                sha256.update(chunk)


def _split_member(path: Path, name: str) -> tuple[str, str]:
    key, dot, suffix = name.rsplit("/", 1)[-1].partition(".")
    if not dot:
        raise ShardError(f"{path}: member {name!r} has no field suffix (expected <key>.<field>)")
    return key, suffix


@dataclass
class _Cursor:
    """Which sample of a shard the reader is in (the members of one key are consecutive)."""

    key: str | None = None
    position: int = -1

    def see(self, key: str) -> int:
        """The position of the sample `key` belongs to, moving on when the key changes."""
        if key != self.key:
            self.key, self.position = key, self.position + 1
        return self.position


def iter_raw_samples(
    path: str | Path,
    sha256: Any = None,
    start: int = 0,
    stop: int | None = None,
    suffixes: set[str] | None = None,
    pool: BufferPool | None = None,
    positions: Container[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Samples `start .. stop - 1` of a shard as `{"__key__": key, "<field>.npy": bytes, "json": bytes}`.

    With a `pool`, large members are memoryviews of pooled buffers, listed under "__buffers__".

    Samples before `start`, samples whose position (0 = the shard's first sample) is not in
    `positions` when it is given, and members whose suffix is not in `suffixes` are skipped by
    seeking, so reading part of a shard, or a few of its fields, costs only what is read.
    """
    path = Path(path)
    cursor = _Cursor()

    def wanted(position: int) -> bool:
        return start <= position and (stop is None or position < stop) and (positions is None or position in positions)

    def keep(name: str) -> bool:
        key, suffix = _split_member(path, name)
        return wanted(cursor.see(key)) and (suffixes is None or suffix in suffixes)

    skipping = sha256 is None  # hashing reads every byte, so nothing can be skipped
    current: dict[str, Any] = {}
    for name, data in iter_tar_members(path, sha256, keep if skipping else None, pool):
        key, suffix = _split_member(path, name)
        position = cursor.see(key)  # (already advanced by `keep` when skipping)
        if current and current["__key__"] != key:
            yield current
            current = {}
        if stop is not None and position >= stop:
            return
        if not wanted(position):
            continue
        if suffix in current:
            raise ShardError(f"{path}: sample {key} holds {suffix!r} twice")
        current.setdefault("__key__", key)
        if isinstance(data, memoryview):
            current.setdefault("__buffers__", []).append(data.obj)
        if data is not None:
            current[suffix] = data
    if current:
        yield current


def decode_sample(raw: dict[str, Any], fields: dict[str, FieldSpec], num_tokens: int, shard: str) -> dict[str, Any]:
    """Arrays (zero-copy views) and metadata of one raw sample, checked against the manifest's fields.

    Args:
        raw: one group from `iter_raw_samples`.
        fields: the fields to decode (all, or a subset, of the manifest's).
        num_tokens: G; a sample's length must lie in 1..G.
        shard: the shard's path, for error messages.

    Returns:
        {"__key__": str, "meta": dict, "tokens": (L,), "hidden": (L, D), ...the other requested fields}.

    Raises:
        SampleError: naming the shard, the key and the field, if a field is missing or has the wrong
            dtype or shape.
    """
    key = raw["__key__"]
    sample: dict[str, Any] = {"__key__": key}
    name = "json"
    try:
        sample["meta"] = json.loads(raw["json"])
        for name, spec in fields.items():
            array = decode_npy(raw[f"{name}.npy"])
            expected_ndim = 1 if spec.width is None else 2
            if str(array.dtype) != spec.dtype or array.ndim != expected_ndim:
                raise ValueError(
                    f"dtype {array.dtype} with {array.ndim} dims, the manifest says {spec.dtype} with {expected_ndim}"
                )
            if spec.width is not None and array.shape[1] != spec.width:
                raise ValueError(f"width {array.shape[1]}, the manifest says {spec.width}")
            sample[name] = array
    except KeyError as error:
        raise SampleError(f"{shard}: sample {key} lacks the member {error.args[0]!r}") from None
    except ValueError as error:
        raise SampleError(f"{shard}: sample {key}, field {name!r}: {error}") from None
    lengths = {name: len(sample[name]) for name in fields}
    if len(set(lengths.values())) != 1 or not 0 < lengths["tokens"] <= num_tokens:
        raise SampleError(f"{shard}: sample {key}: field lengths {lengths}, expected one length in 1..{num_tokens}")
    return sample


# ----------------------------------------------------------------------------- validation


def validate_dataset(folder: str | Path, check_finite: bool = True, progress: bool = True) -> dict[str, int]:
    """Re-read every shard of a dataset: sha256, counts, fields, dtypes, shapes and finiteness.

    Every field the manifest lists (FEATURE_FIELDS: the optional aux, uncond_hidden and uncond_aux
    too) is decoded and checked for NaN/Inf in every sample, and the manifest's field widths are
    checked against its target (D, or 3D for the auxiliary streams).

    Returns:
        {"shards": ..., "samples": ..., "bytes": ...} when everything checks out.

    Raises:
        ValueError: listing every problem found, each naming the shard (and key and field).
    """
    from tqdm import tqdm

    folder = Path(folder)
    manifest = load_manifest(folder)
    problems = _check_fields(manifest, str(folder / MANIFEST_NAME))
    if not {"tokens", "hidden"} <= set(manifest.fields):  # samples cannot be checked without them
        raise ValueError(f"{folder}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    seen: set[str] = set()
    total_samples = total_bytes = 0
    bar = tqdm(manifest.shards, desc="validate", unit="shard", disable=not progress)
    for info in bar:
        path = folder / info.name
        if not path.exists():
            problems.append(f"{path}: listed in the manifest but missing")
            continue
        sha256, count = hashlib.sha256(), 0
        try:
            for raw in iter_raw_samples(path, sha256):
                sample = decode_sample(raw, manifest.fields, manifest.num_tokens, str(path))
                problems += _check_sample(sample, info, path, seen, check_finite)
                count += 1
        except ShardError as error:
            problems.append(str(error))
            continue
        total_samples, total_bytes = total_samples + count, total_bytes + path.stat().st_size
        if sha256.hexdigest() != info.sha256:
            problems.append(f"{path}: sha256 {sha256.hexdigest()} differs from the manifest's {info.sha256}")
        if count != info.num_samples:
            problems.append(f"{path}: holds {count} samples, the manifest says {info.num_samples}")
    if sum(s.num_samples for s in manifest.shards) != manifest.num_samples:
        problems.append(
            f"{folder / MANIFEST_NAME}: shard counts sum to {sum(s.num_samples for s in manifest.shards)}, "
            f"num_samples says {manifest.num_samples}"
        )
    if problems:
        shown = "\n  ".join(problems[:50])
        raise ValueError(f"{folder}: {len(problems)} problem(s):\n  {shown}")
    return {"shards": len(manifest.shards), "samples": total_samples, "bytes": total_bytes}


def field_widths(target: TargetIdentity) -> dict[str, int | None]:
    """The row width of every field of FEATURE_FIELDS for a target (None: a 1-D field)."""
    hidden, aux = target.hidden_size, len(target.aux_layer_ids) * target.hidden_size
    return {"tokens": None, "hidden": hidden, "aux": aux, "uncond_hidden": hidden, "uncond_aux": aux}


def _check_fields(manifest: Manifest, source: str) -> list[str]:
    """The manifest's field list against FEATURE_FIELDS and the widths its target implies."""
    widths, problems = field_widths(manifest.target), []
    for name in ("tokens", "hidden"):
        if name not in manifest.fields:
            problems.append(f"{source}: lacks the required field {name!r}")
    for name, spec in manifest.fields.items():
        if name not in widths:
            problems.append(f"{source}: unknown field {name!r} (known fields: {', '.join(FEATURE_FIELDS)})")
        elif spec.width != widths[name]:
            problems.append(f"{source}: field {name!r} has width {spec.width}, its target needs {widths[name]}")
    return problems


def _check_sample(sample: dict[str, Any], info: ShardInfo, path: Path, seen: set[str], check_finite: bool) -> list[str]:
    key, problems = sample["__key__"], []
    if key in seen:
        problems.append(f"{path}: sample {key} appears more than once in the dataset")
    seen.add(key)
    index = int(key)
    if not info.first_index <= index < info.first_index + info.num_samples:
        problems.append(f"{path}: sample {key} lies outside the shard's index range")
    for name in ("index", "prompt_id", "prompt", "seed"):
        if name not in sample["meta"]:
            problems.append(f"{path}: sample {key}, field 'json': lacks {name!r}")
    for name in FEATURE_FIELDS[1:]:
        if check_finite and name in sample and not np.isfinite(sample[name]).all():
            bad = int((~np.isfinite(sample[name])).sum())
            problems.append(f"{path}: sample {key}, field {name!r}: {bad} non-finite values (NaN/Inf)")
    return problems
