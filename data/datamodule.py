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
plan above; the shards are WebDataset tars read by `data.shard_reader.iter_raw_samples`.

The epoch: each `iter()` of the dataset advances its epoch (webdataset's detshuffle does the
same), which needs persistent workers, since fresh workers would restart from the pickled epoch and
repeat one order every epoch; `persistent_workers` is therefore always on. Training resumed at
epoch e starts from epoch e (`train_dataloader` reads the fit loop's epoch progress).

Resuming mid-epoch: the train DataLoader is a `ResumableLoader`, whose `state_dict` (the epoch and
the batches it has handed out in it) Lightning 2.6 stores in every checkpoint: `FitLoop.on_save_checkpoint`
collects `state_dict()` of each train DataLoader (`CombinedLoader._state_dicts`; the DataLoader
object, never its dataset) under `loops.fit_loop.combined_loader`. On `trainer.fit(ckpt_path=...)`,
`FitLoop.setup_data` calls `train_dataloader()`, then `load_state_dict` on it
(`_load_combined_loader_states`, only while the fit loop is restarting: a mid-epoch checkpoint, or
any checkpoint under max_steps), then `iter()`. The epoch loop keeps its restored
`batch_progress` (batch_idx goes on from the checkpoint's, and the fetcher counts the batches
already fetched against the epoch length), and leaves skipping to the loader. So the resumed epoch
skips the batches already trained on: its plan (order, shuffle) is recomputed from (seed, epoch)
and the skipped samples are never read, so the run sees exactly the batches an uninterrupted run
would have seen next. With workers too: a DataLoader takes batches from its workers in turn and
restarts the turn at worker 0, so each worker takes over the role (plan and shuffle) of the worker
that was next in turn, and skips what that one had yielded. The state is the same on every rank
(ranks step together), so rank 0's copy in the checkpoint serves all. Exact resumption needs the
same world size, workers, batch size, shuffle buffer, seed and shards; `load_state_dict` refuses a
mid-epoch state saved under others.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.shard_reader import BufferPool, decode_sample, iter_raw_samples
from data.shards import (
    FEATURE_FIELDS,
    FieldSpec,
    Manifest,
    SampleError,
    ShardError,
    ShardInfo,
    TargetIdentity,
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
    """Load the unconditional features: uncond_hidden, and uncond_aux too when load_aux is on and the dataset has it."""
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


def worker_batches(total: int, *, world_size: int, num_workers: int, batch_size: int) -> list[int]:
    """Batches each DataLoader worker of a rank yields per epoch (one entry when num_workers is 0)."""
    rows = math.ceil(total / world_size)
    workers = max(num_workers, 1)
    return [math.ceil((b - a) / batch_size) for a, b in (_split(rows, workers, w) for w in range(workers))]


def batches_per_rank(total: int, *, world_size: int, num_workers: int, batch_size: int) -> int:
    """Batches every rank yields per epoch: the same on all ranks by construction."""
    return sum(worker_batches(total, world_size=world_size, num_workers=num_workers, batch_size=batch_size))


def resume_point(counts: list[int], consumed: int) -> tuple[int, list[int]]:
    """Where a DataLoader stands after handing out `consumed` batches of an epoch.

    A DataLoader with workers (in order, torch's default) takes batch 0 from worker 0, batch 1 from
    worker 1 and so on in turn, and drops a worker from the turn once it is exhausted; without
    workers there is one "worker".

    Args:
        counts: the batches each worker yields in the epoch (`worker_batches`).
        consumed: batches already handed out.

    Returns:
        (the worker whose turn is next, the batches each worker has yielded); (0, counts) once the
        epoch is over.
    """
    if consumed >= sum(counts):
        return 0, list(counts)
    full_rounds = min(min(counts), consumed // len(counts))  # every worker yielded this many
    done, consumed, worker = [full_rounds] * len(counts), consumed - full_rounds * len(counts), 0
    while consumed or done[worker] == counts[worker]:
        if done[worker] < counts[worker]:
            done[worker] += 1
            consumed -= 1
        worker = (worker + 1) % len(counts)
    return worker, done


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
        if config.load_uncond and config.load_aux and "uncond_aux" in manifest.fields:
            wanted.add("uncond_aux")  # optional: datasets extracted before it existed lack it
        if not shards:
            raise ValueError(f"{folder}: no shards to read (check num_val_shards against the manifest's shard count)")
        self.folder, self.manifest, self.shards, self.config = Path(folder), manifest, shards, config
        self.fields = {name: manifest.fields[name] for name in FEATURE_FIELDS if name in wanted}
        self.suffixes = {"json"} | {f"{name}.npy" for name in self.fields}
        self.shuffle, self.rank, self.world_size, self.epoch = shuffle, rank, world_size, start_epoch
        self.skip_batches = 0
        """Batches of the next epoch (in DataLoader order) that a resumed run has already trained on:
        the next iteration leaves them out, without reading their samples, then this returns to 0."""
        self.num_samples = sum(s.num_samples for s in shards)
        self._pool: BufferPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}  # workers start with their own empty pool

    def __len__(self) -> int:
        return sum(self.worker_batches())

    def worker_batches(self) -> list[int]:
        """Batches each DataLoader worker of this rank yields per epoch."""
        return worker_batches(
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
        skip, self.skip_batches = self.skip_batches, 0
        # The DataLoader's turn starts at worker 0; on resumption worker i plays the part of the worker
        # that was i places after the one whose turn was next (module docstring, "Resuming mid-epoch").
        next_in_turn, yielded = resume_point(self.worker_batches(), skip)
        worker = (next_in_turn + worker) % num_workers
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
        num_rows = sum(s.stop - s.start for s in plan)
        order: list[int] | range = range(num_rows)  # rows, numbered in reading order, in the order batched
        if self.shuffle:
            rng = random.Random(f"{self.config.seed}-{epoch}-{self.rank}-{worker}")
            order = list(_shuffled(iter(order), self.config.shuffle_buffer, rng))
        order = order[yielded[worker] * self.config.batch_size :]
        skipped: list[str] = []
        pool = self._pool = self._pool or BufferPool()  # per process, kept across epochs
        chunk: list[dict[str, Any] | None] = []
        for sample in self._read(plan, order, skipped, pool):
            chunk.append(sample)
            if len(chunk) == self.config.batch_size:
                yield self._collate(chunk, pool)
                chunk = []
        if chunk:
            yield self._collate(chunk, pool)
        if skipped:
            num_real = sum(s.stop - s.start for s in plan if s.shard)  # padding rows come last
            message = (
                f"epoch {epoch}, rank {self.rank}, worker {worker}: skipped {len(skipped)} of "
                f"{sum(row < num_real for row in order)} samples (replaced by masked padding rows) "
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

    def _read(
        self, plan: list[Segment], order: list[int] | range, skipped: list[str], pool: BufferPool
    ) -> Iterator[dict[str, Any] | None]:
        """The plan's rows in `order` (row numbers in reading order); rows missing from it are never read.

        Reading stays sequential: a row read before its turn waits in `held`. Under the shuffle
        buffer's order, that holds at most `shuffle_buffer` samples, like the buffer itself.
        """
        needed = None if len(order) == sum(s.stop - s.start for s in plan) else set(order)
        rows = self._read_rows(plan, needed, skipped, pool)
        held: dict[int, dict[str, Any] | None] = {}
        for row in order:
            while row not in held:
                number, sample = next(rows)
                held[number] = sample
            yield held.pop(row)

    def _read_rows(
        self, plan: list[Segment], needed: set[int] | None, skipped: list[str], pool: BufferPool
    ) -> Iterator[tuple[int, dict[str, Any] | None]]:
        """(row number, sample or None) of the rows in `needed` (all when None), in reading order."""
        first = 0
        for segment in plan:
            count = segment.stop - segment.start
            rows = [first + i for i in range(count) if needed is None or first + i in needed]
            if segment.shard is None:
                yield from ((row, None) for row in rows)
            elif rows:
                positions = [segment.start + row - first for row in rows]
                samples = self._read_segment(positions, segment.shard, skipped, pool)
                yield from zip(rows, samples, strict=True)
            first += count

    def _read_segment(
        self, positions: list[int], info: ShardInfo, skipped: list[str], pool: BufferPool
    ) -> Iterator[dict[str, Any] | None]:
        """The samples at `positions` (ascending, 0 = the shard's first) of one shard, None for unreadable ones."""
        path = str(self.folder / info.name)
        start, stop = positions[0], positions[-1] + 1
        raws = iter_raw_samples(
            path,
            start=start,
            stop=stop,
            suffixes=self.suffixes,
            pool=pool,
            positions=None if stop - start == len(positions) else set(positions),
        )
        for produced, position in enumerate(positions):
            try:
                raw = next(raws, None)
                if raw is None:
                    raise ShardError(
                        f"{path}: ends before its sample {position} (counting from 0), the manifest says it holds "
                        f"{info.num_samples}"
                    )
                expected = sample_key(info.first_index + position)
                if raw["__key__"] != expected:
                    raise ShardError(f"{path}: found sample {raw['__key__']} where the manifest puts {expected}")
            except ShardError as error:  # the rest of the segment is unreadable
                left = len(positions) - produced
                self._skip(error, left, info.name, skipped)
                yield from [None] * left
                return
            try:
                sample = decode_sample(raw, self.fields, self.manifest.num_tokens, path)
                sample["__buffers__"] = raw.get("__buffers__", [])
                yield sample
            except SampleError as error:  # this sample only
                self._skip(error, 1, info.name, skipped)
                yield None

    def _skip(self, error: ShardError, count: int, shard: str, skipped: list[str]) -> None:
        """Raise under on_error="raise"; else warn and count `count` samples of `shard` as skipped."""
        if self.config.on_error == "raise":
            raise ShardError(f"{error} (set on_error='skip' to train on without these samples)") from error
        warnings.warn(f"skipping {count} sample(s): {error}", SkippedSamplesWarning, stacklevel=2)
        skipped.extend([shard] * count)


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


class ResumableLoader(DataLoader):
    """The DataLoader of a training `ShardStream`, resumable mid-epoch (module docstring, "Resuming mid-epoch").

    `state_dict` records the epoch of the latest iteration and the batches handed out in it;
    `load_state_dict`, before the first iteration, makes the next iteration continue that epoch after
    those batches (or start the following epoch, if it was over). Every `iter()` is a new epoch.

    Args:
        dataset: the stream; its `epoch` is the epoch the first iteration runs.
        num_workers: worker processes (persistent, so that they keep counting epochs).
        epoch_limit: the batches an epoch really runs, when fewer than `len(dataset)` (the trainer's
            `num_training_batches` under `limit_train_batches`), so that a state saved once they are
            done counts as a finished epoch.
    """

    def __init__(
        self, dataset: ShardStream, num_workers: int = 0, epoch_limit: Callable[[], float] | None = None
    ) -> None:
        super().__init__(dataset, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)
        self.epoch_limit = epoch_limit
        self._epoch: int | None = None
        """The epoch of the latest iteration; None before the first."""
        self._handed_out = 0
        """Batches of that epoch handed out, those a resumed iteration skipped included."""
        self._resume: tuple[int, int] | None = None
        """(epoch, batches to skip) for the first iteration, set by `load_state_dict`."""

    def _layout(self) -> dict[str, Any]:
        """What fixes the order of batches within an epoch, besides the epoch and the rank."""
        stream: ShardStream = self.dataset  # type: ignore[assignment]
        config = stream.config
        return {
            "shards": [info.name for info in stream.shards],
            "num_samples": stream.num_samples,
            "world_size": stream.world_size,
            "num_workers": config.num_workers,
            "batch_size": config.batch_size,
            "shuffle": stream.shuffle,
            "shuffle_buffer": config.shuffle_buffer,
            "seed": config.seed,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        stream: ShardStream = self.dataset  # type: ignore[assignment]
        if self._resume is not None:
            (epoch, skip), self._resume = self._resume, None
        else:
            epoch, skip = (stream.epoch if self._epoch is None else self._epoch + 1), 0
        first = self._iterator is None  # (persistent workers are started by the first iteration)
        if self.num_workers == 0 or first:
            stream.epoch, stream.skip_batches = epoch, skip  # workers take a copy when they start...
        iterator = super().__iter__()
        if self.num_workers > 0:
            stream.epoch, stream.skip_batches = epoch + 1, 0  # ...and count epochs on their own from then on
        self._epoch, self._handed_out = epoch, skip
        return self._count(iterator)

    def _count(self, iterator: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for batch in iterator:
            self._handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """{"epoch", "batches" handed out in it, "epoch_done", "layout"}: called by Lightning at every checkpoint."""
        if self._epoch is None:  # not iterated yet: the state to start from
            epoch, batches = self._resume or (self.dataset.epoch, 0)  # type: ignore[attr-defined]
        else:
            epoch, batches = self._epoch, self._handed_out
        limit = min(len(self), self.epoch_limit()) if self.epoch_limit is not None else len(self)
        return {"epoch": epoch, "batches": batches, "epoch_done": batches >= limit, "layout": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s state: called by Lightning on resumption, before the first `iter()`.

        Raises:
            RuntimeError: if this loader has been iterated already.
            ValueError: if the state is mid-epoch and was saved under another layout (world size,
                workers, batch size, shuffle buffer, seed or shards), which orders the batches differently.
        """
        if self._epoch is not None or self._iterator is not None:
            raise RuntimeError("ResumableLoader.load_state_dict must be called before the loader is first iterated")
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if state["epoch_done"]:
            self._resume = (epoch + 1, 0)
            return
        if batches:
            saved = state.get("layout", {})
            changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in self._layout().items() if saved.get(k) != v]
            if changed:
                raise ValueError(
                    f"cannot resume the training data stream {batches} batches into epoch {epoch}: the checkpoint "
                    f"was saved with another batch order ({'; '.join(changed)}). Resume with the settings it was "
                    "saved with, or from a checkpoint saved at the end of an epoch"
                )
        self._resume = (epoch, batches)


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

    def train_dataloader(self) -> ResumableLoader:
        if self.train_stream is None:
            self.setup("fit")
        assert self.train_stream is not None
        trainer = self.trainer
        if trainer is None:
            return ResumableLoader(self.train_stream, self.config.num_workers)
        # Called after a checkpoint's loops are restored (setup runs before), as the epoch begins: the
        # epoch to run is the fit loop's processed count (current_epoch still lags it by one after a
        # checkpoint saved at an epoch's end). Lightning then hands a mid-epoch state to load_state_dict.
        self.train_stream.epoch = trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]
        return ResumableLoader(
            self.train_stream, self.config.num_workers, epoch_limit=lambda: trainer.num_training_batches
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.train_stream is None:
            self.setup("validate")
        return self._loader(self.val_stream) if self.val_stream is not None else []

    def _loader(self, stream: ShardStream | None) -> DataLoader:
        workers = self.config.num_workers
        return DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
