"""`ShardStream`: the IterableDataset that streams decoded, checked and collated batches out of shards."""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from data.data_config import DataConfig, SkippedSamplesWarning
from data.epoch_plan import Segment, plan_epoch, resume_point, worker_batches
from data.fp8 import FP8_DTYPE, dequantize_rows, scale_member
from data.shard_reader import BufferPool, decode_sample, iter_raw_samples
from data.shards import (
    FEATURE_FIELDS,
    MANIFEST_NAME,
    FieldSpec,
    Manifest,
    ManifestError,
    SampleError,
    ShardError,
    ShardInfo,
    sample_key,
)

log = logging.getLogger(__name__)


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
        tokens (B, L) int64; every float field (B, L, width) in its stored dtype, float16 for a
        float8_e4m3fn field (codes * row scales, `data.fp8.dequantize_rows`); loss_mask (B, L) bool;
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
            if sample is not None and length and spec.dtype == FP8_DTYPE:  # codes * row scales, into float16
                dequantize_rows(sample[name], sample[scale_member(name)], out=view[row, :length])
            elif sample is not None and length:
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
_TORCH_DTYPES[FP8_DTYPE] = torch.float16  # the batch dtype: dequantised on collation


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
        source = str(Path(folder) / MANIFEST_NAME)
        manifest.check_consistent(source)  # widths, counts, and sample ranges that overlap (keys would repeat)
        self.online_fields: list[str] = []
        """Streams the training step computes from the tokens (data.features: online), in FEATURE_FIELDS order."""
        if config.features == "online":
            if config.load_uncond and config.load_aux:
                wanted.add("uncond_aux")
            self.online_fields = [name for name in FEATURE_FIELDS if name in wanted - {"tokens"}]
            wanted = {"tokens"}
        elif manifest.features == "tokens":
            raise ManifestError(
                f"{source}: the dataset holds image tokens only (extracted with features: tokens), and "
                f"data.features is {config.features!r}: train it with --data.features online (the target "
                "recomputes the features in the training step), or extract with --features full"
            )
        missing = sorted(wanted - set(manifest.fields))
        if missing:
            raise ManifestError(
                f"{source}: the dataset has no {missing} features (it holds {sorted(manifest.fields)}); "
                "set load_aux / load_uncond to false or re-extract with store_aux / store_uncond"
            )
        if config.load_uncond and config.load_aux and not self.online_fields:
            if "uncond_aux" in manifest.fields:
                wanted.add("uncond_aux")  # optional: datasets extracted before it existed lack it
            elif shards and _first_sample_holds(Path(folder) / shards[0].name, "uncond_aux.npy"):
                raise ManifestError(
                    f"{source}: 'fields' lacks 'uncond_aux', but {shards[0].name} holds it, and load_uncond with "
                    "load_aux reads it: the manifest was edited or written by another version; rewrite it with "
                    f"`python -m data.extract --merge {folder}` or re-extract"
                )
        if not shards:
            raise ManifestError(f"{source}: no shards to read (check num_val_shards against its shard count)")
        self.folder, self.manifest, self.shards, self.config = Path(folder), manifest, shards, config
        self.fields = {name: manifest.fields[name] for name in FEATURE_FIELDS if name in wanted}
        scales = {f"{scale_member(name)}.npy" for name, spec in self.fields.items() if spec.dtype == FP8_DTYPE}
        self.suffixes = {"json"} | {f"{name}.npy" for name in self.fields} | scales
        self.shuffle, self.rank, self.world_size, self.epoch = shuffle, rank, world_size, start_epoch
        self.skip_batches = 0
        """Batches of the next epoch (in DataLoader order) that a resumed run has already trained on:
        the next iteration leaves them out, without reading their samples, then this returns to 0."""
        self.num_samples = sum(s.num_samples for s in shards)
        self.failed_shards: dict[str, str] = {}
        """Shard path -> why it failed verification (on_error="skip": its samples become masked padding rows)."""
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
        if self.online_fields:
            batch["online_fields"] = list(self.online_fields)  # training/online_features.py fills them in
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
        for _ in rows:  # run the last shard's end check (nothing after its last sample); only padding is left
            pass

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
        """The samples at `positions` (ascending, 0 = the shard's first) of one shard, None for unreadable ones.

        Every sample's key must be the one the manifest gives its position (so keys are unique: the
        manifest's sample ranges do not overlap), and the reader of a shard's last sample checks that
        nothing follows it, so each shard holds exactly the manifest's count.
        """
        path = str(self.folder / info.name)
        if path in self.failed_shards:  # its bytes differ from the manifest's sha256: none of them train
            self._skip(ShardError(self.failed_shards[path]), len(positions), info.name, skipped)
            yield from [None] * len(positions)
            return
        start, stop = positions[0], positions[-1] + 1
        raws = iter_raw_samples(
            path,
            start=start,
            stop=stop,
            suffixes=self.suffixes,
            pool=pool,
            positions=None if stop - start == len(positions) else set(positions),
            num_samples=info.num_samples,
        )
        vocab_size = self.manifest.target.image_vocab_size
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
                sample = decode_sample(raw, self.fields, self.manifest.num_tokens, path, vocab_size)
                sample["__buffers__"] = raw.get("__buffers__", [])
                yield sample
            except SampleError as error:  # this sample only
                self._skip(error, 1, info.name, skipped)
                yield None
        if stop == info.num_samples:  # the shard's end: read on to its end-of-archive marker
            try:
                next(raws, None)
            except ShardError as error:  # too many samples, or a damaged tail: the samples read are fine
                self._skip(error, 0, info.name, skipped)

    def _skip(self, error: ShardError, count: int, shard: str, skipped: list[str]) -> None:
        """Raise under on_error="raise"; else warn and count `count` samples of `shard` as skipped."""
        if self.config.on_error == "raise":
            raise type(error)(f"{error} (set on_error='skip' to train on without these samples)") from error
        what = f"skipping {count} sample(s)" if count else "ignoring (its samples read fine)"
        warnings.warn(f"{what}: {error}", SkippedSamplesWarning, stacklevel=2)
        skipped.extend([shard] * count)


def _first_sample_holds(path: Path, member: str) -> bool:
    """Whether the first sample of a shard (a regular file) has the member `member` (e.g. `uncond_aux.npy`)."""
    if not path.is_file():
        return False
    try:
        first = next(iter_raw_samples(path, stop=1), {})
    except ShardError:
        return False
    return member in first


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
