"""CASCADE's per-target similarity calibration: measured on real trees, stored beside the drafter, read by the rules."""

from __future__ import annotations

import json

import pytest
import torch
from test_drafter_models import tiny_drafter

from inference.decoding.calibrate import CALIBRATION_FILE, calibrate, load_calibration
from inference.decoding.eagle import EagleDrafter
from inference.decoding.generate import build_rule
from inference.decoding.rules import CascadeRule
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative


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


class StreamRecorder(DecodeHooks):
    """The features CASCADE read at every verification."""

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def on_verify(self, tree, view, verdict) -> None:
        self.features.append(view.features.clone())


@pytest.mark.parametrize("architecture", ["eagle3", "eagle1"])
def test_an_aux_representation_reads_that_stream_of_the_tree_forward(tiny_target, architecture):
    """aux-low/mid/high are slices of the EAGLE-3 streams at the tree nodes, with either drafter (an EAGLE-1
    drafter's decode asks the target for the streams only for this rule); hidden is the last state."""
    drafter = EagleDrafter(tiny_drafter(architecture).eval(), tiny_target)
    seen = {}
    for representation in ("hidden", "aux-low", "aux-mid", "aux-high"):
        recorder = StreamRecorder()
        rule = CascadeRule(delta=0.0, representation=representation)
        generate_speculative(tiny_target, drafter, ["a big green square"], rule, DecoderConfig(tree="dynamic"),
                             generator=torch.Generator().manual_seed(0), hooks=recorder)  # fmt: skip
        seen[representation] = recorder.features[0][0]  # (N, D) first tree, first row
    tree_nodes = seen["hidden"].shape[0]
    width = tiny_target.hidden_size
    assert all(f.shape == (tree_nodes, width) for f in seen.values())
    streams = [seen[name] for name in ("aux-low", "aux-mid", "aux-high")]
    for i, j in [(0, 1), (1, 2), (0, 2)]:
        assert not torch.allclose(streams[i], streams[j]), "two streams gave the same features"
    assert not torch.allclose(streams[2], seen["hidden"])


def test_a_calibration_sets_its_representation_and_refuses_another_without_thresholds(tiny_target, tmp_path):
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    config = DecoderConfig(tree="static", static_tree="mc_sim_7b_63")
    record = calibrate(tiny_target, drafter, ["a big green square on stripes"], config, representation="aux-low")
    hidden = calibrate(tiny_target, drafter, ["a big green square on stripes"], config)
    assert record["representation"] == "aux-low" and record["tau_pos"] != hidden["tau_pos"]
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(record))
    rule = build_rule("cascade", tiny_target, None, tmp_path)
    assert rule.representation == "aux-low" and rule.tau_pos == pytest.approx(record["tau_pos"])
    with pytest.raises(ValueError, match="representation 'aux-low', not 'hidden'"):
        build_rule("cascade", tiny_target, {"representation": "hidden"}, tmp_path)
    explicit = build_rule("cascade", tiny_target, {"representation": "hidden", "tau_pos": "0.5", "tau_seq": "0.4"},
                          tmp_path)  # fmt: skip
    assert (explicit.representation, explicit.tau_pos, explicit.tau_seq) == ("hidden", 0.5, 0.4)
    with pytest.raises(ValueError, match="representation must be one of"):
        CascadeRule(representation="aux-top")


def test_the_latent_representation_reads_the_codes_of_the_tree_tokens(tiny_target):
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    trees: list = []

    class Both(StreamRecorder):
        def on_verify(self, tree, view, verdict) -> None:
            super().on_verify(tree, view, verdict)
            trees.append(tree.tokens.clone())

    recorder = Both()
    rule = CascadeRule(delta=0.0, representation="latent")
    generate_speculative(tiny_target, drafter, ["a big green square"], rule, DecoderConfig(tree="dynamic"),
                         generator=torch.Generator().manual_seed(0), hooks=recorder)  # fmt: skip
    for tokens, features in zip(trees, recorder.features, strict=True):
        torch.testing.assert_close(features, tiny_target.latent_table()[tokens])
