"""Extraction into shards on the tiny random target: round trip, alignment, ranks, validation, format."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import build_tiny_toy_target

from data.extract import (
    ExtractConfig,
    build_job,
    derive_seed,
    extract_batch,
    load_config,
    main,
    run_extraction,
)
from data.prompts import PromptSetConfig, load_prompts
from data.shard_reader import decode_sample, iter_raw_samples, iter_tar_members
from data.shards import FieldSpec, ShardError, ShardWriter, decode_npy, encode_npy, load_manifest, write_atomic
from data.validate import validate_dataset
from inference.decoding.autoregressive import generate_ar
from inference.decoding.sampling import combine_cfg
from models.registry import process_target_options
from models.target import Conditioning


def tiny_config(out_dir, count: int = 6, **overrides) -> ExtractConfig:
    values = dict(
        out_dir=str(out_dir),
        prompts=PromptSetConfig(source="toy", count=count),
        samples_per_shard=4,
        batch_size=2,
        seed=3,
        store_aux=True,
        store_uncond=True,
    )
    return ExtractConfig(**{**values, **overrides})


def read_samples(folder) -> dict[str, dict]:
    manifest = load_manifest(folder)
    samples = {}
    for info in manifest.shards:
        for raw in iter_raw_samples(folder / info.name):
            sample = decode_sample(raw, manifest.fields, manifest.num_tokens, info.name)
            samples[sample["__key__"]] = sample
    return samples


@pytest.fixture(scope="module")
def extracted_once(tmp_path_factory):
    folder = tmp_path_factory.mktemp("extracted") / "ds"
    run_extraction(tiny_config(folder), target=build_tiny_toy_target(), progress=False)
    return folder


@pytest.fixture
def extracted(extracted_once, tmp_path):
    """A fresh copy of a 6-sample extraction (4 + 2 samples), for tests that damage it."""
    shutil.copytree(extracted_once, tmp_path / "ds")
    return tmp_path / "ds", load_manifest(tmp_path / "ds")


def test_npy_members_decode_as_zero_copy_views():
    array = np.arange(24, dtype=np.float16).reshape(4, 6)
    data = encode_npy(array)
    decoded = decode_npy(data)
    np.testing.assert_array_equal(decoded, array)
    assert decoded.dtype == np.float16 and not decoded.flags.writeable  # a view of `data`, not a copy
    assert np.shares_memory(decoded, np.frombuffer(data, dtype=np.uint8))
    np.testing.assert_array_equal(decode_npy(encode_npy(np.asfortranarray(array))), array)
    with pytest.raises(ValueError, match="data bytes"):
        decode_npy(data[:-2])


def test_extract_batch_row_j_predicts_token_j(tiny_target):
    """Greedy sampling picks argmax of CFG(head(cond row j), head(uncond row j)): rows and tokens line up."""
    greedy = dataclasses.replace(tiny_target.sampling, temperature=0.0)
    prompts = [p.text for p in load_prompts(PromptSetConfig(source="toy", count=3))]
    out = extract_batch(tiny_target, prompts, greedy, torch.Generator().manual_seed(0), store_uncond=True)
    num_tokens, width = tiny_target.geometry.num_tokens, tiny_target.hidden_size
    assert out["hidden"].shape == (3, num_tokens, width) and out["aux"].shape == (3, num_tokens, 3 * width)
    logits = combine_cfg(tiny_target.image_head(torch.cat([out["hidden"], out["uncond_hidden"]])), greedy.cfg_scale)
    assert torch.equal(logits.argmax(-1), out["tokens"])


def test_uncond_aux_is_the_unconditional_rows_auxiliary_streams(tiny_target):
    """uncond_aux row j equals the aux of a separate token-by-token pass over the unconditional rows alone."""
    settings = tiny_target.sampling
    prompts = [p.text for p in load_prompts(PromptSetConfig(source="toy", count=2))]
    out = extract_batch(tiny_target, prompts, settings, torch.Generator().manual_seed(1), store_uncond=True)
    num_tokens, width = tiny_target.geometry.num_tokens, tiny_target.hidden_size
    assert out["uncond_aux"].shape == (2, num_tokens, 3 * width)
    full = tiny_target.condition(prompts, cfg=True)
    uncond = Conditioning(
        inputs_embeds=full.inputs_embeds[2:],
        valid=full.valid[2:],
        positions=full.positions if full.positions.dim() == 1 else full.positions[2:],
        num_prompts=2,
        cfg=False,
    )
    cache = tiny_target.allocate_cache(2, tiny_target.prefix_length + num_tokens)
    streams = [tiny_target.prefill(uncond, cache, return_aux=True).aux[:, -1:]]  # (2, 1, 3D): predicts token 0
    for j in range(1, num_tokens):  # the state fed token j - 1 predicts token j
        position = tiny_target.image_positions(torch.tensor([j - 1]))
        streams.append(tiny_target.forward(out["tokens"][:, j - 1 : j], position, cache, return_aux=True).aux)
    torch.testing.assert_close(out["uncond_aux"], torch.cat(streams, dim=1), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out["uncond_aux"], out["aux"])  # really the other half of the CFG batch
    without_aux = extract_batch(
        tiny_target, prompts, settings, torch.Generator().manual_seed(1), store_aux=False, store_uncond=True
    )
    assert set(without_aux) == {"tokens", "hidden", "uncond_hidden"}
    torch.testing.assert_close(without_aux["uncond_hidden"], out["uncond_hidden"])


@pytest.mark.parametrize("store_aux", [False, True])
@pytest.mark.parametrize("store_uncond", [False, True])
def test_manifest_lists_uncond_aux_only_with_aux_and_uncond(tmp_path, tiny_target, store_aux, store_uncond):
    job = build_job(tiny_config(tmp_path, store_aux=store_aux, store_uncond=store_uncond), tiny_target)
    stored = {"aux": store_aux, "uncond_hidden": store_uncond, "uncond_aux": store_aux and store_uncond}
    assert set(job.header.fields) == {"tokens", "hidden"} | {name for name, on in stored.items() if on}


def test_validate_checks_field_names_and_widths(extracted):
    folder, manifest = extracted
    manifest.fields["uncond_aux"] = FieldSpec("float16", 32)  # the width of hidden, not of the three streams
    write_atomic(folder / "manifest.json", manifest.to_json())
    with pytest.raises(ValueError, match=r"manifest.json: field 'uncond_aux' has width 32, its target needs 96"):
        validate_dataset(folder, progress=False)


def test_round_trip_matches_generation_and_validates(extracted, tiny_target):
    folder, manifest = extracted
    assert [s.num_samples for s in manifest.shards] == [4, 2] and manifest.num_samples == 6
    assert set(manifest.fields) == {"tokens", "hidden", "aux", "uncond_hidden", "uncond_aux"}
    assert manifest.fields["uncond_aux"] == manifest.fields["aux"]  # float16, 3D wide
    assert manifest.fields["hidden"].dtype == "float16" and manifest.fields["tokens"].dtype == "int16"
    assert validate_dataset(folder, progress=False) == {
        "shards": 2,
        "samples": 6,
        "bytes": sum((folder / s.name).stat().st_size for s in manifest.shards),
    }
    samples = read_samples(folder)
    prompts = load_prompts(PromptSetConfig(source="toy", count=6))
    first = generate_ar(
        tiny_target, [p.text for p in prompts[2:4]], None, torch.Generator().manual_seed(derive_seed(3, 2))
    ).tokens
    for row, key in enumerate(["000000002", "000000003"]):  # the batch of samples 2 and 3
        sample = samples[key]
        assert sample["meta"]["prompt"] == prompts[2 + row].text and sample["meta"]["seed"] == derive_seed(3, 2)
        np.testing.assert_array_equal(sample["tokens"], first[row].numpy())
        assert sample["hidden"].shape == (16, 32) and sample["aux"].shape == (16, 96)
        assert sample["uncond_hidden"].shape == (16, 32) and sample["uncond_aux"].shape == (16, 96)
        assert not np.array_equal(sample["uncond_aux"], sample["aux"])
    assert not list(folder.glob("*.partial"))


def test_two_ranks_write_disjoint_shards_equal_to_one_rank(tmp_path, tiny_target, extracted):
    folder, single = extracted
    config = tiny_config(tmp_path / "two", count=6)
    assert run_extraction(config, target=tiny_target, rank=1, world_size=2, progress=False) is None  # waits for rank 0
    assert sorted(p.name for p in (tmp_path / "two").glob("*.tar")) == ["shard-000001.tar"]
    merged = run_extraction(config, target=tiny_target, rank=0, world_size=2, progress=False)  # last one merges
    assert merged is not None and merged.shards == single.shards  # same bytes, whatever the number of ranks
    assert load_manifest(tmp_path / "two").shards == single.shards


def test_rerun_with_changed_settings_is_refused(extracted, tiny_target):
    folder, _ = extracted
    with pytest.raises(ValueError, match="different settings.*sampling"):
        run_extraction(tiny_config(folder, seed=4), target=tiny_target, progress=False)


@pytest.mark.parametrize("field", ["aux", "uncond_aux"])
def test_validate_names_shard_key_and_field_of_nan_features(extracted, capsys, field):
    folder, manifest = extracted
    info = manifest.shards[1]
    raws = [dict(raw) for raw in iter_raw_samples(folder / info.name)]
    writer = ShardWriter(folder / info.name)  # rewrite the shard with a NaN, with a matching sha256
    for raw in raws:
        arrays = {name: decode_npy(raw[f"{name}.npy"]).copy() for name in manifest.fields}
        if raw["__key__"] == "000000005":
            arrays[field][3, 7] = np.nan
        writer.write(raw["__key__"], arrays, json.loads(raw["json"]))
    manifest.shards[1] = writer.commit(first_index=info.first_index)
    write_atomic(folder / "manifest.json", manifest.to_json())
    with pytest.raises(ValueError, match=rf"shard-000001.tar: sample 000000005, field '{field}': 1 non-finite"):
        validate_dataset(folder, progress=False)
    assert main(["--validate", str(folder), "--no-progress"]) == 1
    assert "non-finite" in capsys.readouterr().err


def test_validate_reports_hash_and_count_mismatches(extracted):
    folder, manifest = extracted
    path = folder / manifest.shards[0].name
    data = bytearray(path.read_bytes())
    data[-1] = 1  # trailing padding: the tar still reads, only the hash changes
    path.write_bytes(bytes(data))
    manifest.shards[1] = dataclasses.replace(manifest.shards[1], num_samples=3)
    write_atomic(folder / "manifest.json", manifest.to_json())
    with pytest.raises(ValueError, match="(?s)shard-000000.tar: sha256.*shard-000001.tar: holds 2 samples"):
        validate_dataset(folder, progress=False)


def test_truncated_or_corrupt_tar_raises_naming_the_file(extracted):
    folder, manifest = extracted
    path = folder / manifest.shards[0].name
    data = path.read_bytes()
    path.write_bytes(data[:5000])
    with pytest.raises(ShardError, match=r"shard-000000.tar: truncated"):
        list(iter_tar_members(path))
    broken = bytearray(data)
    broken[10] ^= 0xFF  # inside the first member's name: the header checksum no longer matches
    path.write_bytes(bytes(broken))
    with pytest.raises(ShardError, match=r"shard-000000.tar: corrupt tar header at byte 0"):
        list(iter_tar_members(path))


def test_partial_reads_skip_samples_and_fields(extracted):
    folder, manifest = extracted
    path = folder / manifest.shards[0].name
    everything = list(iter_raw_samples(path))
    part = list(iter_raw_samples(path, start=1, stop=3, suffixes={"json", "tokens.npy"}))
    assert [r["__key__"] for r in part] == ["000000001", "000000002"]
    assert set(part[0]) == {"__key__", "json", "tokens.npy"}
    assert part[1]["tokens.npy"] == everything[2]["tokens.npy"]


def test_config_loader_rejects_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("out_dir: x\nprompts: {source: toy, count: 4}\nbatchsize: 3\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['batchsize'\]"):
        load_config(path)
    config = load_config(None, ["out_dir=y", "prompts.count=5"])
    assert config.out_dir == "y" and config.prompts.count == 5 and config.prompts.source == "toy"
    with pytest.raises(ValueError, match="prompts.source='toy2' is unknown"):
        load_config(None, ["out_dir=y", "prompts.source=toy2"])


def test_target_options_reach_the_target_loader(tmp_path, tiny_target, monkeypatch):
    import data.extract

    config = load_config(None, [f"out_dir={tmp_path / 'ds'}", "prompts.count=2", "samples_per_shard=2",
                                "target=janus-pro-7b", "target_options.path=/models/Janus-Pro-7B",
                                "target_options.dtype=bfloat16"])  # fmt: skip
    assert config.target_options == {"path": "/models/Janus-Pro-7B", "dtype": "bfloat16"}
    calls = []

    def fake_load_target(name, **options):
        calls.append((name, options))
        return tiny_target

    monkeypatch.setattr(data.extract, "load_target", fake_load_target)
    assert run_extraction(config, rank=0, world_size=1, progress=False) is not None
    # a script outside Lightning adds this process's GPU on a CUDA host (`process_target_options`), nothing on a CPU one
    name, options = calls[0]
    assert len(calls) == 1 and name == "janus-pro-7b"
    assert options == {"path": "/models/Janus-Pro-7B", "dtype": "bfloat16", **process_target_options(name, {})}


def test_writer_output_is_byte_reproducible(tmp_path):
    infos = []
    for name in ("a", "b"):
        writer = ShardWriter(tmp_path / f"{name}.tar")
        writer.write("000000000", {"tokens": np.arange(4, dtype=np.int16)}, {"index": 0})
        infos.append(writer.commit(first_index=0))
    assert infos[0].sha256 == infos[1].sha256
    assert (tmp_path / "a.tar").stat().st_size == infos[0].num_bytes


def test_shards_are_plain_webdataset_tars(extracted):
    """Any WebDataset reader gets the same arrays: the format is standard, only our reader is faster."""
    import webdataset as wds

    folder, manifest = extracted
    urls = [str(folder / s.name) for s in manifest.shards]
    dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node, empty_check=False).decode()
    ours = read_samples(folder)
    count = 0
    for sample in dataset:
        mine = ours[sample["__key__"]]
        for name in manifest.fields:
            np.testing.assert_array_equal(sample[f"{name}.npy"], mine[name])
        assert sample["json"] == mine["meta"]
        count += 1
    assert count == manifest.num_samples
