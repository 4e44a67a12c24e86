"""Exact mid-epoch resumption of the training stream: the loader's state, worker turns, and Lightning resumes."""

from __future__ import annotations

import itertools
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_data_datamodule import IDENTITY, stream, write_dataset

import data.shard_stream as shard_stream_module
from data.data_config import DataConfig
from data.datamodule import FeatureDataModule, ResumableLoader
from data.epoch_plan import resume_point


def batches_of(loader) -> list[list[str]]:
    return [batch["keys"] for batch in loader]


def test_resume_point_follows_the_dataloader_turns():
    counts = [3, 1, 2]  # turns: w0 w1 w2 | w0 w2 | w0
    turns = [0, 1, 2, 0, 2, 0]
    for consumed in range(len(turns) + 2):
        next_worker, done = resume_point(counts, consumed)
        assert done == [turns[:consumed].count(w) for w in range(3)]
        assert next_worker == (turns[consumed] if consumed < len(turns) else 0)
    assert resume_point([4], 3) == (0, [3])


@pytest.mark.parametrize("num_workers", [0, 3])
def test_a_resumed_loader_goes_on_exactly_where_the_state_was_saved(tmp_path, num_workers):
    """At every point of an epoch, save, resume in a fresh loader: the rest of the epoch and the next epoch match."""
    write_dataset(tmp_path, [5, 4, 4])  # 13 samples; 3 workers hold 4, 4 and 5 rows: 2, 2 and 3 batches of 2
    settings = dict(batch_size=2, shuffle_buffer=3, num_workers=num_workers, seed=5)
    reference = ResumableLoader(stream(tmp_path, **settings), num_workers)
    epochs = [batches_of(reference) for _ in range(2)]
    assert len(epochs[0]) == len(reference) == 7 and epochs[0] != epochs[1]
    for consumed in range(len(epochs[0]) + 1):
        interrupted = ResumableLoader(stream(tmp_path, **settings), num_workers)
        assert [b["keys"] for b in itertools.islice(iter(interrupted), consumed)] == epochs[0][:consumed]
        state = interrupted.state_dict()
        assert (state["epoch"], state["batches"], state["epoch_done"]) == (0, consumed, consumed == 7)
        resumed = ResumableLoader(stream(tmp_path, **settings), num_workers)
        resumed.load_state_dict(state)
        if consumed < 7:
            assert batches_of(resumed) == epochs[0][consumed:], consumed
        assert batches_of(resumed) == epochs[1], consumed  # and the epoch after it as usual


def test_skipped_batches_are_never_read(tmp_path, monkeypatch):
    write_dataset(tmp_path, [6, 6])
    settings = dict(batch_size=2, shuffle_buffer=4)
    epoch = batches_of(ResumableLoader(stream(tmp_path, **settings)))
    read: list[str] = []
    original = shard_stream_module.iter_raw_samples

    def recording(*args, **kwargs):
        for raw in original(*args, **kwargs):
            read.append(raw["__key__"])
            yield raw

    monkeypatch.setattr(shard_stream_module, "iter_raw_samples", recording)
    resumed = ResumableLoader(stream(tmp_path, **settings))
    resumed.load_state_dict({"epoch": 0, "batches": 4, "epoch_done": False, "layout": resumed._layout()})
    assert batches_of(resumed) == epoch[4:]
    assert sorted(read) == sorted(k for batch in epoch[4:] for k in batch)  # 4 of 12 samples read, not 12


def test_load_state_dict_refuses_another_batch_order_and_a_started_loader(tmp_path):
    write_dataset(tmp_path, [4, 4])
    saved = ResumableLoader(stream(tmp_path, batch_size=2))
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(ValueError, match=r"1 batches into epoch 0.*batch_size: 2 -> 3"):
        ResumableLoader(stream(tmp_path, batch_size=3)).load_state_dict(state)
    other = ResumableLoader(stream(tmp_path, batch_size=3))
    other.load_state_dict({**state, "batches": 0})  # an epoch's start: any layout will do
    assert len(batches_of(other)) == 3
    with pytest.raises(RuntimeError, match="before the loader is first iterated"):
        saved.load_state_dict(state)


class KeyRecorder(L.LightningModule):
    """A linear layer over the mean hidden state; records (epoch, batch_idx, keys) of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(IDENTITY.hidden_size, 1)
        self.steps: list[tuple[int, int, tuple[str, ...]]] = []

    def training_step(self, batch, batch_idx):
        self.steps.append((self.current_epoch, batch_idx, tuple(batch["keys"])))
        return self.linear(batch["hidden"].float().mean(dim=(0, 1))).square().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(folder, ckpt_dir=None, resume_from=None, num_workers=0, every_step=True, **limits) -> list[tuple]:
    """Train a KeyRecorder, checkpointing into ckpt_dir (if given) after every step or every epoch; its steps."""
    model = KeyRecorder()
    every = dict(every_n_train_steps=1) if every_step else dict(every_n_epochs=1)  # (the latter at the epoch's end)
    callbacks = [ModelCheckpoint(ckpt_dir, "{step}", save_top_k=-1, **every)] if ckpt_dir else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        **limits,
    )
    config = DataConfig(train_dir=str(folder), batch_size=2, shuffle_buffer=3, num_workers=num_workers, seed=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(does not have many workers|__len__. defined|callbacks used to create)")
        trainer.fit(model, datamodule=FeatureDataModule(config, IDENTITY), ckpt_path=resume_from)
    return model.steps


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_resume_sees_the_batches_an_uninterrupted_run_sees(tmp_path, num_workers):
    """Checkpoints mid-epoch, at an epoch's last batch and in a later epoch all resume onto the same batches."""
    write_dataset(tmp_path / "ds", [4, 5])  # 9 samples: 5 batches of 2 per epoch
    reference = fit(tmp_path / "ds", tmp_path / "ckpt", num_workers=num_workers, max_steps=13)
    assert len(reference) == 13 and [epoch for epoch, _, _ in reference] == [0] * 5 + [1] * 5 + [2] * 3
    assert reference[:5] != reference[5:10]  # the train stream is shuffled anew every epoch
    for step in (2, 5, 7):  # mid-epoch 0, after the last batch of epoch 0, mid-epoch 1
        checkpoint = tmp_path / "ckpt" / f"step={step}.ckpt"
        resumed = fit(tmp_path / "ds", resume_from=checkpoint, num_workers=num_workers, max_steps=13)
        assert resumed == reference[step:], step  # same epochs, batch indices and keys


def test_lightning_resume_from_an_end_of_epoch_checkpoint_starts_the_next_epochs_order(tmp_path):
    """Under max_epochs Lightning restores no loader state from a checkpoint saved at an epoch's end (its
    current_epoch then still names the finished epoch); the next epoch's order must come all the same."""
    write_dataset(tmp_path / "ds", [4, 3])  # 4 batches per epoch
    reference = fit(tmp_path / "ds", tmp_path / "ckpt", every_step=False, max_epochs=3)
    resumed = fit(tmp_path / "ds", resume_from=tmp_path / "ckpt" / "step=4.ckpt", max_epochs=3)
    assert resumed == reference[4:] and len(resumed) == 8
