"""Which samples each rank and worker reads in an epoch, in batches, and where a resumed epoch continues.

Pure functions of counts (see `data.datamodule`'s docstring, "Resuming mid-epoch").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from data.shards import (
    ShardInfo,
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
