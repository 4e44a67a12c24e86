"""Exact resume: a run interrupted mid-epoch and resumed with `ckpt_path` reproduces the uninterrupted
run's losses step for step (same batches, same noise, same optimizer and schedule state)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import build_tiny_toy_target
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from data.drafter_data import DrafterDataModule
from data.extract import ExtractConfig, run_extraction
from data.prompts import PromptSetConfig
from models import registry
from models.registry import shared_target
from training.objective import ObjectiveConfig
from training.system import DrafterSystem, OptimizerConfig

MAX_STEPS = 10
INTERRUPT_AT = 3  # mid-epoch: 12 samples, batch 2 -> 6 steps per epoch; resumed runs cross an epoch boundary


class SimulatedCrash(RuntimeError):
    pass


class Recorder(Callback):
    """Records (global step, loss, keys) of every training step; optionally crashes after a step."""

    def __init__(self, crash_after: int | None = None) -> None:
        self.steps: dict[int, tuple[float, list[str]]] = {}
        self.crash_after = crash_after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[trainer.global_step] = (float(outputs["loss"]), list(batch["keys"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.crash_after is not None and trainer.global_step >= self.crash_after:
            raise SimulatedCrash(f"interrupted before step {trainer.global_step + 1}")


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    registry.TARGET_LOADERS["tiny-toy"] = lambda **kwargs: build_tiny_toy_target()
    shared_target.cache_clear()
    folder = tmp_path_factory.mktemp("resume") / "shards"
    config = ExtractConfig(
        out_dir=str(folder),
        prompts=PromptSetConfig(source="toy", count=12),
        samples_per_shard=4,
        batch_size=4,
        seed=3,
        store_aux=True,
        store_uncond=False,
    )
    run_extraction(config, target=shared_target("tiny-toy"), rank=0, world_size=1, progress=False)
    yield folder
    registry.TARGET_LOADERS.pop("tiny-toy", None)
    shared_target.cache_clear()


def fit(folder, ckpt_dir, callback: Recorder, ckpt_path=None) -> None:
    torch.manual_seed(0)
    system = DrafterSystem(
        target="tiny-toy",
        architecture="eagle3",
        preset="tiny",
        objective=ObjectiveConfig(ttt_steps=2, noise_std=0.1),  # noise: the per-step generator must resume too
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2, schedule="cosine"),
    )
    data = DrafterDataModule(train_dir=str(folder), batch_size=2, shuffle_buffer=4, target="tiny-toy")
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[checkpoint, callback],
    )
    trainer.fit(system, datamodule=data, ckpt_path=ckpt_path)


def test_resumed_run_reproduces_the_uninterrupted_losses(tiny_dataset, tmp_path):
    whole = Recorder()
    fit(tiny_dataset, tmp_path / "whole", whole)
    assert sorted(whole.steps) == list(range(1, MAX_STEPS + 1))

    first = Recorder(crash_after=INTERRUPT_AT)
    with pytest.raises(SimulatedCrash):
        fit(tiny_dataset, tmp_path / "parts", first)
    assert sorted(first.steps) == list(range(1, INTERRUPT_AT + 1))
    second = Recorder()
    fit(tiny_dataset, tmp_path / "parts", second, ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert sorted(second.steps) == list(range(INTERRUPT_AT + 1, MAX_STEPS + 1))

    for step, (loss, keys) in second.steps.items():
        expected_loss, expected_keys = whole.steps[step]
        assert keys == expected_keys, f"step {step}: resumed run read other samples"
        assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6), f"step {step}"
    losses = [whole.steps[s][0] for s in sorted(whole.steps)]
    assert len(set(losses)) == len(losses)  # the check compares something that changes


def test_reduced_vocabulary_is_counted_on_the_shards_and_a_stale_map_is_refused(tiny_dataset, tmp_path):
    from training.vocab import count_image_tokens, dataset_fingerprint

    def system(vocab_dir: Path) -> DrafterSystem:
        return DrafterSystem(target="tiny-toy", architecture="eagle3", preset="tiny", drafter={"draft_vocab_size": 16},
                             objective=ObjectiveConfig(ttt_steps=2), vocab_dir=str(vocab_dir))  # fmt: skip

    def trainer(steps: int) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
        return L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[checkpoint])  # fmt: skip

    first = system(tiny_dataset)
    trainer(2).fit(first, datamodule=DrafterDataModule(train_dir=str(tiny_dataset), batch_size=2, target="tiny-toy"))
    counts = count_image_tokens(tiny_dataset, progress=False)
    kept = torch.arange(16) + first.drafter.d2t
    assert first.drafter.t2d.sum() == 16 and first.drafter.t2d[kept].all()
    assert counts[kept].min() >= counts[~first.drafter.t2d].max()  # the 16 most frequent tokens
    assert first.drafter.config.vocab_map_key == dataset_fingerprint(tiny_dataset)

    other = tmp_path / "other"  # different data: same target, other prompts
    config = ExtractConfig(out_dir=str(other), prompts=PromptSetConfig(source="toy", count=4, seed=9),
                           samples_per_shard=4, batch_size=4, seed=5, store_aux=True)  # fmt: skip
    run_extraction(config, target=shared_target("tiny-toy"), rank=0, world_size=1, progress=False)
    data = DrafterDataModule(train_dir=str(other), batch_size=2, target="tiny-toy")
    with pytest.raises(ValueError, match="counted on another dataset"):
        trainer(4).fit(system(other), datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
