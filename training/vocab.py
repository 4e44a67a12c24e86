"""EAGLE-3's reduced draft vocabulary, built from token counts in the training shards and keyed to them.

The map's key is a fingerprint of the dataset (the sha256 of every shard, in order, plus the image
vocabulary size), stored in the drafter's config; a drafter whose key differs from the dataset it
is trained on is refused, so a map counted on other data is never reused silently (the stale-cache
bug peers.md §2.8 lists for SpecForge and speculators).

Shapes: V image vocabulary, Vd draft vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from data.errors import SampleError
from data.shard_reader import iter_raw_samples, value_problem
from data.shards import decode_npy, load_manifest
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
    for shard in tqdm(manifest.shards, desc="counting tokens", unit="shard", disable=not progress):
        for raw in iter_raw_samples(folder / shard.name, suffixes={"tokens.npy"}):
            tokens = decode_npy(raw["tokens.npy"])  # (L,) image token ids
            problem = value_problem(tokens, counts.shape[0])
            if problem is not None:  # bincount would crash on a negative id or grow on one >= V
                raise SampleError(f"{folder / shard.name}: sample {raw['__key__']}, field 'tokens': {problem}")
            counts += np.bincount(tokens.astype(np.int64), minlength=counts.shape[0])
    return torch.from_numpy(counts)


def build_vocab_map(folder: str | Path, draft_vocab_size: int) -> tuple[Tensor, Tensor, str, float]:
    """The reduced vocabulary of a dataset: d2t (Vd,), t2d (V,), the dataset key and the share of tokens it covers."""
    counts = count_image_tokens(folder)
    d2t, t2d = vocab_map_from_counts(counts, draft_vocab_size)
    coverage = float(counts[t2d].sum()) / max(int(counts.sum()), 1)
    return d2t, t2d, dataset_fingerprint(folder), coverage
