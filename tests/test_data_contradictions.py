"""Datasets that contradict themselves are named errors: manifest fields against each other, sample metadata
against its arrays, members the manifest does not list, and the draft-vocabulary count's reads.

Each case is a fresh damage of a clean tiny dataset (3 shards of 3, 3 and 2 samples) that loaded without
complaint before these checks. Sample edits rewrite the shard with the manifest's sha256 kept matching
(`data_damage.rewrite_shard`), so only the check under test can catch them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_damage import edit_sample, rewrite_shard
from test_data_datamodule import IDENTITY, write_dataset

from data.data_config import DataConfig
from data.datamodule import FeatureDataModule
from data.errors import DatasetError, ManifestError, SampleError
from data.shards import MANIFEST_NAME, load_manifest
from data.validate import validate_dataset
from training.vocab import count_image_tokens

COUNTS = [3, 3, 2]


def dataset(tmp_path: Path, optional: tuple[str, ...] = ("aux",)) -> Path:
    folder = tmp_path / "ds"
    write_dataset(folder, COUNTS, optional=optional)
    return folder


def edit_manifest(folder: Path, change: Any) -> None:
    values = json.loads((folder / MANIFEST_NAME).read_text())
    change(values)
    (folder / MANIFEST_NAME).write_text(json.dumps(values))


def stream_all(folder: Path, **config: Any) -> list[dict[str, Any]]:
    data = FeatureDataModule(DataConfig(train_dir=str(folder), batch_size=2, **config), target=IDENTITY)
    data.setup("fit")
    return list(data.train_dataloader())


def test_a_manifest_naming_a_key_twice_is_an_error(tmp_path: Path) -> None:
    folder = dataset(tmp_path)
    text = (folder / MANIFEST_NAME).read_text()
    (folder / MANIFEST_NAME).write_text(text.replace('"num_tokens": 6,', '"num_tokens": 6, "num_tokens": 5,'))
    with pytest.raises(ManifestError, match=rf"{folder / MANIFEST_NAME}: names the key\(s\) \['num_tokens'\] twice"):
        load_manifest(folder)


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda v: v.update(num_tokens=5), r"num_tokens is 5, the target's grid 2 x 3 has 6"),
        (lambda v: v.update(samples_per_shard=2), r"shard-000000.tar holds 3 samples, more than samples_per_shard 2"),
        (lambda v: v.update(prompts={"num_prompts": 5}, sampling={"samples_per_prompt": 1}),
         r"prompts.num_prompts 5 x sampling.samples_per_prompt 1 = 5 samples, num_samples says 8"),
    ],
)  # fmt: skip
def test_manifest_fields_that_contradict_each_other_are_named(tmp_path: Path, change: Any, pattern: str) -> None:
    folder = dataset(tmp_path)
    edit_manifest(folder, change)
    with pytest.raises(ManifestError, match=pattern):
        stream_all(folder, verify=False)
    with pytest.raises(DatasetError, match=pattern):
        validate_dataset(folder, progress=False)


def set_meta(name: str, value: Any) -> Any:
    def change(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if value is KeyError:
            del meta[name]
        else:
            meta[name] = value

    return change


@pytest.mark.parametrize(
    "name,value,pattern",
    [
        ("prompt", 7, r"'prompt' is 7 \(int\), expected str"),
        ("seed", "3", r"'seed' is '3' \(str\), expected int"),
        ("seed", float("nan"), r"'seed' is nan \(float\), expected int"),
        ("prompt_id", KeyError, r"lacks 'prompt_id'"),
        ("index", 5, r"index 5 does not match the sample key 000000004"),
        ("length", 5, r"length 5 but its arrays hold 6 rows"),
    ],
)
def test_the_loader_checks_the_json_it_hands_on_as_the_validator_does(
    tmp_path: Path, name: str, value: Any, pattern: str
) -> None:
    folder = dataset(tmp_path)
    rewrite_shard(folder, 1, edit_sample("000000004", set_meta(name, value)))
    where = rf"{folder / 'shard-000001.tar'}: sample 000000004, field 'json': .*{pattern}"
    with pytest.raises(SampleError, match=where):
        stream_all(folder)
    with pytest.raises(DatasetError, match=where):
        validate_dataset(folder, progress=False)


def test_a_field_the_shards_hold_but_the_manifest_omits_is_an_error_when_the_config_reads_it(tmp_path: Path) -> None:
    folder = dataset(tmp_path, optional=("aux", "uncond_hidden", "uncond_aux"))
    edit_manifest(folder, lambda values: values["fields"].pop("uncond_aux"))
    with pytest.raises(ManifestError, match=r"'fields' lacks 'uncond_aux', but shard-000000.tar holds it"):
        stream_all(folder, load_uncond=True)
    assert len(stream_all(folder, load_uncond=False)) == 4  # a config that does not read it trains as before
    with pytest.raises(DatasetError, match=r"holds \['uncond_aux'\], which the manifest's 'fields' do not list"):
        validate_dataset(folder, progress=False)


@pytest.mark.parametrize(
    "damage,pattern",
    [
        ("missing", r"lacks the member 'tokens.npy'"),
        ("dtype", r"field 'tokens': dtype int32 with 1 dims, the manifest says int16"),
        ("short", r"field lengths \{'tokens': 0\}"),
    ],
)
def test_the_draft_vocabulary_count_names_the_shard_sample_and_field(tmp_path: Path, damage: str, pattern: str) -> None:
    folder = dataset(tmp_path)

    def change(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if damage == "missing":
            del arrays["tokens"]
        elif damage == "dtype":
            arrays["tokens"] = arrays["tokens"].astype(np.int32)
        else:
            arrays["tokens"] = arrays["tokens"][:0]
            meta.pop("length")

    rewrite_shard(folder, 2, edit_sample("000000007", change))
    with pytest.raises(SampleError, match=rf"{folder / 'shard-000002.tar'}: sample 000000007.*{pattern}"):
        count_image_tokens(folder, progress=False)


def test_a_sample_with_fewer_rows_than_num_tokens_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    write_dataset(folder, COUNTS, lengths=lambda index: 4 if index == 5 else 6)
    where = rf"{folder / 'shard-000001.tar'}: sample 000000005: field lengths .*'tokens': 4.*expected 6 rows"
    with pytest.raises(SampleError, match=where):
        stream_all(folder)
    with pytest.raises(DatasetError, match=where):
        validate_dataset(folder, progress=False)


def test_a_manifest_renamed_to_another_target_is_refused_by_what_its_shards_hold(tmp_path: Path) -> None:
    """The manifest's target block and field widths edited together to name a wider target: every check between
    manifest and configuration agrees, and the shards' hidden width (8, the target that made them) refuses it."""
    folder = dataset(tmp_path)
    other = dataclasses.replace(IDENTITY, name="wider", hidden_size=16)

    def rename(values: dict[str, Any]) -> None:
        values["target"].update(name="wider", hidden_size=16)
        values["fields"]["hidden"]["width"] = 16
        values["fields"]["aux"]["width"] = 48

    edit_manifest(folder, rename)
    data = FeatureDataModule(DataConfig(train_dir=str(folder), batch_size=2), target=other)
    data.setup("fit")  # manifest and configuration agree with each other
    with pytest.raises(SampleError, match=r"shard-00000\d\.tar.*hidden.*width 8, the manifest says 16"):
        list(data.train_dataloader())


def test_a_manifest_claiming_a_smaller_vocabulary_is_refused_by_the_stored_token_ids(tmp_path: Path) -> None:
    folder = dataset(tmp_path)
    largest = max(int(t) for sample in stream_all(folder) for t in sample["tokens"].flatten())
    other = dataclasses.replace(IDENTITY, name="fewer codes", image_vocab_size=largest)
    edit_manifest(folder, lambda values: values["target"].update(name="fewer codes", image_vocab_size=largest))
    data = FeatureDataModule(DataConfig(train_dir=str(folder), batch_size=2), target=other)
    data.setup("fit")
    with pytest.raises(SampleError, match=rf"token id\(s\) outside the image vocabulary 0\.\.{largest - 1}"):
        list(data.train_dataloader())
