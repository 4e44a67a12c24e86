"""EAGLE-3's reduced draft vocabulary, built from token counts in the training shards and keyed to them.

The map's key is a fingerprint of the dataset (the sha256 of every shard, in order, plus the image
vocabulary size), stored in the drafter's config; a drafter whose key differs from the dataset it
is trained on is refused, so a map counted on other data is never reused silently (the stale-cache
bug SpecForge and speculators shipped; docs/architecture.md, section "A draft vocabulary keyed to its data").

Shapes: V image vocabulary, Vd draft vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from data.shard_reader import decode_sample, iter_raw_samples
from data.shards import load_manifest
from models.eagle import vocab_map_from_counts


def dataset_fingerprint(folder: str | Path) -> str:
    """sha256 over the manifest's image vocabulary and shard hashes: changes whenever the data does."""
    manifest = load_manifest(folder)
    digest = hashlib.sha256(f"vocab={manifest.target.image_vocab_size}".encode())
    for shard in manifest.shards:
        digest.update(shard.sha256.encode())
    return digest.hexdigest()


def count_image_tokens(folder: str | Path, progress: bool = True) -> Tensor:
    """How often each image token occurs in a dataset: (V,) int64. Reads only the `tokens` members."""
    folder = Path(folder)
    manifest = load_manifest(folder)
    counts = np.zeros(manifest.target.image_vocab_size, dtype=np.int64)
    fields = {"tokens": manifest.fields["tokens"]}
    for shard in tqdm(manifest.shards, desc="counting tokens", unit="shard", disable=not progress):
        path = folder / shard.name
        for raw in iter_raw_samples(path, suffixes={"tokens.npy", "json"}):
            # the DataModule's checked decoding: missing or malformed members, dtype, length, ids within 0..V-1
            sample = decode_sample(raw, fields, manifest.num_tokens, str(path), counts.shape[0])
            counts += np.bincount(sample["tokens"].astype(np.int64), minlength=counts.shape[0])  # (L,) ids
    return torch.from_numpy(counts)


def build_vocab_map(folder: str | Path, draft_vocab_size: int) -> tuple[Tensor, Tensor, str, float]:
    """The reduced vocabulary of a dataset: d2t (Vd,), t2d (V,), the dataset key and the share of tokens it covers."""
    counts = count_image_tokens(folder)
    d2t, t2d = vocab_map_from_counts(counts, draft_vocab_size)
    coverage = float(counts[t2d].sum()) / max(int(counts.sum()), 1)
    return d2t, t2d, dataset_fingerprint(folder), coverage
