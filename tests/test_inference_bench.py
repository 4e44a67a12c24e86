"""`python -m inference.bench`: one interleaved run of AR and the rules gives tau, forwards, time, speedup,
quality and the time split per step; `--sweep` draws the speed-quality plot. Tiny random models, seconds."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_toy_target
from PIL import Image

import inference.decoding.speculative as speculative
from inference.measure.bench import DecodePhaseTimer, main
from inference.measure.methods import parse_methods
from inference.measure.report import pareto_front
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import TARGET_LOADERS

TREE = "--tree dynamic --tree-top-k 3 --tree-depth 3 --tree-total 10".split()


@pytest.fixture
def drafter(tmp_path, monkeypatch):
    """--target tiny-bench: the tiny random target at the toy world's 36 x 36 pixels (6 x 6 tokens), so the
    scene reader can score it; and a tiny random EAGLE-3 drafter folder for it."""
    monkeypatch.setitem(TARGET_LOADERS, "tiny-bench", lambda **kwargs: build_tiny_toy_target(grid=6))
    torch.manual_seed(0)
    return EagleDraftModel(drafter_preset("tiny", "eagle3")).save_pretrained(tmp_path / "drafter")


def test_bench_reports_tau_forwards_speed_quality_and_time_split(drafter, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--rules", "ar,exact,cascade", "--num-prompts", "2"]
    markdown = tmp_path / "table.md"
    records = main(argv + ["--out", str(out), "--markdown", str(markdown), "--rule-arg", "cascade.delta=0.4", *TREE])
    summary = json.loads(out.read_text())
    assert [r["label"] for r in summary["records"]] == ["ar", "exact", "cascade"] == [r["label"] for r in records]
    assert summary["num_prompts"] == 2 and "bonus" in summary["tau_definition"] and "noise floor" in summary["fid_note"]
    ar, exact, cascade = summary["records"]
    assert ar["tau"] == 1.0 and ar["target_forwards_per_image"] == 36 and ar["speedup_vs_ar"] == pytest.approx(1.0)
    assert cascade["settings"]["delta"] == 0.4 and exact["settings"] == {}
    for r in (exact, cascade):
        assert 1.0 <= r["tau"] <= 4.0
        # 36 tokens: the prefill's + (tau per verification step) x (target forwards - 1)
        assert r["tau"] * (r["target_forwards_per_image"] - 1) == pytest.approx(35, abs=1e-3)
        assert r["drafter_forwards_per_image"] > 0 and r["seconds_per_image"] > 0 and r["speedup_vs_ar"] > 0
        assert {"verify", "target", "draft", "view", "wall"} <= set(r["ms_per_step"])
        assert 0 < r["verify_share"] < 1 and r["verify_vs_target"] > 0
    for r in (ar, exact, cascade):
        assert 0.0 <= r["fidelity"] <= 1.0 and r["fidelity_se"] >= 0.0
        assert r["fid_vs_ar"] is None or r["fid_vs_ar"] >= 0.0
    assert exact["tv_charged_per_step"] == 0.0 and cascade["tv_charged_per_step"] <= 0.4 + 1e-6
    written = markdown.read_text()
    assert "python -m inference.bench" in written and "--rule-arg cascade.delta=0.4" in written
    assert written.count("\n| ") == 4 and "| cascade | delta 0.4" in written  # header + 3 methods, settings shown
    table = capsys.readouterr().out
    assert "tau" in table and "speedup" in table and "verify share" in table and "cascade" in table


def test_count_ops_reports_one_host_read_per_step_for_every_rule_and_tree(drafter, capsys):
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--rules", "exact,cascade,gsd-blocks", "--count-ops"]
    rows = main([*argv, "--num-prompts", "1"])
    assert {(r["tree"], r["rule"]) for r in rows} == {
        (t, r) for t in ("static", "dynamic", "dynamic-sampled") for r in ("exact", "cascade", "gsd-blocks")
    }
    assert all(r["syncs_per_step"] <= 1.0 and r["ops"]["target"] > 0 for r in rows)
    assert "syncs/step" in capsys.readouterr().out


def test_sweep_writes_a_pareto_plot_and_its_points(drafter, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([
        {"series": "exact", "rule": "exact"},
        {"series": "cascade", "rule": "cascade", "options": {"delta": 0.2, "pool_beyond_tree": True}},
        {"series": "cascade", "rule": "cascade", "options": {"delta": 0.8, "pool_beyond_tree": True}},
    ]))  # fmt: skip
    out, plot = tmp_path / "sweep.json", tmp_path / "pareto.png"
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--num-prompts", "2", "--sweep", "--no-warmup"]
    main(argv + ["--sweep-grid", str(grid), "--out", str(out), "--plot", str(plot), *TREE])
    summary = json.loads(out.read_text())
    assert summary["plot"] == str(plot) and Image.open(plot).size[0] > 400
    labels = [r["label"] for r in summary["records"]]
    assert labels == [
        "ar",
        "exact",
        "cascade[delta=0.2,pool_beyond_tree=True]",
        "cascade[delta=0.8,pool_beyond_tree=True]",
    ]
    assert [r["series"] for r in summary["records"]] == ["ar", "exact", "cascade", "cascade"]
    assert summary["records"][3]["settings"]["delta"] == 0.8


def test_methods_labels_and_scoped_rule_arguments():
    methods = parse_methods("ar,cascade,cascade@wide", ["cascade.delta=0.3", "cascade@wide.tau_seq=0"])
    assert [(m.label, m.rule, m.options) for m in methods] == [
        ("ar", "ar", {}),
        ("cascade", "cascade", {"delta": "0.3"}),
        ("cascade@wide", "cascade", {"delta": "0.3", "tau_seq": "0"}),
    ]
    with pytest.raises(ValueError, match="not in --rules"):
        parse_methods("ar,exact", ["gsd-blocks.group=3"])
    with pytest.raises(ValueError, match="unknown rule"):
        parse_methods("ar,medusa", None)


def test_step_timer_times_every_phase_through_the_decoder_hooks(tiny_target):
    """No module global or method is replaced: the decode loop reports its phases to the timer."""
    from stub_drafters import OracleDrafter

    from inference.decoding.rules import ExactRule
    from inference.decoding.speculative import DecoderConfig, generate_speculative

    before = (speculative.verify, speculative.build_target_view, speculative._draft)
    timer = DecodePhaseTimer(tiny_target)
    config = DecoderConfig(tree="static", static_tree="mc_sim_7b_63")
    generate_speculative(tiny_target, OracleDrafter(tiny_target, scale=0.5), ["a big green square on stripes"],
                         ExactRule(), config, generator=torch.Generator().manual_seed(0), hooks=timer)  # fmt: skip
    seconds = timer.take()
    assert set(seconds) == {"draft", "target", "view", "verify", "commit"}
    assert all(value > 0 for value in seconds.values()) and timer.take() == {}
    assert (speculative.verify, speculative.build_target_view, speculative._draft) == before
    assert "forward" not in vars(tiny_target)


PLANTED_VERIFY_SECONDS = 0.05
"""A sleep planted into every verification: several times a tiny model's whole step, so it dominates the split."""


def test_the_bench_attributes_a_slowdown_planted_into_verification(drafter, monkeypatch):
    """A sleep planted into verification (its first call, `prepare_tree`) must show up as that many ms per step in
    the verify phase, in the rule's wall time per image (x its verification steps), and nowhere in AR (which never
    verifies) or the other phases."""
    import time

    import inference.decoding.verify as verification

    real_prepare = verification.prepare_tree

    def slowed(*args, **kwargs):
        time.sleep(PLANTED_VERIFY_SECONDS)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(verification, "prepare_tree", slowed)
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--rules", "ar,exact", "--num-prompts", "1"]
    ar, exact = main([*argv, "--no-warmup", *TREE])
    planted_ms = PLANTED_VERIFY_SECONDS * 1e3
    split = exact["ms_per_step"]
    assert planted_ms <= split["verify"] < planted_ms + 50, split  # the sleep, plus a tiny tree's verification
    assert split["verify"] > split["target"] + split["draft"] + split["view"], split
    assert exact["verify_share"] > 0.5
    steps = exact["target_forwards_per_image"] - 1  # one verification per forward after the prefill
    assert exact["seconds_per_image"] >= steps * PLANTED_VERIFY_SECONDS
    assert ar["seconds_per_image"] < PLANTED_VERIFY_SECONDS * steps / 2  # AR is untouched


def test_pareto_front_keeps_the_undominated_points():
    assert pareto_front([(1, 0.5), (2, 0.4), (1.5, 0.3), (3, 0.1), (2, 0.2)]) == [(1, 0.5), (2, 0.4), (3, 0.1)]


def test_repeats_time_each_image_by_its_median_decode_and_keep_the_tokens(drafter, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--rules", "ar,exact", "--num-prompts", "1"]
    once = main([*argv, "--no-warmup", *TREE])
    repeated = main([*argv, "--no-warmup", "--repeats", "3", "--out", str(out), *TREE])
    assert json.loads(out.read_text())["repeats"] == 3
    assert "each decoded 3 times (time: the median)" in capsys.readouterr().out
    for a, b in zip(once, repeated, strict=True):  # same seeds: same tokens, so the same tau and forwards
        assert a["tau"] == b["tau"] and a["target_forwards_per_image"] == b["target_forwards_per_image"]
        assert b["seconds_per_image"] > 0
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        main([*argv, "--repeats", "0"])
