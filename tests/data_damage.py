"""Ways to damage a tiny dataset on purpose, for the error and fuzz tests of data/.

A sample is edited as (key, arrays, meta) and its shard rewritten with the manifest's sha256, size
and count updated, so that only the check under test can catch it; tar headers are edited with
their checksum repaired, so that the field's own check has to catch it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data.shard_reader import iter_raw_samples
from data.shards import MANIFEST_NAME, ShardWriter, decode_npy, load_manifest, write_atomic

Sample = tuple[str, dict[str, np.ndarray], dict[str, Any]]
"""(key, arrays by field name, json metadata) of one sample."""


def read_shard(path: Path) -> list[Sample]:
    """Every sample of a shard, its arrays copied (writable)."""
    samples = []
    for raw in iter_raw_samples(path):
        arrays = {k.removesuffix(".npy"): decode_npy(v).copy() for k, v in raw.items() if k.endswith(".npy")}
        samples.append((raw["__key__"], arrays, json.loads(raw["json"])))
    return samples


def write_shard(path: Path, samples: list[Sample]) -> Any:
    """Write samples as a shard (members in field order, as extraction does); returns its ShardInfo."""
    writer = ShardWriter(path)
    for key, arrays, meta in samples:
        writer.write(key, arrays, meta)
    return writer.commit(first_index=0)


def rewrite_shard(folder: Path, index: int, edit: Callable[[list[Sample]], list[Sample]]) -> None:
    """Apply `edit` to shard `index`'s samples, rewrite it, and update its manifest entry to match."""
    manifest = load_manifest(folder)
    info = manifest.shards[index]
    written = write_shard(folder / info.name, edit(read_shard(folder / info.name)))
    values = json.loads((folder / MANIFEST_NAME).read_text())
    values["shards"][index].update(sha256=written.sha256, num_bytes=written.num_bytes, num_samples=written.num_samples)
    values["num_samples"] = sum(s["num_samples"] for s in values["shards"])
    write_atomic(folder / MANIFEST_NAME, json.dumps(values))


def edit_sample(key: str, change: Callable[[dict[str, np.ndarray], dict[str, Any]], None]) -> Callable:
    """An `edit` for `rewrite_shard` that calls `change(arrays, meta)` on the sample `key` only."""

    def edit(samples: list[Sample]) -> list[Sample]:
        for sample_key_, arrays, meta in samples:
            if sample_key_ == key:
                change(arrays, meta)
        return samples

    return edit


def header_offsets(data: bytes) -> list[int]:
    """Byte offsets of every member header of an (intact) tar."""
    offsets, offset = [], 0
    while offset + 512 <= len(data) and data[offset : offset + 512] != bytes(512):
        offsets.append(offset)
        size = int(data[offset + 124 : offset + 136].strip(b"\0 ") or b"0", 8)
        offset += 512 + size + (-size % 512)
    return offsets


def set_header_field(data: bytes, offset: int, start: int, value: bytes) -> bytes:
    """`data` with bytes `start..start+len(value)` of the header at `offset` replaced, checksum repaired."""
    out = bytearray(data)
    out[offset + start : offset + start + len(value)] = value
    header = out[offset : offset + 512]
    checksum = sum(header[:148]) + 256 + sum(header[156:])
    out[offset + 148 : offset + 156] = b"%06o\0 " % checksum
    return bytes(out)
