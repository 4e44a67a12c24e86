"""Shards are hashed once before training (`data.verify`): a stamp remembers what verified; changes re-verify.

A flipped byte inside a float16 feature, or a token id changed into another valid one, decodes cleanly
and passes every per-sample check the DataModule makes; only the manifest's sha256 sees it. These tests
damage exactly that, and check that training never starts on it (or skips the shard, under
on_error="skip"), that a clean dataset is hashed once and then trusted by its stamp, and that a
changed shard or manifest is hashed again.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pytest
from test_data_datamodule import IDENTITY, write_dataset
from test_training_fit import tiny_dataset, tiny_run_config  # noqa: F401 (a module fixture)

from data.data_config import DataConfig, SkippedSamplesWarning
from data.datamodule import FeatureDataModule
from data.shards import ShardError, load_manifest
from data.verify import STAMP_NAME, verify_shards
from training.fit import main

COUNTS = [3, 3, 2]


def flip_feature_byte(shard: Path, key: str = "000000000", field: str = "hidden") -> None:
    """Flip one byte inside a sample's float16 feature values (past the tar and .npy headers)."""
    data = bytearray(shard.read_bytes())
    header = data.find(f"{key}.{field}.npy".encode())
    assert header >= 0 and header % 512 == 0
    data[header + 512 + 128 + 7] ^= 0x10  # a mantissa/exponent bit of a finite value: still finite
    shard.write_bytes(bytes(data))


def module(folder: Path, on_error: str = "raise") -> FeatureDataModule:
    return FeatureDataModule(DataConfig(train_dir=str(folder), batch_size=2, on_error=on_error), target=IDENTITY)


def test_a_clean_dataset_is_hashed_once_then_trusted_until_a_shard_or_the_manifest_changes(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    manifest = write_dataset(folder, COUNTS)
    first = verify_shards(folder, manifest)
    assert len(first.hashed) == 3 and not first.trusted and not first.failed and first.bytes_hashed > 0
    assert first.stamp == folder / STAMP_NAME and first.stamp.is_file()
    second = verify_shards(folder, load_manifest(folder))
    assert not second.hashed and len(second.trusted) == 3 and "skipped" in second.summary()
    shard = folder / "shard-000001.tar"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # touched: re-hash it only
    third = verify_shards(folder, load_manifest(folder))
    assert third.hashed == ["shard-000001.tar"] and len(third.trusted) == 2
    (folder / "manifest.json").write_text((folder / "manifest.json").read_text() + "\n")  # any manifest edit
    assert len(verify_shards(folder, load_manifest(folder)).hashed) == 3


def test_a_flipped_feature_byte_decodes_cleanly_but_fails_verification_naming_the_shard(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    write_dataset(folder, COUNTS)
    shard = folder / "shard-000000.tar"
    flip_feature_byte(shard)
    unverified = FeatureDataModule(DataConfig(train_dir=str(folder), batch_size=2, verify=False), target=IDENTITY)
    unverified.setup("fit")
    assert sum(1 for _ in unverified.train_dataloader()) == 4  # the per-sample checks pass: this is sha256's job
    with pytest.raises(ShardError, match=r"shard-000000\.tar: sha256 .* differs from the manifest") as error:
        module(folder).setup("fit")
    assert "nothing was trained" in str(error.value) and "on_error=skip" in str(error.value)


def test_under_skip_a_failed_shard_becomes_padding_and_the_epoch_keeps_its_length(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    write_dataset(folder, COUNTS)
    flip_feature_byte(folder / "shard-000002.tar", key="000000006")
    data = module(folder, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data.setup("fit")
        batches = list(data.train_dataloader())
    messages = [str(w.message) for w in caught if issubclass(w.category, SkippedSamplesWarning)]
    assert any("failed verification" in m and "shard-000002.tar" in m for m in messages), messages
    assert len(batches) == 4  # 8 samples in batches of 2, as for the clean dataset
    keys = [key for batch in batches for key in batch["keys"] if key]
    assert sorted(keys) == [f"{i:09d}" for i in range(6)]  # shard 2's samples 6 and 7 never train
    assert sum(int(batch["sample_mask"].sum()) for batch in batches) == 6


def test_files_that_are_not_regular_files_or_leave_the_folder_are_refused_before_opening(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    manifest = write_dataset(folder, COUNTS)
    (folder / "shard-000000.tar").unlink()
    os.mkfifo(folder / "shard-000000.tar")  # open() would block forever
    outside = tmp_path / "elsewhere.tar"
    (folder / "shard-000001.tar").rename(outside)
    (folder / "shard-000001.tar").symlink_to(outside)
    inside = folder / "copies" / "shard-000002.tar"
    inside.parent.mkdir()
    (folder / "shard-000002.tar").rename(inside)
    (folder / "shard-000002.tar").symlink_to(inside)  # a link that stays inside the folder is a shard like any
    report = verify_shards(folder, manifest)
    assert sorted(report.failed) == ["shard-000000.tar", "shard-000001.tar"]
    assert "is not a regular file" in report.failed["shard-000000.tar"]
    assert "outside the dataset folder" in report.failed["shard-000001.tar"]


def test_the_stamp_falls_back_to_the_run_folder_where_the_dataset_is_not_writable(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "ds"
    manifest = write_dataset(folder, COUNTS)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != folder)  # as for a read-only mount
    report = verify_shards(folder, manifest, fallback_dir=tmp_path / "run")
    assert report.stamp is not None and report.stamp.parent == tmp_path / "run" and report.stamp.is_file()
    assert not (folder / STAMP_NAME).exists()
    assert len(verify_shards(folder, manifest, fallback_dir=tmp_path / "run").trusted) == 3


@pytest.mark.slow
def test_a_fit_stops_before_its_first_step_on_a_flipped_byte_and_a_second_clean_fit_skips_hashing(
    tiny_dataset: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_dataset, damaged)
    (damaged / STAMP_NAME).unlink(missing_ok=True)
    flip_feature_byte(damaged / "shard-000000.tar")
    (tmp_path / "a").mkdir()
    assert main(["--config", str(tiny_run_config(tmp_path / "a", damaged))]) == 2
    err = capsys.readouterr().err
    assert "shard-000000.tar: sha256" in err and "nothing was trained" in err
    assert not list((tmp_path / "a").rglob("model.safetensors")) and not list((tmp_path / "a").rglob("*.ckpt"))

    clean = tmp_path / "clean"
    shutil.copytree(tiny_dataset, clean)
    (clean / STAMP_NAME).unlink(missing_ok=True)
    for run in ("b", "c"):
        (tmp_path / run).mkdir()
        argv = ["--config", str(tiny_run_config(tmp_path / run, clean)), "--trainer.max_steps", "1"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        if run == "b":
            assert f"{clean}: verified 2 shards" in out
        else:
            assert f"{clean}: verified 0 shards" in out and "2 unchanged since their last verification" in out


def test_the_validator_and_the_reader_refuse_fifos_outside_links_and_bytes_past_the_archive_end(tmp_path: Path) -> None:
    from data.errors import DatasetError
    from data.shard_reader import iter_raw_samples
    from data.validate import validate_dataset

    folder = tmp_path / "ds"
    write_dataset(folder, COUNTS)
    fifo = folder / "shard-000000.tar"
    fifo.unlink()
    os.mkfifo(fifo)  # opening it would block until a writer came: refused from its mode, before open()
    with pytest.raises(ShardError, match=r"shard-000000.tar: is not a regular file \(a FIFO"):
        list(iter_raw_samples(fifo))
    link = folder / "shard-000001.tar"
    link.rename(tmp_path / "outside.tar")
    link.symlink_to("/dev/zero")  # read as a shard, it never ends
    tail = folder / "shard-000002.tar"
    tail.write_bytes(tail.read_bytes() + bytes(20 * 512))  # a whole record past the padding
    with pytest.raises(ShardError, match=r"holds 10240 bytes past its end-of-archive marker"):
        list(iter_raw_samples(tail, hashlib.sha256()))
    with pytest.raises(DatasetError) as error:
        validate_dataset(folder, progress=False)
    message = str(error.value)
    assert "shard-000000.tar: is not a regular file" in message
    assert "shard-000001.tar: is a symbolic link to /dev/zero, outside the dataset folder" in message
    assert "shard-000002.tar: holds 10240 bytes past its end-of-archive marker" in message


def test_a_copy_that_keeps_mtime_gets_a_new_inode_and_ctime_and_is_hashed_again(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "ds"
    write_dataset(folder, COUNTS)
    assert len(verify_shards(folder, load_manifest(folder)).hashed) == 3
    copy = Path(shutil.copytree(folder, tmp_path / "copy", copy_function=shutil.copy2))  # as cp -a / rsync -a
    for name in ("shard-000000.tar", "shard-000001.tar"):
        original, copied = (folder / name).stat(), (copy / name).stat()
        assert copied.st_mtime_ns == original.st_mtime_ns and copied.st_size == original.st_size
        assert copied.st_ino != original.st_ino
    report = verify_shards(copy, load_manifest(copy))  # the stamp came along, but it describes other files
    assert len(report.hashed) == 3 and not report.trusted and not report.failed
    assert len(verify_shards(copy, load_manifest(copy)).trusted) == 3  # the copy's own stamp vouches now


def test_shards_hash_on_several_threads_with_the_same_report(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    manifest = write_dataset(folder, [2] * 6)
    flip_feature_byte(folder / "shard-000004.tar", key="000000008")
    serial = verify_shards(folder, manifest, workers=1)
    (folder / STAMP_NAME).unlink()
    threaded = verify_shards(folder, manifest, workers=4)
    assert threaded.hashed == serial.hashed == [info.name for info in manifest.shards]  # manifest order
    assert threaded.failed == serial.failed and list(threaded.failed) == ["shard-000004.tar"]
    assert threaded.bytes_hashed == serial.bytes_hashed


def test_split_by_size_deals_shards_into_near_equal_shares() -> None:
    from data.verify import split_by_size

    sizes = {"a": 9, "b": 5, "c": 4, "d": 3, "e": 3, "f": 1}
    shares = split_by_size(list(sizes), sizes, 2)
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert [sum(sizes[n] for n in share) for share in shares] == [13, 12]
    assert split_by_size(["a"], sizes, 3) == [["a"], [], []]


def test_processes_hash_their_shares_and_every_one_reports_every_failure(tmp_path: Path) -> None:
    import threading

    from data.verify import verify_shards_shared

    folder = tmp_path / "ds"
    manifest = write_dataset(folder, [2] * 5)
    flip_feature_byte(folder / "shard-000003.tar", key="000000006")
    world, barrier, slots = 3, threading.Barrier(3), [None] * 3
    hashed_by: dict[int, list[str]] = {}
    reports: dict[int, object] = {}

    def all_gather(rank: int, obj: object) -> list[object]:
        barrier.wait()
        slots[rank] = obj
        barrier.wait()
        gathered = list(slots)
        barrier.wait()
        if isinstance(obj, dict):
            hashed_by[rank] = sorted(obj)
        return gathered

    def process(rank: int) -> None:
        reports[rank] = verify_shards_shared(folder, manifest, rank, world, lambda obj: all_gather(rank, obj))

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(name for names in hashed_by.values() for name in names) == [i.name for i in manifest.shards]
    assert all(len(names) <= 2 for names in hashed_by.values())  # 5 equal shards over 3 processes: 2, 2, 1
    for report in reports.values():
        assert list(report.failed) == ["shard-000003.tar"] and len(report.hashed) == 5  # type: ignore[attr-defined]
    assert len(verify_shards(folder, load_manifest(folder)).trusted) == 4  # rank 0 wrote the stamp


def test_the_stamp_is_written_through_the_one_write_atomic_with_host_and_pid_in_its_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import data.shards
    import inference.decoding.files as files

    assert data.shards.write_atomic is files.write_atomic  # one helper for the whole project
    folder = tmp_path / "ds"
    manifest = write_dataset(folder, COUNTS)
    renamed: list[tuple[str, str]] = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append((str(src), str(dst))), replace(src, dst)))
    verify_shards(folder, manifest)
    temporary = [Path(src).name for src, dst in renamed if Path(dst).name == STAMP_NAME]
    assert temporary == [f".{STAMP_NAME}.{files.host_name()}.{os.getpid()}.tmp"]
