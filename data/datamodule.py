"""The streaming DataModule: extracted feature shards -> padded batches, split by rank and worker.

    datamodule = FeatureDataModule(DataConfig(train_dir="shards/toy", num_val_shards=1), target=target)
    trainer.fit(system, datamodule=datamodule)

Every epoch has a plan, fixed by (seed, epoch) and the manifest alone, so every rank computes the
same one without communicating:

1. Order the shards (a fresh permutation each epoch when shuffling) and lay their samples end to
   end: N samples in all.
2. Node split: rank r takes the contiguous run of samples [r N / W, (r + 1) N / W). Every rank gets
   ceil(N / W) rows; a rank with one sample fewer gets one padding row. So each sample is seen
   exactly once per epoch, and every rank runs the same number of batches whatever the shard
   counts (uneven shards otherwise hang or crash DDP, ecosystem.md section 3).
3. Worker split: the rank's rows are cut into `num_workers` contiguous runs the same way.
4. Each worker reads its runs (a run may start or end inside a shard; skipped samples cost a seek),
   mixes them through a shuffle buffer seeded by (seed, epoch, rank, worker), and collates batches.

Webdataset's own `split_by_node` deals whole shards, which cannot equalise uneven shards without
resampling (resampling sees some samples twice and others never). So the splitters here are the
plan above; the shards are WebDataset tars read by `data.shards.iter_raw_samples`.

The epoch: each `iter()` of the dataset advances its epoch (webdataset's detshuffle does the
same), which needs persistent workers, since fresh workers would restart from the pickled epoch and
repeat one order every epoch; `persistent_workers` is therefore always on. Training resumed at
epoch e starts from epoch e (`train_dataloader` reads `trainer.current_epoch`).

Padding rows (and, under `on_error="skip"`, rows of unreadable samples) have `sample_mask` False and
an all-False `loss_mask`; losses must average over `loss_mask` and tolerate a batch of padding only.

Shapes: B batch, L longest sample of the batch, D hidden size.
"""

from __future__ import annotations

import logging
import math
import os
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.shards import (
    BufferPool,
    FieldSpec,
    Manifest,
    SampleError,
    ShardError,
    ShardInfo,
    TargetIdentity,
    decode_sample,
    iter_raw_samples,
    load_manifest,
    sample_key,
)

log = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")


class SkippedSamplesWarning(UserWarning):
    """Samples were dropped under on_error="skip" (and replaced by masked padding rows)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where the features are and how to batch them."""

    train_dir: str
    """Dataset folder (manifest.json + shards) for training."""
    val_dir: str | None = None
    """Dataset folder for validation; None takes the last `num_val_shards` shards of train_dir."""
    num_val_shards: int = 0
    """With val_dir None: shards of train_dir held out for validation (0 = no validation data)."""
    batch_size: int = 8
    """Samples per batch on each rank."""
    num_workers: int = 0
    """DataLoader worker processes per rank (on 2 CPU cores, 0 is fastest: samples are MBs each)."""
    shuffle_buffer: int = 16
    """Samples mixed across shards; memory is shuffle_buffer x sample size (4.7 MB for Janus hidden only)."""
    seed: int = 0
    """Fixes, with the epoch, the shard order and the shuffle."""
    load_aux: bool = True
    """Load the EAGLE-3 auxiliary streams (EAGLE-3 drafters need them; EAGLE-1 does not)."""
    load_uncond: bool = False
    """Load the unconditional features."""
    on_error: str = "raise"
    """raise: a corrupt or truncated shard stops training with its name; skip: warn, pad and count."""

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}; use one of {', '.join(ON_ERROR)}")
        for name in ("batch_size", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0 or self.num_val_shards < 0:
            raise ValueError(
                f"num_workers and num_val_shards must be >= 0, got {self.num_workers}, {self.num_val_shards}"
            )


@dataclass(frozen=True)
class Segment:
    """Samples [start, stop) of one shard, or `stop - start` padding rows when `shard` is None."""

    shard: ShardInfo | None
    start: int
    stop: int


def _split(count: int, parts: int, part: int) -> tuple[int, int]:
    """The `part`-th of `parts` balanced contiguous runs of range(count)."""
    return part * count // parts, (part + 1) * count // parts


def plan_epoch(
    shards: list[ShardInfo],
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    rank: int,
    world_size: int,
    worker: int = 0,
    num_workers: int = 1,
) -> list[Segment]:
    """The segments one worker of one rank reads in one epoch (module docstring, steps 1-3)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(shards)) if shuffle else range(len(shards))
    ordered = [shards[i] for i in order]
    total = sum(s.num_samples for s in ordered)
    rank_start, rank_stop = _split(total, world_size, rank)
    rows = math.ceil(total / world_size)  # every rank, padded
    first, last = _split(rows, max(num_workers, 1), worker)
    real_first, real_last = (
        rank_start + min(first, rank_stop - rank_start),
        rank_start + min(last, rank_stop - rank_start),
    )
    segments, offset = [], 0
    for info in ordered:  # intersect [real_first, real_last) with each shard's span
        lo, hi = max(real_first, offset), min(real_last, offset + info.num_samples)
        if lo < hi:
            segments.append(Segment(info, lo - offset, hi - offset))
        offset += info.num_samples
    padding = (last - first) - (real_last - real_first)
    if padding:
        segments.append(Segment(None, 0, padding))
    return segments


def batches_per_rank(total: int, *, world_size: int, num_workers: int, batch_size: int) -> int:
    """Batches every rank yields per epoch: the same on all ranks by construction."""
    rows = math.ceil(total / world_size)
    return sum(
        math.ceil((b - a) / batch_size)
        for a, b in (_split(rows, max(num_workers, 1), w) for w in range(max(num_workers, 1)))
    )


def collate_samples(
    samples: list[dict[str, Any] | None],
    fields: dict[str, FieldSpec],
    num_tokens: int,
    pool: BufferPool | None = None,
) -> dict[str, Any]:
    """Pad samples to the longest and stack them; `None` entries become masked padding rows.

    With a `pool` (and outside DataLoader workers), batch memory that no tensor uses any more is
    recycled (see `_allocate`).

    Returns:
        tokens (B, L) int64; every float field (B, L, width) in its stored dtype; loss_mask (B, L) bool;
        sample_mask (B,) bool; lengths (B,) int64; keys, prompt_ids, prompts: lists of B strings ("" for padding).
    """
    lengths = [0 if s is None else len(s["tokens"]) for s in samples]
    longest = max(lengths) or num_tokens
    count = len(samples)
    batch: dict[str, Any] = {}
    for name, spec in fields.items():
        shape = (count, longest) if spec.width is None else (count, longest, spec.width)
        out = _allocate(shape, torch.int64 if name == "tokens" else _TORCH_DTYPES[spec.dtype], pool)
        view = out.numpy()
        for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            if length:
                view[row, :length] = sample[name]  # the one copy: from the tar bytes into the batch
            if length < longest:
                view[row, length:] = 0
        batch[name] = out
    lengths_tensor = torch.tensor(lengths, dtype=torch.int64)
    batch["lengths"] = lengths_tensor
    batch["loss_mask"] = torch.arange(longest)[None, :] < lengths_tensor[:, None]  # (B, L)
    batch["sample_mask"] = lengths_tensor > 0
    batch["keys"] = ["" if s is None else s["__key__"] for s in samples]
    batch["prompt_ids"] = ["" if s is None else s["meta"].get("prompt_id", "") for s in samples]
    batch["prompts"] = ["" if s is None else s["meta"].get("prompt", "") for s in samples]
    return batch


_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "int16": torch.int16, "int32": torch.int32}


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, pool: BufferPool | None = None) -> Tensor:
    """An uninitialised tensor for a batch (every element gets written by the caller).

    In a DataLoader worker it lives in shared memory, so handing it to the main process copies
    nothing. In the main process, with a pool, it views a recycled buffer: fresh memory costs a
    page fault per 4 KB, which made the copy into the batch 4x slower than the copy itself.
    """
    if get_worker_info() is None:
        if pool is None:
            return torch.empty(shape, dtype=dtype)
        numel = math.prod(shape)
        return torch.frombuffer(pool.take_unused(numel * dtype.itemsize), dtype=dtype, count=numel).view(shape)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


class ShardStream(IterableDataset):
    """Batches of one rank, read from a dataset's shards by the plan in the module docstring."""

    def __init__(
        self,
        folder: str | Path,
        manifest: Manifest,
        shards: list[ShardInfo],
        config: DataConfig,
        *,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
        start_epoch: int = 0,
    ) -> None:
        super().__init__()
        wanted = (
            {"tokens", "hidden"}
            | ({"aux"} if config.load_aux else set())
            | ({"uncond_hidden"} if config.load_uncond else set())
        )
        missing = sorted(wanted - set(manifest.fields))
        if missing:
            raise ValueError(
                f"{folder}: the dataset has no {missing} features (it holds {sorted(manifest.fields)}); "
                "set load_aux / load_uncond to false or re-extract with store_aux / store_uncond"
            )
        if not shards:
            raise ValueError(f"{folder}: no shards to read (check num_val_shards against the manifest's shard count)")
        self.folder, self.manifest, self.shards, self.config = Path(folder), manifest, shards, config
        self.fields = {
            name: manifest.fields[name] for name in ("tokens", "hidden", "aux", "uncond_hidden") if name in wanted
        }
        self.suffixes = {"json"} | {f"{name}.npy" for name in self.fields}
        self.shuffle, self.rank, self.world_size, self.epoch = shuffle, rank, world_size, start_epoch
        self.num_samples = sum(s.num_samples for s in shards)
        self._pool: BufferPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}  # workers start with their own empty pool

    def __len__(self) -> int:
        return batches_per_rank(
            self.num_samples,
            world_size=self.world_size,
            num_workers=self.config.num_workers,
            batch_size=self.config.batch_size,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        if num_workers != max(self.config.num_workers, 1):
            raise ValueError(
                f"ShardStream planned for {self.config.num_workers} workers but runs in {num_workers}; "
                "build the DataLoader with num_workers=config.num_workers"
            )
        epoch, self.epoch = self.epoch, self.epoch + 1
        plan = plan_epoch(
            self.shards,
            epoch=epoch,
            seed=self.config.seed,
            shuffle=self.shuffle,
            rank=self.rank,
            world_size=self.world_size,
            worker=worker,
            num_workers=num_workers,
        )
        skipped: list[str] = []
        pool = self._pool = self._pool or BufferPool()  # per process, kept across epochs
        samples = self._read(plan, skipped, pool)
        if self.shuffle:
            rng = random.Random(f"{self.config.seed}-{epoch}-{self.rank}-{worker}")
            samples = _shuffled(samples, self.config.shuffle_buffer, rng)
        chunk: list[dict[str, Any] | None] = []
        for sample in samples:
            chunk.append(sample)
            if len(chunk) == self.config.batch_size:
                yield self._collate(chunk, pool)
                chunk = []
        if chunk:
            yield self._collate(chunk, pool)
        if skipped:
            message = (
                f"epoch {epoch}, rank {self.rank}, worker {worker}: skipped {len(skipped)} of "
                f"{sum(s.stop - s.start for s in plan if s.shard)} samples (replaced by masked padding rows) "
                f"from {sorted(set(skipped))}"
            )
            log.warning(message)
            warnings.warn(message, SkippedSamplesWarning, stacklevel=1)

    def _collate(self, chunk: list[dict[str, Any] | None], pool: BufferPool) -> dict[str, Any]:
        batch = collate_samples(chunk, self.fields, self.manifest.num_tokens, pool)
        for sample in chunk:  # the batch owns copies now; the samples' views die with `chunk`
            if sample is not None:
                pool.give(sample.pop("__buffers__", []))
        chunk.clear()
        return batch

    def _read(self, plan: list[Segment], skipped: list[str], pool: BufferPool) -> Iterator[dict[str, Any] | None]:
        for segment in plan:
            if segment.shard is None:
                yield from [None] * (segment.stop - segment.start)
            else:
                yield from self._read_segment(segment, segment.shard, skipped, pool)

    def _read_segment(
        self, segment: Segment, info: ShardInfo, skipped: list[str], pool: BufferPool
    ) -> Iterator[dict[str, Any] | None]:
        path = str(self.folder / info.name)
        count = segment.stop - segment.start
        raws = iter_raw_samples(path, start=segment.start, stop=segment.stop, suffixes=self.suffixes, pool=pool)
        for produced in range(count):
            try:
                raw = next(raws, None)
                if raw is None:
                    raise ShardError(
                        f"{path}: ends after {segment.start + produced} samples, the manifest says {info.num_samples}"
                    )
                expected = sample_key(info.first_index + segment.start + produced)
                if raw["__key__"] != expected:
                    raise ShardError(f"{path}: found sample {raw['__key__']} where the manifest puts {expected}")
            except ShardError as error:  # the rest of the segment is unreadable
                yield from [self._skip(error, count - produced, info.name, skipped)] * (count - produced)
                return
            try:
                sample = decode_sample(raw, self.fields, self.manifest.num_tokens, path)
                sample["__buffers__"] = raw.get("__buffers__", [])
                yield sample
            except SampleError as error:  # this sample only
                yield self._skip(error, 1, info.name, skipped)

    def _skip(self, error: ShardError, count: int, shard: str, skipped: list[str]) -> None:
        if self.config.on_error == "raise":
            raise ShardError(f"{error} (set on_error='skip' to train on without these samples)") from error
        warnings.warn(f"skipping {count} sample(s): {error}", SkippedSamplesWarning, stacklevel=2)
        skipped.extend([shard] * count)
        return None


def _shuffled(samples: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A shuffle buffer: hold `size` samples, emit a random one as each new one arrives."""
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        index = rng.randrange(size)
        buffer[index], sample = sample, buffer[index]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


def _rank_and_world(trainer: Any) -> tuple[int, int]:
    if trainer is not None:
        return trainer.global_rank, trainer.world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class FeatureDataModule(L.LightningDataModule):
    """Train and val streams of extracted features for the configured target.

    Args:
        config: the data settings.
        target: the target the drafter is trained for (an `ImageTarget` or its `TargetIdentity`);
            a dataset extracted from anything else is refused, naming both.
    """

    def __init__(self, config: DataConfig, target: Any) -> None:
        super().__init__()
        self.config = config
        self.target = target if isinstance(target, TargetIdentity) else TargetIdentity.from_target(target)
        self.train_stream: ShardStream | None = None
        self.val_stream: ShardStream | None = None

    def setup(self, stage: str | None = None) -> None:
        config = self.config
        manifest = load_manifest(config.train_dir)
        manifest.check_target(self.target, source=str(Path(config.train_dir) / "manifest.json"))
        train_shards, val_dir, val_manifest = manifest.shards, config.val_dir, manifest
        if val_dir is not None:
            val_manifest = load_manifest(val_dir)
            val_manifest.check_target(self.target, source=str(Path(val_dir) / "manifest.json"))
            val_shards = val_manifest.shards
        elif config.num_val_shards:
            if config.num_val_shards >= len(manifest.shards):
                raise ValueError(
                    f"num_val_shards={config.num_val_shards} leaves no training shards: {config.train_dir} "
                    f"has {len(manifest.shards)}"
                )
            train_shards, val_shards = (
                manifest.shards[: -config.num_val_shards],
                manifest.shards[-config.num_val_shards :],
            )
        else:
            val_shards = []
        rank, world_size = _rank_and_world(self.trainer)
        self.train_stream = ShardStream(
            config.train_dir, manifest, train_shards, config, shuffle=True, rank=rank, world_size=world_size
        )
        if val_shards:
            self.val_stream = ShardStream(
                val_dir or config.train_dir,
                val_manifest,
                val_shards,
                config,
                shuffle=False,
                rank=rank,
                world_size=world_size,
            )

    def train_dataloader(self) -> DataLoader:
        if self.train_stream is None:
            self.setup("fit")
        assert self.train_stream is not None
        if self.trainer is not None:  # called after a checkpoint's epoch is restored (setup runs before)
            self.train_stream.epoch = self.trainer.current_epoch
        return self._loader(self.train_stream)

    def val_dataloader(self) -> DataLoader | list:
        if self.train_stream is None:
            self.setup("validate")
        return self._loader(self.val_stream) if self.val_stream is not None else []

    def _loader(self, stream: ShardStream | None) -> DataLoader:
        workers = self.config.num_workers
        return DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
