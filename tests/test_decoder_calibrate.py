"""CASCADE's per-target similarity calibration: measured on real trees, stored beside the drafter, read by the rules."""

from __future__ import annotations

import json

import pytest
from test_drafter_models import tiny_drafter

from inference.decoding.calibrate import CALIBRATION_FILE, calibrate, load_calibration
from inference.decoding.eagle import EagleDrafter
from inference.decoding.generate import build_rule
from inference.decoding.speculative import DecoderConfig


def test_calibration_records_quantiles_and_rules_read_them(tiny_target, tmp_path):
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    config = DecoderConfig(tree="static", static_tree="mc_sim_7b_63")
    quantiles = {"tau_pos": 0.8, "tau_seq": 0.3}
    record = calibrate(tiny_target, drafter, ["a big green square on stripes"], config, quantiles)
    sibling, parent = record["sibling_similarity"], record["parent_similarity"]
    assert record["pairs"]["sibling"] > 10 and record["pairs"]["parent"] > 10
    assert -1.0 <= sibling["0.05"] <= sibling["0.5"] <= sibling["0.95"] <= 1.0
    assert parent["0.25"] <= record["tau_seq"] <= parent["0.5"]  # the 0.3 quantile
    assert sibling["0.75"] <= record["tau_pos"] <= sibling["0.9"]  # the 0.8 quantile
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(record))
    rule = build_rule("cascade", tiny_target, {"delta": "0.2"}, tmp_path)
    assert rule.tau_pos == pytest.approx(record["tau_pos"]) and rule.tau_seq == pytest.approx(record["tau_seq"])
    assert build_rule("cascade", tiny_target, {"tau_seq": "0.5"}, tmp_path).tau_seq == 0.5  # an explicit setting wins
    assert load_calibration(tmp_path / "elsewhere", tiny_target.name) == {}


def test_a_calibration_for_another_target_is_refused(tiny_target, tmp_path):
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"target": "janus-pro-7b", "tau_pos": 0.9, "tau_seq": 0.5}))
    with pytest.raises(ValueError, match="janus-pro-7b"):
        build_rule("cascade", tiny_target, None, tmp_path)
    (tmp_path / CALIBRATION_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not a CASCADE calibration"):
        load_calibration(tmp_path, tiny_target.name)
