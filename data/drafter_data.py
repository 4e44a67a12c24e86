"""The DataModule `training/fit.py` builds from YAML: the feature stream plus extraction on first use.

    data = DrafterDataModule(train_dir="outputs/shards/toy", target="toy", num_val_shards=1)
    data = DrafterDataModule(train_dir="outputs/shards/toy-demo", extract_config="extract_toy",
                             extract_overrides={"prompts": {"count": 3072}})   # extracted when missing

`FeatureDataModule` (data/datamodule.py) takes a `DataConfig` and a loaded target's identity; this
subclass takes plain arguments (what LightningCLI and YAML configs give), loads the target only in
`setup` (building the module never loads a 7B model), and with `extract_config` runs the extraction
recipe once per node in `prepare_data` when `train_dir` has no manifest, so `python training/fit.py
--config demo` runs on a fresh machine. `resolve_config_path` finds configs by bare name in `configs/`.

Start-up, on every process (`setup`), before the target's weights load: the manifest's checkpoint against
the configured one (`models.checkpoint_identity`), then the shards' sha256 (`data.verify`, each process
hashing its share of what the stamp does not vouch for). The outcome is agreed across processes
(`agree_on_failure`), so a dataset error on one rank stops every rank with the same message.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from data.data_config import DataConfig
from data.datamodule import FeatureDataModule, ResumableLoader, settle_failed_shards
from data.errors import DatasetError
from data.extract_config import resolve_config_path
from data.manifest import MANIFEST_NAME, Manifest, load_manifest
from data.shards import TargetIdentity
from data.verify import default_workers, verify_shards, verify_shards_shared
from models.checkpoint_identity import checkpoint_identity
from models.registry import shared_target

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
"""The process-group timeout the real configs set explicitly (strategy `timeout: "0:30:00"`, quoted: YAML 1.1
reads an unquoted h:mm:ss such as 1:30:00 as a base-60 integer). Start-up never spends it on hashing (each
rank hashes its share and the ranks meet once the shares are done, about one shard's hashing apart); what it
must cover is the imbalance of every rank loading the target, of checkpoint writes and of validation, a few
minutes. Lightning's default (DDPStrategy, DeepSpeedStrategy) is the same 30 minutes; the configs state it so
that the value is read where the run is configured, not inherited from a library's default."""


class DrafterDataModule(FeatureDataModule):
    """The feature stream for drafter training, configured by plain arguments (for YAML / LightningCLI).

    With `extract_config` set, a missing dataset is extracted first (`prepare_data`, once per node),
    so `python training/fit.py --config demo` runs on a fresh machine.

    Args:
        train_dir, val_dir, num_val_shards, batch_size, num_workers, shuffle_buffer, seed, load_aux,
            load_uncond, features, verify, on_error: see `data.data_config.DataConfig`.
        target: registry name of the target the features must come from (linked to model.target by fit.py).
        target_options: its loader's keyword arguments (linked to model.target_options by fit.py).
        extract_config: extraction YAML to run when train_dir has no manifest.json; None = fail instead.
        extract_overrides: a mapping of that recipe's keys to override, nested or dotted, as in YAML:
            `{prompts: {count: 512}}` or `{prompts.count: 512}` (out_dir, target and target_options
            always come from this module).
    """

    def __init__(
        self,
        train_dir: str,
        val_dir: str | None = None,
        num_val_shards: int = 0,
        batch_size: int = 8,
        num_workers: int = 0,
        shuffle_buffer: int = 16,
        seed: int = 0,
        load_aux: bool = True,
        load_uncond: bool = False,
        features: str = "offline",
        verify: bool = True,
        on_error: str = "raise",
        target: str = "toy",
        target_options: dict[str, Any] | None = None,
        extract_config: str | None = None,
        extract_overrides: dict[str, Any] | list[str] | None = None,
    ) -> None:
        config = DataConfig(
            train_dir=train_dir,
            val_dir=val_dir,
            num_val_shards=num_val_shards,
            batch_size=batch_size,
            num_workers=num_workers,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
            load_aux=load_aux,
            load_uncond=load_uncond,
            features=features,
            verify=verify,
            on_error=on_error,
        )
        L.LightningDataModule.__init__(self)  # FeatureDataModule's init wants the target; it loads in setup
        self.config = config
        self.target = None  # type: ignore[assignment]
        self.train_stream = self.val_stream = None
        self._verified: set[str] = set()
        self.target_name = target
        self.target_options = dict(target_options or {})
        self.extract_config = extract_config
        if isinstance(extract_overrides, list):
            raise ValueError(
                f"data.extract_overrides={extract_overrides} is a list of key=value strings; it is a mapping now, "
                "as in YAML: extract_overrides: {prompts.count: 3072} (or {prompts: {count: 3072}})"
            )
        self.extract_overrides = dict(extract_overrides or {})
        self._prepare_error: BaseException | None = None
        self._verify_result: dict[str, str] | None = None
        self._agreement: RankAgreement | None = None
        self._manifests: dict[str, Manifest] = {}
        """Dataset folder -> its manifest, as the checkpoint check read it."""

    def target_placement(self) -> torch.device | None:
        """The trainer's root device (None without a trainer): the device `DrafterSystem` places the target on, so
        both load the one shared instance (`models.registry.shared_target`) on this process's GPU."""
        strategy = getattr(self.trainer, "strategy", None)
        return None if strategy is None else strategy.root_device

    def prepare_data(self) -> None:
        """Once per node (local rank 0), while the node's other processes wait: extract a missing dataset.

        Nothing here is hashed: verification runs in `setup`, where every process hashes its share. Under a
        process group an error is kept for `setup` to raise on every process at once (raised here, it would end
        this process alone and leave the others waiting at Lightning's next barrier).
        """
        try:
            self._extract_if_missing()
        except Exception as error:
            if _world_size(self.trainer) == 1:
                raise
            self._prepare_error = error

    def _extract_if_missing(self) -> None:
        manifest = Path(self.config.train_dir) / "manifest.json"
        if manifest.exists():
            return
        if self.extract_config is None:
            raise FileNotFoundError(
                f"{manifest} not found: extract features first (python -m data.extract --config ...) "
                "or set data.extract_config to extract them automatically"
            )
        from data.extract import load_config, run_extraction

        recipe = dict(self.extract_overrides)
        if self.config.features == "online":  # the training step computes the states: store tokens only
            recipe.setdefault("features", "tokens")
        overrides = [*dotted_overrides(recipe), f"out_dir={self.config.train_dir}",
                     f"target={self.target_name}", f"target_options={json.dumps(self.target_options)}"]  # fmt: skip
        config = load_config(resolve_config_path(self.extract_config), overrides)
        print(f"{manifest} is missing: extracting features with {self.extract_config} -> {config.out_dir}")
        target = shared_target(self.target_name, self.target_options, device=self.target_placement())
        checkpoint = checkpoint_identity(self.target_name, self.target_options)  # loaded: a hub id is cached now
        if run_extraction(config, target, rank=0, world_size=1, checkpoint=checkpoint) is None:
            raise RuntimeError(f"extraction into {config.out_dir} did not finish; rerun to resume it")

    def setup(self, stage: str | None = None) -> None:
        """Check the datasets against the configured checkpoint, verify their shards, then load the target.

        Every process runs it, in three steps whose outcome is agreed across processes (`agree_on_failure`):
        an error on any process is raised on every process with the same message, a `DatasetError` as a
        `DatasetError` (training/fit.py exits 2), so no process is left waiting for one that stopped. Each
        step either makes no collective call or makes all of its own before anything in it can raise, so the
        processes' collective calls always pair up.
        """
        trainer = self.trainer
        if self._agreement is None and _world_size(trainer) > 1:
            self._agreement = RankAgreement()  # every process creates its gloo group here, at the same point
        agreement = self._agreement
        if self.target is None:
            agree_on_failure(trainer, self._check_before_loading, agreement)  # no collective calls
            if self.config.verify:
                agree_on_failure(trainer, self._verify_step, agreement)  # its gathers come before anything raises
        agree_on_failure(trainer, lambda: self._load_and_set_up(stage), agreement)  # no collective calls

    def train_dataloader(self) -> ResumableLoader:
        """The training loader; under a process group each batch is agreed (`RankAgreement.batches`)."""
        loader = super().train_dataloader()
        if self._agreement is not None:
            loader.__class__ = _AgreedResumableLoader  # the same loader and state, its batches agreed
            loader.agreement = self._agreement  # type: ignore[attr-defined]
        return loader

    def val_dataloader(self) -> DataLoader | list:
        """The validation loader (or none); under a process group each batch is agreed."""
        loader = super().val_dataloader()
        if self._agreement is not None and isinstance(loader, DataLoader):
            loader.__class__ = _AgreedDataLoader
            loader.agreement = self._agreement  # type: ignore[attr-defined]
        return loader

    def _check_before_loading(self) -> None:
        error, self._prepare_error = self._prepare_error, None
        if error is not None:
            raise error
        self.check_checkpoints()  # before any weights load: a mismatch costs nothing

    def _verify_step(self) -> None:
        """Hash (each process its share), then raise under on_error="raise"; super().setup warns under skip."""
        if self._verify_result is None:
            self._verify_result = self._verify_all()
        if self.config.on_error == "raise":
            self.verify_datasets()

    def _load_and_set_up(self, stage: str | None) -> None:
        if self.target is None:  # loaded here, not in __init__: building the DataModule must not load a 7B model
            target = shared_target(self.target_name, self.target_options, device=self.target_placement())
            self.target = TargetIdentity.from_target(target)
        super().setup(stage)
        # DeepSpeed reads the micro-batch size from the loader's batch_sampler, which an iterable stream
        # (batch_size=None) lacks: state it before the strategy formats its config (which runs after setup).
        config = getattr(getattr(self.trainer, "strategy", None), "config", None)
        if isinstance(config, dict) and "zero_optimization" in config:
            config.setdefault("train_micro_batch_size_per_gpu", self.config.batch_size)

    def check_checkpoints(self) -> None:
        """Refuse a dataset whose manifest records other weights than target/target_options name (no loading).

        Raises:
            ManifestError: naming the dataset's checkpoint and the configured one.
        """
        configured = checkpoint_identity(self.target_name, self.target_options)
        for folder in self._folders():
            manifest = load_manifest(folder)
            manifest.check_checkpoint(configured, source=str(Path(folder) / MANIFEST_NAME))
            self._manifests[folder] = manifest  # verification hashes against this one: no reading in between

    def verify_datasets(self) -> dict[str, str]:
        """Hash the train (and val) shards the stamp does not vouch for, each process its share: path -> problem.

        Once per DataModule: a second call (a fit after a validate) returns the first one's result.

        Raises:
            ShardError: naming every failed shard, under on_error="raise", before anything trains.
        """
        if self._verify_result is None:
            self._verify_result = self._verify_all()
        failed = self._verify_result
        return settle_failed_shards(failed, self.config.on_error)

    def _verify_all(self) -> dict[str, str]:
        failed: dict[str, str] = {}
        trainer, world_size = self.trainer, _world_size(self.trainer)
        rank = trainer.global_rank if trainer is not None else 0
        workers = default_workers(trainer.num_devices if trainer is not None else 1)
        for folder in self._folders():
            manifest = self._manifests.get(folder) or load_manifest(folder)
            if world_size > 1:
                assert self._agreement is not None
                gather = self._agreement.all_gather
                report = verify_shards_shared(
                    folder, manifest, rank, world_size, gather, fallback_dir=self._run_dir(), workers=workers
                )
            else:
                report = verify_shards(folder, manifest, fallback_dir=self._run_dir(), workers=workers)
            if rank == 0:
                print(f"{folder}: {report.summary()}")
            failed.update({str(Path(folder) / name): problem for name, problem in report.failed.items()})
        return failed

    def _folders(self) -> list[str]:
        return [self.config.train_dir] + ([self.config.val_dir] if self.config.val_dir else [])


def _world_size(trainer: Any) -> int:
    """Processes of the job: the trainer's, when a process group is up; 1 otherwise."""
    if trainer is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return int(trainer.world_size)


class RankAgreement:
    """What every process of a job learns together: failures at start-up and while reading batches.

    Its collective calls go over a gloo group of all processes (CPU tensors: no GPU synchronisation, and the
    same on every backend), created by every process at once in `DrafterDataModule.setup`. Each call waits
    only until the slowest process arrives, which for the same work on every process is the imbalance
    between them, never the work itself.
    """

    def __init__(self) -> None:
        self.group = torch.distributed.new_group(backend="gloo")
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order."""
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def raise_agreed(self, error: BaseException | None, doing: str) -> None:
        """Gather every process's error (None: none) and raise one message everywhere if there is any.

        A `DatasetError` on every process when every failure was one (training/fit.py exits 2 on every rank);
        otherwise the failing process re-raises its own exception and the others a RuntimeError naming it.
        """
        outcome = None if error is None else (isinstance(error, DatasetError), f"{type(error).__name__}: {error}")
        outcomes = self.all_gather(outcome)
        failures = [(rank, found) for rank, found in enumerate(outcomes) if found is not None]
        if not failures:
            return
        by_message: dict[str, list[int]] = {}
        for rank, (_, message) in failures:
            by_message.setdefault(message, []).append(rank)
        text = "\n".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {self.world_size}: {message}"
            for message, ranks in by_message.items()
        )
        if all(dataset for _, (dataset, _) in failures):
            raise DatasetError(text) from error
        if error is not None:
            raise error
        raise RuntimeError(f"another process failed {doing}, so this one stops too:\n{text}")

    def run(self, step: Callable[[], None], doing: str) -> None:
        """Run `step` here; if it raised on any process, raise on every process (`raise_agreed`)."""
        error: BaseException | None = None
        try:
            step()
        except Exception as caught:
            error = caught
        self.raise_agreed(error, doing)

    def batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """`iterator`'s batches, each handed out once every process has its own (one small all-reduce each).

        A batch that fails to load on one process (a `SampleError` under data.on_error=raise, a worker that
        died) is raised on every process at that step, instead of leaving the others waiting in the step's
        gradient all-reduce. Every process runs the same number of batches per epoch (`data.epoch_plan`);
        an epoch that ends on some processes but not others is an error on all of them.
        """
        while True:
            batch, error, stopped = None, None, False
            try:
                batch = next(iterator)
            except StopIteration:
                stopped = True
            except Exception as caught:
                error = caught
            counts = torch.tensor([error is not None, stopped, error is None and not stopped], dtype=torch.int64)
            torch.distributed.all_reduce(counts, group=self.group)  # (failed, stopped, running) processes
            failed, ended, running = (int(count) for count in counts)
            if failed:
                self.raise_agreed(error, "while reading a batch")
            if ended and running:
                raise RuntimeError(
                    f"the data loader's epoch ended on {ended} of {self.world_size} processes and not on the "
                    "others; every rank must run the same number of batches (data.epoch_plan)"
                )
            if ended:
                return
            yield batch


def agree_on_failure(trainer: Any, step: Callable[[], None], agreement: RankAgreement | None = None) -> None:
    """Run `step` on every process; if it raised anywhere, raise on every process, with one message.

    Without a process group (or `agreement`), `step` runs and raises as it would.
    """
    if agreement is None or _world_size(trainer) == 1:
        step()
        return
    agreement.run(step, "while setting up the data")


class _AgreedResumableLoader(ResumableLoader):
    """A `ResumableLoader` whose batches are agreed across processes (`RankAgreement.batches`)."""

    agreement: RankAgreement

    def _count(self, iterator: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return super()._count(self.agreement.batches(iterator))


class _AgreedDataLoader(DataLoader):
    """A validation DataLoader whose batches are agreed across processes (`RankAgreement.batches`)."""

    agreement: RankAgreement

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self.agreement.batches(iter(super().__iter__()))


def dotted_overrides(values: dict[str, Any], prefix: str = "") -> list[str]:
    """A nested mapping as `key.sub=value` override strings: {prompts: {count: 8}} -> ["prompts.count=8"]."""
    overrides = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "target_options":
            overrides += dotted_overrides(value, f"{name}.")
        else:
            overrides.append(f"{name}={json.dumps(value)}")
    return overrides


__all__ = [
    "PROCESS_GROUP_TIMEOUT",
    "DrafterDataModule",
    "RankAgreement",
    "agree_on_failure",
    "dotted_overrides",
    "resolve_config_path",
]
