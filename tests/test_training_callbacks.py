"""DecodeValidation: real tree decoding during training lands tau per rule and image grids in TensorBoard."""

from __future__ import annotations

import lightning as L
import pytest
from conftest import build_tiny_toy_target
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.drafter_data import DrafterDataModule
from data.extract import ExtractConfig, run_extraction
from data.prompts import PromptSetConfig
from models import registry
from models.registry import shared_target
from training.callbacks import DecodeValidation
from training.objective import ObjectiveConfig
from training.system import DrafterSystem, OptimizerConfig


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    registry.TARGET_LOADERS["tiny-toy"] = lambda **kwargs: build_tiny_toy_target()
    shared_target.cache_clear()
    folder = tmp_path_factory.mktemp("callbacks") / "shards"
    config = ExtractConfig(out_dir=str(folder), prompts=PromptSetConfig(source="toy", count=8), samples_per_shard=4,
                           batch_size=4, seed=3, store_aux=True, store_uncond=True)  # fmt: skip
    run_extraction(config, target=shared_target("tiny-toy"), rank=0, world_size=1, progress=False)
    yield folder
    registry.TARGET_LOADERS.pop("tiny-toy", None)
    shared_target.cache_clear()


def fit(folder, tmp_path, callback: DecodeValidation, monitor: str | None = None) -> L.Trainer:
    system = DrafterSystem(target="tiny-toy", architecture="eagle3", preset="tiny",
                           objective=ObjectiveConfig(ttt_steps=2), optimizer=OptimizerConfig(lr=1e-2))  # fmt: skip
    data = DrafterDataModule(train_dir=str(folder), num_val_shards=1, batch_size=2, target="tiny-toy", load_uncond=True)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=monitor, mode="max", save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, val_check_interval=2, check_val_every_n_epoch=None,
                        logger=TensorBoardLogger(tmp_path, name="run", version=""), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[callback, checkpoint])  # fmt: skip
    trainer.fit(system, datamodule=data)
    return trainer


def test_tau_per_rule_and_image_grids_land_in_the_event_files(tiny_dataset, tmp_path, capsys):
    callback = DecodeValidation(rules=["exact", "cascade"], num_prompts=2, top_k=2, depth=3, total_tokens=6)
    trainer = fit(tiny_dataset, tmp_path, callback, monitor="decode/tau_cascade")
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    for rule in ("exact", "cascade"):
        taus = [event.value for event in events.Scalars(f"decode/tau_{rule}")]
        assert len(taus) == 2  # one per validation (Lightning logs them at its own validation step numbers)
        assert all(1.0 <= tau <= 4.0 for tau in taus)  # 1 + at most depth accepted drafts per forward
        forwards = events.Scalars(f"decode/target_forwards_{rule}")[-1].value
        assert 1 + 16 / 4 <= forwards <= 16  # between a fully accepted depth-3 tree and AR's 16 forwards
    assert events.Scalars("decode/target_forwards_ar")[-1].value == 16  # prefill + 15 steps for 16 tokens
    grids = events.Images("decode/grid")
    assert [image.step for image in grids] == [2, 4] and grids[0].height > grids[0].width / 2 > 0
    assert "decode/grid" in tags["images"]
    assert "decode validation: 2 prompts x (2 rules + AR)" in capsys.readouterr().out
    best = trainer.checkpoint_callback.best_model_score  # ModelCheckpoint monitored the decoded tau
    assert best is not None and 1.0 <= float(best) <= 4.0


def test_decode_validation_can_be_switched_off(tiny_dataset, tmp_path):
    fit(tiny_dataset, tmp_path, DecodeValidation(every_n_validations=0))
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("decode/")]


def test_decode_validation_checks_its_rules_and_tree_when_built():
    with pytest.raises(ValueError, match="unknown; known rules: exact"):
        DecodeValidation(rules=["exact", "casacde"])
    with pytest.raises(ValueError, match="tree must be one of static"):
        DecodeValidation(tree="sampled")


def test_a_rank_without_prompts_reduces_the_same_keys_as_one_with_them(tiny_dataset, monkeypatch):
    """More ranks than prompts (8 prompts on 16 GPUs): every rank must enter the same all-reduce."""
    from types import SimpleNamespace

    system = DrafterSystem(target="tiny-toy", architecture="eagle3", preset="tiny")
    system.frozen_target = shared_target("tiny-toy")
    reduced: list[list[str]] = []  # the keys each rank put into the collective
    monkeypatch.setattr(
        DecodeValidation, "_all_reduce", staticmethod(lambda trainer, sums: reduced.append(sorted(sums)) or sums)
    )
    callback = DecodeValidation(rules=["exact", "cascade"], num_prompts=1, top_k=2, depth=2, total_tokens=4,
                                log_images=False)  # fmt: skip
    for rank in (0, 1):  # rank 0 decodes the single prompt, rank 1 none
        trainer = SimpleNamespace(global_rank=rank, world_size=2, is_global_zero=rank == 0)
        metrics = callback.evaluate(trainer, system)
        assert {"decode/tau_exact", "decode/tau_cascade", "decode/target_forwards_ar"} <= set(metrics)
    assert len(reduced) == 2 and reduced[0] == reduced[1], reduced
