"""`--validate`: re-read every byte of a dataset folder and list everything wrong with it.

    python -m data.extract --validate shards/toy

Checks the manifest (every field's type, shard paths inside the folder, widths against the target,
counts, overlapping sample ranges), then every shard: that it exists and is a plain tar, its sha256,
size and sample count against the manifest, that its keys are the global sample indices the
manifest gives it in order and unique in the dataset, and every sample as the DataModule decodes it
(`decode_sample`: members, dtypes, shapes, lengths, NaN/Inf, token ids within the image vocabulary;
for a float8_e4m3fn field its uint8 codes (no NaN code 0x7F/0xFF) and its `<field>_scale` member:
(L,) float32, every scale finite, > 0 and small enough for the float16 batch) plus its metadata.
Unlike the DataModule, which stops at the first problem, it goes on and reports them all, each naming
the file (and key and field).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from data.errors import DatasetError
from data.manifest import FEATURE_FIELDS, MANIFEST_NAME, Manifest, ShardInfo, load_manifest
from data.shard_reader import decode_sample, iter_raw_samples
from data.shards import SampleError, ShardError, sample_key


def validate_dataset(folder: str | Path, check_finite: bool = True, progress: bool = True) -> dict[str, int]:
    """Re-read every shard of a dataset: sha256, counts, keys, fields, dtypes, shapes and values.

    Every field the manifest lists (FEATURE_FIELDS: the optional aux, uncond_hidden and uncond_aux
    too) is decoded and, with `check_finite`, checked for NaN/Inf in every sample (NaN codes and bad
    row scales for float8_e4m3fn fields), and token ids for the target's image vocabulary 0..V-1.

    Returns:
        {"shards": ..., "samples": ..., "bytes": ...} when everything checks out.

    Raises:
        ManifestError: naming the manifest and the field, if the manifest cannot be read at all.
        DatasetError: listing every problem found, each naming the file (and key and field).
    """
    from tqdm import tqdm

    folder = Path(folder)
    manifest = load_manifest(folder)
    problems = manifest.consistency_problems(str(folder / MANIFEST_NAME))
    seen: set[str] = set()
    total_samples = total_bytes = 0
    for info in tqdm(manifest.shards, desc="validate", unit="shard", disable=not progress):
        path = folder / info.name
        if path.is_symlink() and not path.resolve().is_relative_to(folder.resolve()):
            problems.append(f"{path}: is a symbolic link to {path.resolve()}, outside the dataset folder; copy it in")
            continue
        sha256, count = hashlib.sha256(), 0
        try:
            for position, raw in enumerate(iter_raw_samples(path, sha256)):
                problems += _check_sample(raw, position, info, path, manifest, seen, check_finite)
                count += 1
        except ShardError as error:  # the rest of the shard cannot be read
            problems.append(str(error))
            continue
        total_samples, total_bytes = total_samples + count, total_bytes + path.stat().st_size
        if sha256.hexdigest() != info.sha256:
            problems.append(f"{path}: sha256 {sha256.hexdigest()} differs from the manifest's {info.sha256}")
        if path.stat().st_size != info.num_bytes:
            problems.append(f"{path}: holds {path.stat().st_size} bytes, the manifest says {info.num_bytes}")
        if count != info.num_samples:
            problems.append(f"{path}: holds {count} samples, the manifest says {info.num_samples}")
    if problems:
        shown = "\n  ".join(problems[:50]) + (f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else "")
        raise DatasetError(f"{folder}: {len(problems)} problem(s):\n  {shown}")
    return {"shards": len(manifest.shards), "samples": total_samples, "bytes": total_bytes}


def _check_sample(
    raw: dict[str, Any],
    position: int,
    info: ShardInfo,
    path: Path,
    manifest: Manifest,
    seen: set[str],
    check_values: bool,
) -> list[str]:
    """The problems of the sample at `position` (0 = the shard's first) of one shard."""
    key, problems = raw["__key__"], []
    expected = sample_key(info.first_index + position)
    if key != expected:
        problems.append(f"{path}: found sample {key!r} where the manifest puts {expected} (first_index + position)")
    if key in seen:
        problems.append(f"{path}: sample {key} appears more than once in the dataset")
    seen.add(key)
    unlisted = sorted(name for name in FEATURE_FIELDS if f"{name}.npy" in raw and name not in manifest.fields)
    if unlisted:
        problems.append(
            f"{path}: sample {key} holds {unlisted}, which the manifest's 'fields' do not list; rewrite the manifest "
            "with `python -m data.extract --merge <dataset>` or re-extract"
        )
    try:
        sample = decode_sample(
            raw, manifest.fields, manifest.num_tokens, str(path), manifest.target.image_vocab_size, check_values
        )
    except SampleError as error:
        return [*problems, str(error)]
    del sample  # decode_sample checked its arrays, values and metadata (shard_reader.META_TYPES)
    return problems
