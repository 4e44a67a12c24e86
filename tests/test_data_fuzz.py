"""Seeded fuzzing of dataset folders: every damaged dataset loads correctly or raises a DatasetError naming the file.

A tiny dataset (3 shards of 3, 3 and 2 samples) is damaged 500 seeded ways (~5 s), and its float8_e4m3fn
twin 90 ways (sample edits, NaN codes, bad or missing row scales, byte flips): byte flips,
truncations, tar header fields rewritten with a valid checksum, whole shards replaced (gzip,
garbage, empty, a folder, missing), samples rewritten with bad values, dtypes, shapes, keys or
metadata (with the manifest's sha256 kept matching, so only the sample checks can catch them), and
manifest edits (wrong types, missing fields, paths outside the folder, counts, unreadable JSON).
For each, `validate_dataset` and a full DataModule epoch (on_error="raise") must each either read
everything the manifest lists, each sample once and with finite features and in-range tokens, or
raise a `DatasetError` whose message names the damaged file; under on_error="skip" a damaged shard
never stops the epoch, which keeps its batch count and warns naming the shard. A dataset that
validates must also stream (when the DataModule's target and fields match it). A failure lists each
case with its number and damage; `random.Random(seed * 1000 + case)` replays it.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_damage import Sample, header_offsets, rewrite_shard, set_header_field
from test_data_datamodule import IDENTITY, write_dataset

from data.data_config import DataConfig, SkippedSamplesWarning
from data.datamodule import FeatureDataModule
from data.fp8 import FP8_DTYPE
from data.shards import MANIFEST_NAME, DatasetError, ManifestError, load_manifest, sample_key
from data.validate import validate_dataset

SEED = 20250611
COUNTS = [3, 3, 2]
OPTIONAL = ("aux", "uncond_hidden")
FLOAT_FIELDS = ("hidden", *OPTIONAL)
SHARDS = [f"shard-{i:06d}.tar" for i in range(len(COUNTS))]
Damage = Callable[[Path, random.Random], tuple[str, Path]]
"""Damages a dataset folder; returns (what it did, the file it damaged)."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pristine") / "ds"
    write_dataset(folder, COUNTS, optional=OPTIONAL)
    return folder


@pytest.fixture(scope="module")
def pristine_fp8(tmp_path_factory) -> Path:
    """The same dataset with float8_e4m3fn features: uint8 codes, each with a `<field>_scale` member."""
    folder = tmp_path_factory.mktemp("pristine_fp8") / "ds"
    write_dataset(folder, COUNTS, optional=OPTIONAL, dtype=FP8_DTYPE)
    return folder


# ----------------------------------------------------------------------------- shard bytes


def flip_bytes(folder: Path, rng: random.Random) -> tuple[str, Path]:
    path = folder / rng.choice(SHARDS)
    data = bytearray(path.read_bytes())
    spots = [rng.randrange(len(data)) for _ in range(rng.choice([1, 1, 2, 5]))]
    for spot in spots:
        data[spot] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return f"flip bytes {spots}", path


HEADER_FIELDS = {"name": (0, 100), "mode": (100, 8), "size": (124, 12), "mtime": (136, 12), "typeflag": (156, 1)}
HEADER_FIELDS |= {"magic": (257, 6), "prefix": (345, 155)}


def header_value(rng: random.Random, field: str, width: int) -> bytes:
    """A plausible or hostile value for a tar header field."""
    choices = [
        bytes(rng.randrange(256) for _ in range(width)),
        b"%0*o\0" % (width - 1, rng.randrange(8 ** (width - 1))) if width > 1 else b"0",
        b"89" + b"0" * (width - 2) if width > 2 else b"9",
        b"\x80" + bytes(rng.randrange(256) for _ in range(width - 1)),
        b"\xff" * width,
        bytes(width),
    ]
    if field == "typeflag":
        choices += [b"5", b"x", b"g", b"L", b"2", b"1", b"\0", b"7"]
    if field in ("name", "prefix"):
        names = [b"000000001.json", b"000000000.hidden.npy", b"noextension", b".json", b"a/b", b"000000000.extra.npy"]
        choices += [name + b"\0" * (width - len(name)) for name in names]
    if field == "size":
        choices += [b"%011o\0" % rng.choice([0, 1, 511, 512, 10**6, 8**11 - 1])]
    return rng.choice(choices)[:width]


def edit_header(folder: Path, rng: random.Random) -> tuple[str, Path]:
    path = folder / rng.choice(SHARDS)
    data = path.read_bytes()
    offset = rng.choice(header_offsets(data))
    field = rng.choice(list(HEADER_FIELDS))
    start, width = HEADER_FIELDS[field]
    value = header_value(rng, field, width)
    path.write_bytes(set_header_field(data, offset, start, value))
    return f"header at {offset}: {field} = {value[:16]!r}", path


def truncate(folder: Path, rng: random.Random) -> tuple[str, Path]:
    path = folder / rng.choice(SHARDS)
    data = path.read_bytes()
    size = rng.randrange(len(data)) if rng.random() < 0.5 else 512 * rng.randrange(len(data) // 512)
    path.write_bytes(data[:size])
    return f"truncate to {size} of {len(data)}", path


def replace(folder: Path, rng: random.Random) -> tuple[str, Path]:
    name = rng.choice(SHARDS)
    path = folder / name
    data = path.read_bytes()
    how = rng.choice(["gzip", "garbage", "empty", "directory", "missing", "other shard", "trailing bytes", "zeros"])
    path.unlink()
    if how == "directory":
        path.mkdir()
        (path / "x").write_bytes(data)
    elif how != "missing":
        other = (folder / rng.choice([s for s in SHARDS if s != name])).read_bytes()
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
        content = {"gzip": gzip.compress(data), "garbage": garbage, "empty": b"", "other shard": other}
        content |= {"trailing bytes": data + garbage, "zeros": bytes(len(data))}
        path.write_bytes(content[how])
    return f"shard replaced: {how}", path


# ----------------------------------------------------------------------------- samples


def sample_edit(rng: random.Random, fp8: bool = False) -> tuple[str, Callable[[list[Sample]], list[Sample]]]:
    """A change to one shard's samples: bad values, dtypes, shapes, members, keys or metadata.

    With `fp8` (a float8_e4m3fn dataset) the NaN/Inf edits become NaN codes (0x7F, 0xFF: e4m3fn has
    no Inf), and bad row scales (zero, negative, NaN, Inf, too large for float16) and scale members
    of the wrong dtype or length, or missing, join in.
    """
    position = rng.randrange(2)
    field = rng.choice(FLOAT_FIELDS)
    row, column = rng.randrange(6), rng.randrange(8)

    def one(change: Callable[[dict[str, np.ndarray], dict[str, Any]], Any]) -> Callable[[list[Sample]], list[Sample]]:
        def edit(samples: list[Sample]) -> list[Sample]:
            key, arrays, meta = samples[position]
            result = change(arrays, meta)
            samples[position] = (key, arrays, result if isinstance(result, list) else meta)
            return samples

        return edit

    edits: dict[str, Callable[[list[Sample]], list[Sample]]] = {
        f"{field}[{row}, {column}] = NaN": one(lambda a, m: a[field].__setitem__((row, column), np.nan)),
        f"{field}[{row}, {column}] = -Inf": one(lambda a, m: a[field].__setitem__((row, column), -np.inf)),
        f"tokens[{row}] = 64": one(lambda a, m: a["tokens"].__setitem__(row, 64)),
        f"tokens[{row}] = -3": one(lambda a, m: a["tokens"].__setitem__(row, -3)),
        "tokens as int32": one(lambda a, m: a.__setitem__("tokens", a["tokens"].astype(np.int32))),
        f"{field} as float32": one(lambda a, m: a.__setitem__(field, a[field].astype(np.float32))),
        f"{field} one column short": one(lambda a, m: a.__setitem__(field, a[field][:, :-1])),
        f"{field} one row short": one(lambda a, m: a.__setitem__(field, a[field][:-1])),
        "every field 7 rows (num_tokens is 6)": one(
            lambda a, m: a.update({k: np.concatenate([v, v[:1]]) for k, v in a.items()})
        ),  # noqa: E501
        "every field empty": one(lambda a, m: a.update({k: v[:0] for k, v in a.items()})),
        f"{field} 1-D": one(lambda a, m: a.__setitem__(field, a[field][:, 0])),
        f"{field} Fortran order": one(lambda a, m: a.__setitem__(field, np.asfortranarray(a[field]))),
        f"{field} missing": one(lambda a, m: a.pop(field)),
        "an unlisted extra field": one(lambda a, m: a.__setitem__("uncond_aux", np.ones((6, 24), np.float16))),
        "json a list": one(lambda a, m: [m]),
        "json lacks prompt": one(lambda a, m: m.pop("prompt")),
        "json index a string": one(lambda a, m: m.__setitem__("index", "3")),
        "key repeated": lambda s: [*s[: position + 1], s[position], *s[position + 1 :]],
        "keys swapped": lambda s: [s[1], s[0], *s[2:]],
        "sample dropped": lambda s: s[:position] + s[position + 1 :],
        "last sample dropped": lambda s: s[:-1],
        "key renamed 'abc'": lambda s: [("abc", *s[0][1:]), *s[1:]],
        "key of another shard": lambda s: [(sample_key(7), *s[0][1:]), *s[1:]],
    }
    if fp8:
        scale, code, value = f"{field}_scale", rng.choice([0x7F, 0xFF]), rng.choice([0.0, -1.0, np.nan, np.inf, 1e3])
        del edits[f"{field}[{row}, {column}] = NaN"], edits[f"{field}[{row}, {column}] = -Inf"]
        edits |= {
            f"{field}[{row}, {column}] = NaN code {code:#x}": one(
                lambda a, m: a[field].__setitem__((row, column), code)
            ),
            f"{scale}[{row}] = {value}": one(lambda a, m: a[scale].__setitem__(row, value)),
            f"{scale} as float64": one(lambda a, m: a.__setitem__(scale, a[scale].astype(np.float64))),
            f"{scale} as float16": one(lambda a, m: a.__setitem__(scale, a[scale].astype(np.float16))),
            f"{scale} one row short": one(lambda a, m: a.__setitem__(scale, a[scale][:-1])),
            f"{scale} 2-D": one(lambda a, m: a.__setitem__(scale, a[scale][:, None])),
            f"{scale} missing": one(lambda a, m: a.pop(scale)),
        }
    return rng.choice(list(edits.items()))


def edit_samples(folder: Path, rng: random.Random) -> tuple[str, Path]:
    index = rng.randrange(len(SHARDS))
    description, edit = sample_edit(rng)
    rewrite_shard(folder, index, edit)
    return f"{SHARDS[index]} sample {description}", folder / SHARDS[index]


def edit_fp8_samples(folder: Path, rng: random.Random) -> tuple[str, Path]:
    index = rng.randrange(len(SHARDS))
    description, edit = sample_edit(rng, fp8=True)
    rewrite_shard(folder, index, edit)
    return f"{SHARDS[index]} sample {description}", folder / SHARDS[index]


# ----------------------------------------------------------------------------- manifests


WRONG = [None, True, -1, 0, 1.5, "x", "", [], {}, [1, "a"], {"a": 1}, 2**70, "../elsewhere.tar"]
BAD_PATHS = ["../elsewhere.tar", "/tmp/elsewhere.tar", "..", ".", "", "sub/../../elsewhere.tar", "a\\b.tar", "C:x.tar"]


def json_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """The path of every node of a JSON value (the root excluded)."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    return [p for key, child in children for p in [(*path, key), *json_paths(child, (*path, key))]]


def at(values: Any, path: tuple) -> Any:
    for key in path:
        values = values[key]
    return values


def edit_manifest(folder: Path, rng: random.Random) -> tuple[str, Path]:
    path = folder / MANIFEST_NAME
    values = json.loads(path.read_text())
    kind = rng.choice(["wrong type", "wrong type", "delete", "bad path", "number", "structure", "file"])
    where = rng.choice(json_paths(values))
    if kind == "wrong type":
        new = rng.choice(WRONG)
        at(values, where[:-1])[where[-1]] = new
        description = f"{where} = {new!r}"
    elif kind == "delete":
        del at(values, where[:-1])[where[-1]]
        description = f"del {where}"
    elif kind == "bad path":
        index, name = rng.randrange(len(SHARDS)), rng.choice(BAD_PATHS)
        values["shards"][index]["name"] = name
        shutil.copy(folder / SHARDS[index], folder.parent / "elsewhere.tar")  # a real file out there
        description = f"shards[{index}].name = {name!r}"
    elif kind == "number":
        index = rng.randrange(len(SHARDS))
        field = rng.choice(["num_samples", "first_index", "num_bytes"])
        target = rng.choice([values, values["shards"][index]]) if field == "num_samples" else values["shards"][index]
        if rng.random() < 0.3:
            target, field = rng.choice(
                [
                    (values, "num_tokens"),
                    (values, "samples_per_shard"),
                    (values["target"], "image_vocab_size"),
                    (values, "schema_version"),
                ]
            )  # noqa: E501
        target[field] += rng.choice([-2, -1, 1, 3])
        description = f"{field} changed to {target[field]}"
    elif kind == "structure":
        how = rng.choice(["duplicate shard", "drop shard", "swap shards", "unknown key", "drop aux field", "no shards"])
        shards = values["shards"]
        if how == "duplicate shard":
            shards.append(dict(shards[0]))
        elif how == "drop shard":
            shards.pop(rng.randrange(len(shards)))
        elif how == "swap shards":
            shards[0], shards[1] = shards[1], shards[0]
        elif how == "unknown key":
            at(values, rng.choice([(), ("target",), ("shards", 0), ("fields", "hidden")]))["surprise"] = 1
        elif how == "drop aux field":
            del values["fields"]["aux"]
        else:
            values.update(shards=[], num_samples=0)
        description = how
    else:
        text = json.dumps(values)
        how = rng.choice(["truncated", "garbage", "gzip", "empty", "directory", "list", "BOM", "missing"])
        path.unlink()
        if how == "directory":
            path.mkdir()
        elif how != "missing":
            content = {"truncated": text[: rng.randrange(len(text))].encode(), "gzip": gzip.compress(text.encode())}
            content |= {"garbage": bytes(rng.randrange(256) for _ in range(200)), "empty": b""}
            content |= {"list": f"[{text}]".encode(), "BOM": b"\xef\xbb\xbf" + text.encode()}
            path.write_bytes(content[how])
        return f"manifest file: {how}", path
    path.write_text(json.dumps(values))
    return f"manifest {kind}: {description}", path


# ----------------------------------------------------------------------------- the property


def names_the_file(message: str, folder: Path, culprit: Path) -> bool:
    """A shard's damage must be reported with that shard's path (or as the manifest's entry for it); a
    manifest's, with the path of a file in the folder."""
    if culprit.name != MANIFEST_NAME:
        return str(culprit) in message or (str(folder / MANIFEST_NAME) in message and culprit.name in message)
    return re.search(re.escape(f"{folder}/") + r"\S", message) is not None


def read_epoch(folder: Path, on_error: str) -> tuple[list[str], int, int, list[str]]:
    """One DataModule epoch: (keys read, padding rows, batches, skip warnings); checks every batch's values."""
    config = DataConfig(train_dir=str(folder), batch_size=3, load_uncond=True, on_error=on_error, shuffle_buffer=4)
    loader = FeatureDataModule(config, IDENTITY).train_dataloader()
    keys, padding, batches = [], 0, 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            batches += 1
            keys += [key for key in batch["keys"] if key]
            padding += int((~batch["sample_mask"]).sum())
            assert all(batch[name].isfinite().all() for name in FLOAT_FIELDS), "non-finite features reached a batch"
            tokens = batch["tokens"][batch["loss_mask"]]
            assert ((tokens >= 0) & (tokens < IDENTITY.image_vocab_size)).all(), "an out-of-range token reached a batch"
    messages = [str(w.message) for w in caught if issubclass(w.category, SkippedSamplesWarning)]
    assert batches == len(loader), f"{batches} batches, the loader announced {len(loader)}"
    return keys, padding, batches, messages


def listed_keys(folder: Path) -> list[str]:
    manifest = load_manifest(folder)
    return sorted(sample_key(s.first_index + i) for s in manifest.shards for i in range(s.num_samples))


def check(folder: Path, culprit: Path) -> list[str]:
    """What is wrong with how the damaged dataset in `folder` was handled (empty: all is well)."""
    problems: list[str] = []

    def refused(where: str, error: Exception) -> None:
        if not isinstance(error, DatasetError):
            problems.append(f"{where} raised {type(error).__name__}, not a DatasetError: {error}")
        elif not names_the_file(str(error), folder, culprit):
            problems.append(f"{where}'s message does not name {culprit}: {error}")

    validated = streamed = False
    try:
        report = validate_dataset(folder, progress=False)
        validated = True
        if report["samples"] != len(listed_keys(folder)):
            problems.append(f"validate read {report['samples']} samples, the manifest lists {len(listed_keys(folder))}")
    except Exception as error:
        refused("validate_dataset", error)
    raised: Exception | None = None
    try:
        keys, padding, _, _ = read_epoch(folder, "raise")
        streamed = True
        if sorted(keys) != listed_keys(folder) or padding:
            problems.append(f"the stream read {sorted(keys)} (+{padding} padding), the manifest lists another set")
    except Exception as error:
        raised = error
        refused("the stream", error)
    if validated and not streamed:
        manifest = load_manifest(folder)
        if manifest.target == IDENTITY and {"aux", "uncond_hidden"} <= set(manifest.fields) and manifest.shards:
            problems.append(f"the dataset validates but does not stream: {raised}")
    if raised is not None and not isinstance(raised, ManifestError):  # a damaged shard: skip must carry on
        try:
            keys, padding, _, messages = read_epoch(folder, "skip")
            if len(set(keys)) != len(keys) or not set(keys) <= set(listed_keys(folder)):
                problems.append(f"under skip the stream read {sorted(keys)}")
            named = any(names_the_file(message, folder, culprit) for message in messages)
            if len(keys) + padding != len(listed_keys(folder)) or not named:
                problems.append(f"under skip: {len(keys)} keys + {padding} padding rows, warnings {messages}")
        except Exception as error:
            problems.append(f"under on_error='skip' the stream raised {type(error).__name__}: {error}")
    return problems


def run_cases(pristine: Path, tmp_path: Path, damages: list[Damage], count: int, seed: int) -> None:
    failures = []
    for case in range(count):
        rng = random.Random(seed * 1000 + case)
        folder = tmp_path / f"case{case}" / "ds"
        shutil.copytree(pristine, folder)
        description, culprit = rng.choice(damages)(folder, rng)
        failures += [f"case {case} ({description}): {problem}" for problem in check(folder, culprit)]
        shutil.rmtree(folder.parent)
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:20])


def test_fuzz_shard_bytes(pristine, tmp_path):
    run_cases(pristine, tmp_path, [flip_bytes, edit_header, edit_header, truncate, replace], count=240, seed=SEED)


def test_fuzz_samples(pristine, tmp_path):
    run_cases(pristine, tmp_path, [edit_samples], count=100, seed=SEED + 1)


def test_fuzz_manifests(pristine, tmp_path):
    run_cases(pristine, tmp_path, [edit_manifest], count=160, seed=SEED + 2)


def test_fuzz_fp8_samples_and_bytes(pristine_fp8, tmp_path):
    """A float8_e4m3fn dataset: flipped bytes land in codes and scales too, so NaN codes and bad scales
    must be caught before they reach a batch (which holds the dequantised float16 features)."""
    run_cases(pristine_fp8, tmp_path, [edit_fp8_samples, edit_fp8_samples, flip_bytes], count=90, seed=SEED + 3)
