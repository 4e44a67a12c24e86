"""Bad data never trains, and every corrupt input gets a named, actionable error.

NaN/Inf features and out-of-range token ids stop both the DataModule stream and `--validate`, naming
the shard, key and field; damaged tar headers, manifests and shards raise `DatasetError`s naming the
file (and field); `on_error="skip"` skips missing and unreadable shards with a warning naming them.
"""

from __future__ import annotations

import gzip
import json
import shutil
import warnings

import numpy as np
import pytest
from data_damage import edit_sample, header_offsets, read_shard, rewrite_shard, set_header_field, write_shard
from test_data_datamodule import IDENTITY, write_dataset

from data.data_config import DataConfig, SkippedSamplesWarning
from data.datamodule import FeatureDataModule
from data.extract import main
from data.shard_reader import decode_sample, iter_raw_samples, iter_tar_members, value_problem
from data.shards import (
    MANIFEST_NAME,
    DatasetError,
    ManifestError,
    ManifestNotFoundError,
    SampleError,
    ShardError,
    load_manifest,
)
from data.validate import validate_dataset

OPTIONAL = ("aux", "uncond_hidden")


def epoch(folder, **config) -> tuple[list[dict], list[str]]:
    """One training epoch through the DataModule: (batches, warning messages)."""
    values = {"batch_size": 2, "load_uncond": True, **config}
    datamodule = FeatureDataModule(DataConfig(train_dir=str(folder), **values), IDENTITY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(datamodule.train_dataloader())
    return batches, [str(w.message) for w in caught if issubclass(w.category, SkippedSamplesWarning)]


def assert_refused_everywhere(folder, capsys, pattern: str) -> None:
    """The stream (on_error="raise"), validate_dataset and the --validate CLI all report `pattern`."""
    with pytest.raises(SampleError, match=pattern):
        epoch(folder)
    with pytest.raises(DatasetError, match=pattern):
        validate_dataset(folder, progress=False)
    assert main(["--validate", str(folder), "--no-progress"]) == 1
    assert "sample 000000004" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["hidden", "aux", "uncond_hidden"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_feature_stops_stream_and_validate_naming_shard_key_and_field(tmp_path, capsys, field, value):
    write_dataset(tmp_path, [3, 3], optional=OPTIONAL)
    rewrite_shard(tmp_path, 1, edit_sample("000000004", lambda arrays, meta: arrays[field].__setitem__((2, 5), value)))
    pattern = rf"shard-000001.tar: sample 000000004, field '{field}': 1 non-finite values \(NaN/Inf\), the first at row 2, column 5"  # noqa: E501
    assert_refused_everywhere(tmp_path, capsys, pattern)
    batches, messages = epoch(tmp_path, on_error="skip")  # skip: the sample becomes a masked padding row
    keys = [k for batch in batches for k in batch["keys"] if k]
    assert sorted(keys) == [f"{i:09d}" for i in range(6) if i != 4] and any("000000004" in m for m in messages)
    assert all(batch["hidden"].isfinite().all() for batch in batches)


@pytest.mark.parametrize("token", [64, -1, 32767])
def test_an_out_of_range_token_stops_stream_and_validate_naming_shard_key_and_field(tmp_path, capsys, token):
    write_dataset(tmp_path, [3, 3], optional=OPTIONAL)
    rewrite_shard(tmp_path, 1, edit_sample("000000004", lambda arrays, meta: arrays["tokens"].__setitem__(2, token)))
    pattern = (
        rf"shard-000001.tar: sample 000000004, field 'tokens': 1 token id\(s\) outside the image vocabulary 0..63 "
        rf"\(the manifest's target.image_vocab_size\), the first {token} at position 2"
    )
    assert_refused_everywhere(tmp_path, capsys, pattern)
    from training.vocab import count_image_tokens  # the reduced draft vocabulary's count reads the same tokens

    with pytest.raises(DatasetError, match=r"shard-000001.tar: sample 000000004, field 'tokens': 1 token id\(s\)"):
        count_image_tokens(tmp_path, progress=False)


def test_value_checks_are_vectorised_and_locate_the_first_bad_value():
    hidden = np.zeros((4, 8), np.float16)
    assert value_problem(hidden) is None and value_problem(hidden.astype(np.float32)) is None
    hidden[1, 3] = hidden[3, 0] = np.nan
    assert value_problem(hidden).startswith("2 non-finite values (NaN/Inf), the first at row 1, column 3")
    assert value_problem(np.asfortranarray(hidden.astype(np.float32))).startswith("2 non-finite")
    assert value_problem(np.array([65504, -65504], np.float16)) is None  # float16's extremes are finite
    assert value_problem(np.array([0, 63], np.int16), vocab_size=64) is None
    assert "the first 64 at position 1" in value_problem(np.array([0, 64], np.int32), vocab_size=64)


def test_a_non_octal_tar_header_field_names_file_offset_and_field(tmp_path):
    manifest = write_dataset(tmp_path, [3])
    path = tmp_path / manifest.shards[0].name
    data = path.read_bytes()
    second = header_offsets(data)[1]
    path.write_bytes(set_header_field(data, second, 124, b"0000000009x\0"))  # the size field, checksum repaired
    with pytest.raises(ShardError, match=rf"{path}: tar header at byte {second}, field 'size': .* not an octal"):
        list(iter_tar_members(path))
    path.write_bytes(set_header_field(data, second, 0, b"\xff\xfe.json\0"))  # a name that is not UTF-8
    with pytest.raises(ShardError, match=rf"{path}: tar header at byte {second}, field 'name'.*not UTF-8"):
        list(iter_tar_members(path))


@pytest.mark.parametrize(
    "damage,pattern",
    [
        ("missing", "listed in the manifest but missing; delete the file and rerun data/extract.py"),
        ("directory", "is a directory, not a shard"),
        ("gzip", "is gzip-compressed; shards are plain, uncompressed tar files"),
        ("garbage", "not a tar file"),
        ("empty", r"is empty \(0 bytes\)"),
        ("truncated", "truncated"),
    ],
)
def test_unreadable_shards_are_named_and_skipped_under_skip(tmp_path, damage, pattern):
    manifest = write_dataset(tmp_path, [3, 3, 2], optional=OPTIONAL)
    path = tmp_path / manifest.shards[1].name
    data = path.read_bytes()
    path.unlink()
    if damage == "directory":
        path.mkdir()
    elif damage != "missing":
        replacement = {"gzip": gzip.compress(data), "garbage": bytes(range(256)) * 20, "empty": b""}
        path.write_bytes(replacement.get(damage, data[:1500]))
    with pytest.raises(ShardError, match=f"{path}: {pattern}"):
        epoch(tmp_path)
    with pytest.raises(DatasetError, match=f"{path}: {pattern}"):
        validate_dataset(tmp_path, progress=False)
    batches, messages = epoch(tmp_path, on_error="skip")
    keys = [k for batch in batches for k in batch["keys"] if k]
    assert len(batches) == 4 and {k for k in keys} >= {"000000000", "000000006"} and "000000004" not in keys
    assert messages and all(str(path) in m for m in messages[:-1]) and "shard-000001.tar" in messages[-1]


def write_manifest(folder, edit) -> None:
    values = json.loads((folder / MANIFEST_NAME).read_text())
    result = edit(values)  # edits change `values` in place, or return a replacement list
    values = result if isinstance(result, list) else values
    (folder / MANIFEST_NAME).write_text(json.dumps(values))


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (lambda v: v["target"].update(hidden_size="8"), r"field 'target.hidden_size' is '8' \(a string\), expected an"),
        (lambda v: v["target"].pop("image_vocab_size"), r"lacks the field 'target.image_vocab_size'"),
        (lambda v: v.pop("fields"), r"lacks the field 'fields'"),
        (lambda v: v["fields"]["hidden"].update(dtype="float64"), r"'fields.hidden.dtype' is 'float64', expected one"),
        (lambda v: v["fields"].pop("tokens"), r"'fields' lacks the required field 'tokens'"),
        (lambda v: v["shards"][0].update(name="../elsewhere.tar"), r"'shards\[0\].name' is '../elsewhere.tar': shard"),
        (lambda v: v["shards"][1].update(name="/tmp/x.tar"), r"'shards\[1\].name' is '/tmp/x.tar': shard paths must"),
        (lambda v: v["shards"][1].update(num_samples=None), r"'shards\[1\].num_samples' is None \(null\), expected"),
        (lambda v: v["shards"][1].update(sha256=7), r"'shards\[1\].sha256' is 7 \(an integer\), expected a string"),
        (lambda v: v.update(shards={}), r"field 'shards' is \{\} \(an object\), expected a list"),
        (lambda v: [v], r"the top level is .* \(a list\), expected a JSON object"),
        (lambda v: v.update(extra=1), r"the manifest has unknown field\(s\) \['extra'\]"),
        (lambda v: v["shards"].append(v["shards"][0]), r"lists \['shard-000000.tar'\] more than once"),
        (lambda v: v["shards"][1].update(first_index=2), r"both claim sample 2 .* sample keys would repeat"),
        (lambda v: v.update(num_samples=5), r"shard counts sum to 6, num_samples says 5"),
    ],
)
def test_malformed_manifests_name_the_file_and_field(tmp_path, edit, pattern):
    write_dataset(tmp_path, [3, 3])
    write_manifest(tmp_path, edit)
    source = str(tmp_path / MANIFEST_NAME)
    with pytest.raises(ManifestError, match=f"{source}: .*{pattern}"):
        epoch(tmp_path)
    with pytest.raises(DatasetError, match=f"{source}: .*{pattern}"):
        validate_dataset(tmp_path, progress=False)


@pytest.mark.parametrize(
    "content,pattern",
    [(b"{", "is not valid JSON"), (b"\xff{}", "is not UTF-8"), (gzip.compress(b"{}"), "is gzip-compressed")],
)
def test_unreadable_manifests_name_the_file(tmp_path, content, pattern):
    write_dataset(tmp_path, [3])
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ManifestError, match=f"{tmp_path / MANIFEST_NAME}.*{pattern}"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestNotFoundError, match="does not exist"):  # also a FileNotFoundError, as before
        load_manifest(tmp_path)


def test_the_stream_checks_counts_and_keys_against_the_manifest(tmp_path):
    manifest = write_dataset(tmp_path, [3, 3], optional=OPTIONAL)
    first = tmp_path / manifest.shards[0].name
    extra = read_shard(first)
    info = write_shard(first, [*extra, ("000000099", extra[0][1], extra[0][2])])  # a 4th sample the manifest lacks
    write_manifest(tmp_path, lambda v: v["shards"][0].update(sha256=info.sha256, num_bytes=info.num_bytes))
    with pytest.raises(ShardError, match=rf"{first}: holds more samples than the 3 the manifest lists"):
        epoch(tmp_path)
    shutil.rmtree(tmp_path)
    manifest = write_dataset(tmp_path, [3, 3], optional=OPTIONAL)  # the same on the last shard a worker reads
    last = tmp_path / manifest.shards[1].name
    extra = read_shard(last)
    info = write_shard(last, [*extra, ("000000099", extra[0][1], extra[0][2])])
    write_manifest(tmp_path, lambda v: v["shards"][1].update(sha256=info.sha256, num_bytes=info.num_bytes))
    with pytest.raises(ShardError, match=rf"{last}: holds more samples than the 3 the manifest lists"):
        epoch(tmp_path)
    shutil.rmtree(tmp_path)
    manifest = write_dataset(tmp_path, [3, 3], optional=OPTIONAL)
    rewrite_shard(tmp_path, 1, lambda samples: [(f"{i:09d}", *s[1:]) for i, s in enumerate(samples)])  # keys 0..2
    second = tmp_path / manifest.shards[1].name
    with pytest.raises(ShardError, match=rf"{second}: found sample 000000000 where the manifest puts 000000003"):
        epoch(tmp_path)
    with pytest.raises(DatasetError, match=rf"(?s){second}: found sample '000000000'.*appears more than once"):
        validate_dataset(tmp_path, progress=False)


def test_malformed_members_name_shard_key_and_field(tmp_path):
    manifest = write_dataset(tmp_path, [2])
    path = tmp_path / manifest.shards[0].name
    raw = next(iter_raw_samples(path))
    fields = manifest.fields
    cases = {
        "json": (b"[1, 2]", "field 'json': holds list, expected a JSON object"),
        "hidden.npy": (b"\x93NUMPY garbage", r"field 'hidden': not a valid .npy array"),
        "tokens.npy": (raw["hidden.npy"], "field 'tokens': dtype float16 with 2 dims, the manifest says int16"),
    }
    for member, (content, pattern) in cases.items():
        with pytest.raises(SampleError, match=f"{path}: sample 000000000, {pattern}"):
            decode_sample({**raw, member: content}, fields, 6, str(path), vocab_size=64)
    without = {k: v for k, v in raw.items() if k != "aux.npy"}
    with pytest.raises(SampleError, match=f"{path}: sample 000000000 lacks the member 'aux.npy'"):
        decode_sample(without, fields, 6, str(path))
