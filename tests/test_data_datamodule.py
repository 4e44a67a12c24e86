"""The streaming DataModule: epoch plans, exactly-once splitting, shuffling, collation, refusals and errors."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from data.data_config import DataConfig, SkippedSamplesWarning
from data.datamodule import FeatureDataModule
from data.epoch_plan import batches_per_rank, plan_epoch
from data.fp8 import FP8_DTYPE, quantize_rows, scale_member
from data.shard_reader import BufferPool
from data.shard_stream import ShardStream, collate_samples
from data.shards import (
    MANIFEST_NAME,
    FieldSpec,
    Manifest,
    ShardError,
    ShardInfo,
    ShardWriter,
    TargetIdentity,
    load_manifest,
    sample_key,
    shard_name,
    write_atomic,
)

IDENTITY = TargetIdentity(
    name="tiny",
    family="llamagen",
    hidden_size=8,
    num_layers=2,
    aux_layer_ids=(0, 1, 1),
    image_vocab_size=64,
    grid=(2, 3),
    prefix_length=4,
)


def write_dataset(
    folder, counts: list[int], lengths=lambda index: 6, optional=("aux",), dtype: str = "float16"
) -> Manifest:
    """Shards holding `counts` samples; sample i has lengths(i) tokens and hidden[t] = i + t / 100.

    `optional` lists the optional fields to store: aux is all ones, uncond_hidden is -hidden and
    uncond_aux is all twos. `dtype` is every feature's: float16, or float8_e4m3fn (the float16 values
    quantised, with their `<field>_scale` members, as extraction writes them).
    """
    folder.mkdir(parents=True, exist_ok=True)
    width = IDENTITY.hidden_size
    widths = {"aux": 3 * width, "uncond_hidden": width, "uncond_aux": 3 * width}
    fields = {"tokens": FieldSpec("int16", None), "hidden": FieldSpec(dtype, width)}
    fields.update({name: FieldSpec(dtype, widths[name]) for name in optional})
    manifest = Manifest(
        target=IDENTITY,
        sampling={},
        prompts={},
        fields=fields,
        num_tokens=6,
        samples_per_shard=max(counts),
        num_samples=sum(counts),
    )
    for shard, count in enumerate(counts):
        writer = ShardWriter(folder / shard_name(shard))
        first = sum(counts[:shard])
        for index in range(first, first + count):
            length = lengths(index)
            hidden = (index + np.arange(length)[:, None] / 100 + np.zeros(width)).astype(np.float16)
            extra = {
                "aux": np.ones((length, 3 * width), np.float16),
                "uncond_hidden": -hidden,
                "uncond_aux": np.full((length, 3 * width), 2, np.float16),
            }
            arrays = {"tokens": np.full(length, index % 64, np.int16), "hidden": hidden}
            arrays.update({name: extra[name] for name in optional})
            if dtype == FP8_DTYPE:
                arrays = {"tokens": arrays["tokens"]} | {
                    member: stored
                    for name, array in arrays.items()
                    if name != "tokens"
                    for member, stored in zip((name, scale_member(name)), quantize_rows(array), strict=True)
                }
            meta = {"index": index, "prompt_id": f"p:{index}", "prompt": f"prompt {index}", "seed": 0, "length": length}
            writer.write(sample_key(index), arrays, meta)
        manifest.shards.append(writer.commit(first_index=first))
    write_atomic(folder / MANIFEST_NAME, manifest.to_json())
    return manifest


def epoch_keys(stream: ShardStream) -> list[list[str]]:
    return [batch["keys"] for batch in stream]


def stream(folder, rank=0, world_size=1, shuffle=True, start_epoch=0, **config) -> ShardStream:
    manifest = load_manifest(folder)
    config = DataConfig(train_dir=str(folder), **{"batch_size": 3, "shuffle_buffer": 4, **config})
    return ShardStream(
        folder,
        manifest,
        manifest.shards,
        config,
        shuffle=shuffle,
        rank=rank,
        world_size=world_size,
        start_epoch=start_epoch,
    )


@pytest.mark.parametrize("counts", [[7, 7, 7, 2], [5], [1, 9, 3], [4, 4, 4, 4, 4]])
@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 1)])
def test_epoch_plan_covers_every_sample_once_with_equal_rows_per_rank(counts, world_size, num_workers):
    shards = [ShardInfo(shard_name(i), c, "", 0, sum(counts[:i])) for i, c in enumerate(counts)]
    for epoch in range(2):
        seen, rows = collections.Counter(), []
        for rank in range(world_size):
            rank_rows = 0
            for worker in range(num_workers):
                plan = plan_epoch(
                    shards,
                    epoch=epoch,
                    seed=1,
                    shuffle=True,
                    rank=rank,
                    world_size=world_size,
                    worker=worker,
                    num_workers=num_workers,
                )
                for segment in plan:
                    rank_rows += segment.stop - segment.start
                    if segment.shard is not None:
                        seen.update(segment.shard.first_index + i for i in range(segment.start, segment.stop))
            rows.append(rank_rows)
        assert sorted(seen) == list(range(sum(counts))) and set(seen.values()) == {1}
        assert len(set(rows)) == 1  # padded to equal


def test_uneven_ranks_see_each_sample_once_in_equal_batch_counts(tmp_path):
    write_dataset(tmp_path, [7, 7, 7, 2])  # 23 samples on 2 ranks: 12 rows each, one padding row
    for epoch in range(2):
        keys, counts = collections.Counter(), []
        for rank in range(2):
            batches = epoch_keys(stream(tmp_path, rank=rank, world_size=2, start_epoch=epoch))
            counts.append(len(batches))
            keys.update(k for batch in batches for k in batch)
        assert counts == [4, 4] == [batches_per_rank(23, world_size=2, num_workers=0, batch_size=3)] * 2
        assert keys.pop("") == 1 and set(keys.values()) == {1} and len(keys) == 23


def test_seed_epoch_and_rank_fix_the_order_and_epochs_differ(tmp_path):
    write_dataset(tmp_path, [5, 5, 5])
    assert epoch_keys(stream(tmp_path, seed=1)) == epoch_keys(stream(tmp_path, seed=1))
    assert epoch_keys(stream(tmp_path, seed=1)) != epoch_keys(stream(tmp_path, seed=2))
    running = stream(tmp_path, seed=1)
    first, second = epoch_keys(running), epoch_keys(running)  # each iteration is a new epoch
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    assert epoch_keys(stream(tmp_path, seed=1, start_epoch=1)) == second  # resuming at epoch 1 replays it
    unshuffled = sum(epoch_keys(stream(tmp_path, shuffle=False)), [])
    assert unshuffled == [sample_key(i) for i in range(15)]


def test_workers_split_the_rank_and_keep_epochs_apart(tmp_path):
    write_dataset(tmp_path, [5, 4, 3])
    data = stream(tmp_path, num_workers=2)
    loader = DataLoader(data, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = [[k for batch in loader for k in batch["keys"]] for _ in range(2)]
    assert len(loader) == len(data) == 4
    for keys in epochs:
        assert sorted(keys) == [sample_key(i) for i in range(12)]
    assert epochs[0] != epochs[1]


def test_collate_pads_to_the_longest_with_a_loss_mask(tmp_path):
    """Datasets hold num_tokens rows per sample (the reader refuses others); collation still pads shorter rows."""
    write_dataset(tmp_path, [3])
    data = stream(tmp_path, shuffle=False)
    samples = [next(iter(data._read_segment([i], data.shards[0], [], BufferPool()))) for i in range(3)]
    for sample, length in zip(samples, [2, 6, 4], strict=True):
        for name in data.fields:
            sample[name] = sample[name][:length]
    batch = collate_samples(samples, data.fields, num_tokens=6)
    assert batch["tokens"].shape == (3, 6) and batch["hidden"].shape == (3, 6, 8) and batch["aux"].shape == (3, 6, 24)
    assert batch["hidden"].dtype == torch.float16 and batch["tokens"].dtype == torch.int64
    assert batch["lengths"].tolist() == [2, 6, 4]
    assert batch["loss_mask"].sum(1).tolist() == [2, 6, 4]
    assert batch["hidden"][0, 2:].abs().sum() == 0 and batch["hidden"][2, 3, 0].item() == pytest.approx(2.03, abs=1e-2)
    padded = collate_samples([None], data.fields, num_tokens=6)
    assert padded["sample_mask"].tolist() == [False] and not padded["loss_mask"].any()
    assert padded["hidden"].shape == (1, 6, 8) and padded["hidden"].abs().sum() == 0


def test_datamodule_refuses_another_targets_dataset_naming_both(tmp_path):
    write_dataset(tmp_path, [3, 3])
    other = dataclasses.replace(IDENTITY, hidden_size=16, name="other")
    datamodule = FeatureDataModule(DataConfig(train_dir=str(tmp_path)), target=other)
    with pytest.raises(ValueError, match=r"name: 'tiny' vs 'other'; hidden_size: 8 vs 16"):
        datamodule.setup("fit")


def test_datamodule_holds_out_val_shards_and_checks_fields(tmp_path):
    write_dataset(tmp_path, [4, 4, 2])
    datamodule = FeatureDataModule(DataConfig(train_dir=str(tmp_path), num_val_shards=1, batch_size=2), IDENTITY)
    datamodule.setup("fit")
    val = [k for batch in datamodule.val_dataloader() for k in batch["keys"]]
    train = [k for batch in datamodule.train_dataloader() for k in batch["keys"]]
    assert val == ["000000008", "000000009"] and sorted(train) == [sample_key(i) for i in range(8)]
    with pytest.raises(ValueError, match=r"no \['uncond_hidden'\] features"):
        FeatureDataModule(DataConfig(train_dir=str(tmp_path), load_uncond=True), IDENTITY).setup("fit")


def test_unconditional_features_load_with_uncond_aux_when_present(tmp_path):
    everything = ("aux", "uncond_hidden", "uncond_aux")
    write_dataset(tmp_path / "new", [3], optional=everything)
    write_dataset(tmp_path / "old", [3], optional=("aux", "uncond_hidden"))  # extracted before uncond_aux existed
    cases = [
        ("new", dict(load_uncond=True), {"aux", "uncond_hidden", "uncond_aux"}),
        ("new", dict(load_uncond=True, load_aux=False), {"uncond_hidden"}),
        ("new", dict(), {"aux"}),
        ("old", dict(load_uncond=True), {"aux", "uncond_hidden"}),
    ]
    for folder, settings, expected in cases:
        data = stream(tmp_path / folder, shuffle=False, **settings)
        assert set(data.fields) == {"tokens", "hidden"} | expected, (folder, settings)
        batch = next(iter(data))
        assert set(everything) & set(batch) == expected
    batch = next(iter(stream(tmp_path / "new", shuffle=False, load_uncond=True)))
    assert batch["uncond_aux"].shape == (3, 6, 24) and batch["uncond_aux"].dtype == torch.float16
    assert (batch["uncond_aux"] == 2).all() and torch.equal(batch["uncond_hidden"], -batch["hidden"])


def test_truncated_shard_raises_naming_it(tmp_path):
    manifest = write_dataset(tmp_path, [4, 4])
    path = tmp_path / manifest.shards[1].name
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ShardError, match=r"shard-000001.tar: truncated.*on_error='skip'"):
        list(stream(tmp_path, shuffle=False))


def test_skip_policy_warns_pads_and_counts(tmp_path, caplog):
    manifest = write_dataset(tmp_path, [4, 4])
    path = tmp_path / manifest.shards[1].name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the second shard's later samples are lost
    data_stream = stream(tmp_path, shuffle=False, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(data_stream)
    assert len(batches) == len(data_stream) == 3  # the batch count never changes: DDP stays in step
    real = [k for batch in batches for k in batch["keys"] if k]
    skipped = sum(not m for batch in batches for m in batch["sample_mask"].tolist())
    assert len(real) + skipped == 8 and 0 < skipped < 4
    messages = [str(w.message) for w in caught if issubclass(w.category, SkippedSamplesWarning)]
    assert any("shard-000001.tar" in m for m in messages)
    assert any(f"skipped {skipped} of 8 samples" in m for m in messages)  # the end-of-epoch count
    assert f"skipped {skipped} of 8 samples" in caplog.text


def test_a_reordered_shard_is_caught(tmp_path):
    manifest = write_dataset(tmp_path, [3, 3])
    manifest.shards[0], manifest.shards[1] = manifest.shards[1], manifest.shards[0]  # names swapped
    manifest.shards[0] = dataclasses.replace(manifest.shards[0], first_index=0)
    manifest.shards[1] = dataclasses.replace(manifest.shards[1], first_index=3)
    write_atomic(tmp_path / MANIFEST_NAME, manifest.to_json())
    with pytest.raises(ShardError, match="found sample 000000003 where the manifest puts 000000000"):
        list(stream(tmp_path, shuffle=False))


def test_lightning_fit_consumes_every_batch_without_val_data(tmp_path):
    import lightning as L

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 1)
            self.keys: list[str] = []

        def training_step(self, batch, batch_index):
            self.keys += [k for k in batch["keys"] if k]
            mask = batch["loss_mask"].float()
            return (self.linear(batch["hidden"].float()).squeeze(-1) ** 2 * mask).sum() / mask.sum().clamp_min(1)

        def validation_step(self, batch, batch_index):
            raise AssertionError("there is no validation data")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    write_dataset(tmp_path, [4, 3])
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(probe, datamodule=FeatureDataModule(DataConfig(train_dir=str(tmp_path), batch_size=2), IDENTITY))
    assert trainer.num_training_batches == 4 and sorted(probe.keys) == sorted([sample_key(i) for i in range(7)] * 2)
    assert probe.keys[:7] != probe.keys[7:]  # the second epoch was shuffled anew


def test_batch_memory_is_reused_only_when_no_tensor_refers_to_it():
    pool = BufferPool()
    fields = {"tokens": FieldSpec("int16", None), "hidden": FieldSpec("float16", 8)}
    sample = {"__key__": "k", "meta": {}, "tokens": np.ones(6, np.int16), "hidden": np.ones((6, 8), np.float16)}
    first = collate_samples([sample, None], fields, 6, pool)
    kept = first["hidden"][0]  # a view that outlives its batch
    del first
    second = collate_samples([None, sample], fields, 6, pool)
    assert kept.sum().item() == 8 * 6  # untouched by the second batch
    assert second["hidden"][0].abs().sum() == 0 and second["hidden"][1].sum().item() == 8 * 6
    owned = len(pool.owned)
    del second, kept
    collate_samples([sample], fields, 6, pool)
    assert len(pool.owned) == owned  # everything was free again: nothing new allocated
