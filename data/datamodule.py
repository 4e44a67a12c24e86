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
   counts (uneven shards otherwise hang or crash DDP: docs/architecture.md, section "Even batches on every rank").
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

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from data.data_config import DataConfig, SkippedSamplesWarning
from data.shard_stream import ShardStream
from data.shards import ShardError, TargetIdentity, load_manifest
from data.verify import verify_shards


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


def settle_failed_shards(failed: dict[str, str], on_error: str) -> dict[str, str]:
    """Shards that failed verification (path -> problem): raise under on_error="raise", else warn and skip them.

    Raises:
        ShardError: naming every failed shard, before anything trains.
    """
    if failed and on_error == "raise":
        raise ShardError(
            f"{len(failed)} shard(s) failed verification before training, nothing was trained:\n  "
            + "\n  ".join(failed.values())
            + "\n(set data.on_error=skip to train without them)"
        )
    for problem in failed.values():
        warnings.warn(f"skipping a shard that failed verification: {problem}", SkippedSamplesWarning, stacklevel=3)
    return failed


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
        self._verified: set[str] = set()

    def verify_datasets(self) -> dict[str, str]:
        """Hash the train (and val) shards the stamp does not vouch for (`data.verify`): shard path -> problem.

        Raises:
            ShardError: naming every failed shard, under on_error="raise", before anything trains.
        """
        failed: dict[str, str] = {}
        folders = [self.config.train_dir] + ([self.config.val_dir] if self.config.val_dir else [])
        for folder in folders:
            report = verify_shards(folder, load_manifest(folder), fallback_dir=self._run_dir())
            rank, _ = _rank_and_world(self.trainer)
            if rank == 0 and (report.hashed or report.failed or folder not in self._verified):
                print(f"{folder}: {report.summary()}")
            self._verified.add(folder)
            failed.update({str(Path(folder) / name): problem for name, problem in report.failed.items()})
        return settle_failed_shards(failed, self.config.on_error)

    def _run_dir(self) -> str | None:
        """Where a stamp goes when the dataset folder is read-only: the logger's run folder (no collective call)."""
        if self.trainer is None:
            return None
        logger = self.trainer.logger
        return getattr(logger, "log_dir", None) or self.trainer.default_root_dir

    def setup(self, stage: str | None = None) -> None:
        config = self.config
        manifest = load_manifest(config.train_dir)
        manifest.check_target(self.target, source=str(Path(config.train_dir) / "manifest.json"))
        failed = self.verify_datasets() if config.verify else {}
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
        self.train_stream.failed_shards = failed
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
            self.val_stream.failed_shards = failed

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
        if stream is None:
            raise RuntimeError("the DataModule's streams are built in setup(); call setup() before asking for loaders")
        workers = self.config.num_workers
        return DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
