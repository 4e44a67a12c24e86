"""`python -m inference.generate` writes PNGs, a grid and a JSON summary: AR with the shipped toy target, and
tree speculative decoding with a tiny random drafter on the tiny test target (per-image tau, forwards, time)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_toy_target
from PIL import Image

from inference.decoding.generate import build_rule, default_lantern_k, main
from inference.decoding.peer_rules import LANTERN_PP_K, LANTERN_PP_LAM
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import TARGET_LOADERS
from models.toy.world import PATCH_SIZE


def test_generate_writes_images_grid_and_summary(tmp_path):
    prompt = "a large yellow circle in the center on a plain blue background"
    main(["--target", "toy", "--prompt", prompt, "--num-images", "3", "--out", str(tmp_path),
          "--cfg-scale", "2.0", "--top-k", "50", "--seed", "1"])  # fmt: skip
    summary = json.loads((tmp_path / "generation.json").read_text())
    assert [record["file"] for record in summary["images"]] == ["00000.png", "00001.png", "00002.png"]
    assert summary["sampling"]["cfg_scale"] == 2.0 and summary["sampling"]["top_k"] == 50
    assert Image.open(tmp_path / "00000.png").size == (36, 36)
    assert Image.open(tmp_path / "grid.png").size[0] > 36


@pytest.fixture
def tiny_setup(tmp_path, monkeypatch):
    """The tiny random target registered as --target tiny-test, and a tiny EAGLE-3 drafter folder for it."""
    monkeypatch.setitem(TARGET_LOADERS, "tiny-test", lambda **kwargs: build_tiny_toy_target())
    torch.manual_seed(0)
    folder = EagleDraftModel(drafter_preset("tiny", "eagle3")).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "a small red circle at the top left on a plain blue background\n\na big green square on stripes\n"
    )
    return folder, prompts


@pytest.mark.parametrize(
    "rule, rule_args", [("cascade", ["delta=0.3", "pool_beyond_tree=true"]), ("lantern++", ["lam=2"])]
)
def test_generate_with_a_drafter_writes_per_image_tau_forwards_and_time(tiny_setup, tmp_path, capsys, rule, rule_args):
    drafter, prompts = tiny_setup
    out = tmp_path / "out"
    tree = "--tree dynamic --tree-top-k 3 --tree-depth 3 --tree-total 10".split()
    argv = ["--target", "tiny-test", "--drafter", str(drafter), "--rule", rule, "--prompts", str(prompts)]
    argv += ["--out", str(out), *tree]
    main(argv + [item for arg in rule_args for item in ("--rule-arg", arg)])
    summary = json.loads((out / "generation.json").read_text())
    assert summary["rule"] == rule and "bonus" in summary["tau_definition"]
    assert summary["speculative"]["tree"] == {
        "tree": "dynamic", "static_tree": "toy_demo_fit_8", "top_k": 3, "depth": 3, "total_tokens": 10
    }  # fmt: skip
    if rule == "cascade":
        assert summary["speculative"]["delta"] == 0.3 and summary["speculative"]["pool_beyond_tree"] is True
    else:
        assert summary["speculative"]["lam"] == 2.0
    records = summary["images"]
    assert [r["file"] for r in records] == ["00000.png", "00001.png"]
    for record in records:
        assert 1.0 <= record["tau"] <= 4.0  # depth 3: at most 3 drafts + the bonus token per forward
        assert record["target_forwards"] == 1 + record["verification_steps"]
        assert record["drafter_forwards"] >= record["verification_steps"] and record["seconds"] > 0
        # every token comes from the prefill or a verification step: 1 + sum(accepted + 1) = G
        assert round(record["tau"] * record["verification_steps"]) == 16 - 1
    assert Image.open(out / "00001.png").size == (4 * PATCH_SIZE,) * 2 and (out / "grid.png").exists()
    printed = capsys.readouterr().out
    assert "accepted drafts + 1 per target forward" in printed and "target forwards" in printed


def test_generate_rule_arguments_are_checked(tiny_setup, tmp_path):
    drafter, prompts = tiny_setup
    base = ["--target", "tiny-test", "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="no field 'bogus'"):
        main(base + ["--drafter", str(drafter), "--rule", "cascade", "--rule-arg", "bogus=1"])
    with pytest.raises(SystemExit, match="expected float"):
        main(base + ["--drafter", str(drafter), "--rule", "cascade", "--rule-arg", "delta=big"])
    with pytest.raises(SystemExit, match="need --drafter"):
        main(base + ["--rule", "exact"])


def test_build_rule_parses_every_field_type(tiny_target):
    rule = build_rule("cascade", tiny_target, {"delta": "0.25", "conf_gate": "none", "kl_gate": "4",
                                               "use_convergence": "false", "conv_mode": "path"})  # fmt: skip
    assert (rule.delta, rule.conf_gate, rule.kl_gate, rule.use_convergence, rule.conv_mode) == (
        0.25, None, 4.0, False, "path"
    )  # fmt: skip
    lantern = build_rule("lantern", tiny_target, {"k": "5"})
    assert lantern.k == 5 and lantern.neighbours.shape == (64, 6) and lantern.lam is None
    assert build_rule("lantern++", tiny_target).lam == 3.0
    assert build_rule("gsd-blocks", tiny_target, {"group": "7"}).group == 7
    assert build_rule("gsd", tiny_target, {"window": "6"}).window == 6


def test_build_rule_gives_lantern_its_published_defaults_by_target_family(tiny_target):
    """LANTERN++ without settings is the CASCADE authors' baseline (k 10, lam 3; docs/method.md, section "The baselines,
    as their authors' code runs them"), not k 1000; static_zeroes follows LANTERN's file for the target's family
    (LlamaGen: q, Lumina-mGPT: p); options win."""
    assert tiny_target.family == "llamagen"  # the toy world's LlamaGen
    plus = build_rule("lantern++", tiny_target)
    assert (plus.k, plus.lam, plus.static_zeroes) == (LANTERN_PP_K, LANTERN_PP_LAM, "q") == (10, 3.0, "q")
    assert plus.neighbours.shape == (64, 11)  # the table is sized for the default k (+ 1 zapped on rejection)
    lantern = build_rule("lantern", tiny_target, {"k": "none"})  # "none": the mode's default, scaled to V = 64
    assert (lantern.k, lantern.delta, lantern.static_zeroes) == (default_lantern_k(64), 0.1, "q") == (4, 0.1, "q")
    tiny_target.family = "lumina"  # this instance only (the fixture builds one per test)
    assert build_rule("lantern++", tiny_target).static_zeroes == "p"
    assert build_rule("lantern", tiny_target).static_zeroes == "p"
    assert build_rule("lantern++", tiny_target, {"static_zeroes": "q", "k": "5"}).static_zeroes == "q"
    with pytest.raises(ValueError, match="lantern k must be in 1..62 for 64 codes, got 80"):
        build_rule("lantern++", tiny_target, {"k": "80"})


def test_tree_options_must_fit_the_tree_kind():
    from argparse import Namespace

    from inference.decoding.generate import decoder_config

    def args(**given):
        base = dict(tree=None, static_tree=None, tree_top_k=None, tree_depth=None, tree_total=None)
        return Namespace(**{**base, **given})

    assert decoder_config(args()).tree == "static"
    with pytest.raises(ValueError, match="--tree-depth shape the dynamic trees"):
        decoder_config(args(tree_depth=3))
    with pytest.raises(ValueError, match="--static-tree names a static list"):
        decoder_config(args(tree="dynamic", static_tree="mc_sim_7b_63"))
    assert decoder_config(args(tree="dynamic-sampled", tree_depth=3, tree_total=10)).depth == 3
