"""FP8 feature storage (`data.fp8`): the round-trip error bound, zero rows, the reader's checks,
a dataset through the DataModule and `--validate`, and an extraction of the tiny target at float8.

The error bound. e4m3fn has 3 mantissa bits: between 2^e and 2^(e+1) its values are 2^(e-3)
apart, so rounding to nearest is off by at most 2^(e-4) <= 2^-4 of the value. Below 2^-6 (the
smallest normal) the subnormals are 2^-9 apart: at most 2^-10 off. A row is divided by its scale
s = max|x| / 448 before the cast and multiplied back after, so element x comes back within
2^-4 |x| + 2^-10 s (plus float32 rounding, 2^-23 relative), which is at most 2^-4 max|x| + max|x| /
458752: "2^-4 of the row's max" up to a hair. A float16 batch rounds once more (2^-11 relative).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import build_tiny_toy_target
from data_damage import edit_sample, rewrite_shard
from test_data_datamodule import IDENTITY, write_dataset
from test_data_shards import read_samples, tiny_config

from data.data_config import DataConfig
from data.datamodule import FeatureDataModule
from data.extract import _cast_checked, load_config, run_extraction
from data.fp8 import (
    CODE_VALUES,
    E4M3_MAX,
    FP8_DTYPE,
    MAX_SCALE,
    codes_problem,
    dequantize_rows,
    quantize_rows,
    scale_member,
)
from data.manifest import Manifest
from data.shard_reader import decode_sample, iter_raw_samples
from data.shards import DatasetError, SampleError, load_manifest
from data.validate import validate_dataset

FIELDS = ("hidden", "aux", "uncond_hidden", "uncond_aux")


def error_bound(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """|dequantised - x| may reach this per element (module docstring): x (..., W), scales (...)."""
    return 2.0**-4 * np.abs(x) + 2.0**-10 * scales[..., None] + 2.0**-22 * np.abs(x)


def round_trip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dequantised x, scales) for x (L, W)."""
    codes, scales = quantize_rows(x)
    return dequantize_rows(codes, scales), scales


def test_round_trip_error_is_within_2_to_the_minus_4_of_each_element_and_of_the_row_max():
    rng = np.random.default_rng(0)
    magnitudes = np.logspace(-30, 4.5, 40)  # (L,): rows from 1e-30 to beyond float16's range
    x = (rng.standard_t(3, size=(40, 256)) * magnitudes[:, None]).astype(np.float32)  # heavy tails
    x[::5, ::7] = 0.0  # exact zeros inside rows
    back, scales = round_trip(x)
    error = np.abs(back - x)
    assert (error <= error_bound(x, scales)).all()
    row_max = np.abs(x).max(axis=1, keepdims=True)
    assert (error <= (2.0**-4 + 2.0**-18) * row_max).all()  # the brief's form: 2^-4 of the row's max
    np.testing.assert_allclose(np.abs(back).max(axis=1), row_max[:, 0], rtol=1e-6)  # the max lands on 448 exactly
    assert (back[::5, ::7] == 0).all()
    assert (error / np.maximum(np.abs(x), 1e-38))[np.abs(x) > row_max / 8].max() > 2.0**-6  # the bound is not loose


def test_zero_rows_get_scale_one_and_come_back_as_zeros():
    x = np.zeros((3, 8), np.float32)
    x[1] = np.linspace(-2, 2, 8)
    codes, scales = quantize_rows(x)
    assert scales.dtype == np.float32 and scales.shape == (3,) and codes.dtype == np.uint8 and codes.shape == (3, 8)
    assert scales.tolist() == [1.0, pytest.approx(2 / E4M3_MAX), 1.0]
    assert (codes[[0, 2]] == 0).all()
    back = dequantize_rows(codes, scales)
    assert (back[[0, 2]] == 0).all() and back[1].tolist() == pytest.approx(x[1].tolist(), rel=2**-4)


def test_quantize_uses_torch_float8_and_nan_codes_are_the_two_torch_nans():
    x = np.array([[448.0, -448.0, 1.0, -0.5, 0.0]], np.float32)
    codes, scales = quantize_rows(x)
    expected = torch.tensor(x / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(codes, expected)
    every = torch.arange(256, dtype=torch.uint8)  # every bit pattern, as torch reads it
    values = every.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(CODE_VALUES, values)  # dequantising's lookup table is torch's cast (NaN == NaN)
    nan = np.isnan(values)
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF]
    flagged = [code for code in range(256) if codes_problem(np.array([[code]], np.uint8))]
    assert flagged == [0x7F, 0xFF]


def test_a_dataset_reads_back_through_the_datamodule_as_float16_within_the_bound(tmp_path):
    lengths = [6] * 5  # every sample holds num_tokens rows
    exact = write_dataset(tmp_path / "f16", [3, 2], lambda i: lengths[i], optional=FIELDS[1:])
    manifest = write_dataset(tmp_path / "fp8", [3, 2], lambda i: lengths[i], optional=FIELDS[1:], dtype=FP8_DTYPE)
    saved = json.loads((tmp_path / "fp8" / "manifest.json").read_text())
    assert {name: saved["fields"][name]["dtype"] for name in FIELDS} == dict.fromkeys(FIELDS, FP8_DTYPE)
    assert Manifest.from_dict(saved).fields == manifest.fields  # scale members are implied, not listed
    assert exact.fields["hidden"].dtype == "float16"

    def batches(folder):
        config = DataConfig(train_dir=str(folder), batch_size=5, load_uncond=True, shuffle_buffer=4)
        return {key: (batch, row) for batch in FeatureDataModule(config, IDENTITY).train_dataloader()
                for row, key in enumerate(batch["keys"])}  # fmt: skip

    quantised, reference = batches(tmp_path / "fp8"), batches(tmp_path / "f16")
    assert sorted(quantised) == sorted(reference) == [f"{i:09d}" for i in range(5)]
    for key, (batch, row) in quantised.items():
        ref_batch, ref_row = reference[key]
        length = int(batch["lengths"][row])
        assert length == lengths[int(key)] and batch["tokens"][row].tolist() == ref_batch["tokens"][ref_row].tolist()
        for name in FIELDS:
            got, want = batch[name][row].float().numpy(), ref_batch[name][ref_row].float().numpy()  # (L, W)
            assert batch[name].dtype == torch.float16 and got.shape == want.shape
            scales = np.abs(want[:length]).max(axis=1) / E4M3_MAX
            bound = error_bound(want[:length], scales) + 2.0**-11 * np.abs(want[:length])  # + float16 rounding
            assert (np.abs(got[:length] - want[:length]) <= bound).all(), (key, name)
            assert (got[length:] == 0).all()  # padding rows


def test_validate_passes_an_fp8_dataset_and_names_shard_key_and_field_of_bad_codes_and_scales(tmp_path):
    write_dataset(tmp_path / "ds", [2, 2], optional=("aux",), dtype=FP8_DTYPE)
    assert validate_dataset(tmp_path / "ds", progress=False)["samples"] == 4
    damages = {
        "NaN code": (lambda a, m: a["aux"].__setitem__((4, 5), 0xFF), r"field 'aux': 1 NaN codes .* row 4, column 5"),
        "zero scale": (lambda a, m: a["hidden_scale"].__setitem__(2, 0.0), r"field 'hidden_scale': 1 bad row scale"),
        "NaN scale": (lambda a, m: a["aux_scale"].__setitem__(0, np.nan), r"field 'aux_scale': 1 bad row scale.*nan"),
        "huge scale": (lambda a, m: a["aux_scale"].__setitem__(1, MAX_SCALE), r"'aux_scale'.*< 146.25"),
        "float16 scale": (
            lambda a, m: a.__setitem__("hidden_scale", a["hidden_scale"].astype(np.float16)),
            r"field 'hidden_scale': dtype float16 with shape \(6,\), expected float32",
        ),
        "short scale": (
            lambda a, m: a.__setitem__("hidden_scale", a["hidden_scale"][:5]),
            r"field 'hidden_scale': .*shape \(5,\), expected float32 with shape \(6,\)",
        ),
        "missing scale": (
            lambda a, m: a.pop("aux_scale"),
            r"lacks the member 'aux_scale.npy' \(the row scales of its float8_e4m3fn field 'aux'\)",
        ),
        "float16 codes": (
            lambda a, m: a.__setitem__("hidden", a["hidden"].astype(np.float16)),
            r"field 'hidden': dtype float16 .* the manifest says float8_e4m3fn \(stored as uint8 codes\)",
        ),
    }
    for what, (change, message) in damages.items():
        folder = tmp_path / what.replace(" ", "_")
        write_dataset(folder, [2, 2], optional=("aux",), dtype=FP8_DTYPE)
        rewrite_shard(folder, 1, edit_sample("000000003", change))
        with pytest.raises(DatasetError, match=rf"shard-000001.tar: sample 000000003\b.*{message}"):
            validate_dataset(folder, progress=False)


def test_decode_sample_returns_codes_and_scales_and_refuses_a_missing_scale(tmp_path):
    manifest = write_dataset(tmp_path, [1], optional=(), dtype=FP8_DTYPE)
    raw = next(iter_raw_samples(tmp_path / manifest.shards[0].name))
    sample = decode_sample(raw, manifest.fields, manifest.num_tokens, "shard.tar", 64)
    assert sample["hidden"].dtype == np.uint8 and sample[scale_member("hidden")].shape == (6,)
    del raw["hidden_scale.npy"]
    with pytest.raises(SampleError, match=r"shard.tar: sample 000000000 lacks the member 'hidden_scale.npy'"):
        decode_sample(raw, manifest.fields, manifest.num_tokens, "shard.tar", 64)


def test_extraction_at_float8_matches_float32_within_the_bound_and_validates(tmp_path):
    target = build_tiny_toy_target()
    run_extraction(tiny_config(tmp_path / "f32", feature_dtype="float32"), target=target, progress=False)
    manifest = run_extraction(tiny_config(tmp_path / "fp8", feature_dtype=FP8_DTYPE), target=target, progress=False)
    assert manifest is not None and {manifest.fields[name].dtype for name in FIELDS} == {FP8_DTYPE}
    assert validate_dataset(tmp_path / "fp8", progress=False)["samples"] == 6
    assert load_manifest(tmp_path / "f32").fields["hidden"].dtype == "float32"
    exact, quantised = read_samples(tmp_path / "f32"), read_samples(tmp_path / "fp8")
    assert sorted(quantised) == sorted(exact)
    for key, sample in quantised.items():
        np.testing.assert_array_equal(sample["tokens"], exact[key]["tokens"])  # the same samples were drawn
        for name in FIELDS:
            scales = sample[scale_member(name)]  # (16,) beside (16, width) codes: a byte per element
            assert sample[name].nbytes * 4 == exact[key][name].nbytes and scales.shape == sample[name].shape[:1]
            back = dequantize_rows(sample[name], scales)
            assert (np.abs(back - exact[key][name]) <= error_bound(exact[key][name], scales)).all(), (key, name)


def test_feature_dtype_float8_is_a_config_choice_and_its_checks_run_before_quantising(tmp_path):
    config = load_config(None, [f"out_dir={tmp_path}", "feature_dtype=float8_e4m3fn"])
    assert config.feature_dtype == FP8_DTYPE
    with pytest.raises(ValueError, match="feature_dtype='float8'; use one of float16, float32, float8_e4m3fn"):
        load_config(None, [f"out_dir={tmp_path}", "feature_dtype=float8"])
    features = np.ones((2, 3, 4), np.float32)
    stored = _cast_checked(features, FP8_DTYPE, "aux", 8)
    assert stored["aux"].dtype == np.uint8 and stored["aux_scale"].shape == (2, 3)
    features[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"field 'aux' .* sample 8 holds 1 non-finite values .* before quantising"):
        _cast_checked(features, FP8_DTYPE, "aux", 8)
    features[1, 2, 3] = 1e5
    with pytest.raises(ValueError, match=r"max \|x\| = 1e\+05, beyond float16's 65504.*use feature_dtype: float32"):
        _cast_checked(features, FP8_DTYPE, "aux", 8)
