"""`inference.measure.tree_fit`: path acceptance frequencies add up to the decode's tau, the fitted tree is the best
closed sub-tree, a fitted tree file decodes, and the toy target names its own default tree."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from conftest import build_tiny_toy_target
from stub_drafters import OracleDrafter

from inference.decoding.rules import ExactRule
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.tree import MC_SIM_7B_63, StaticTreeSpec, load_static_tree
from inference.measure.tree_fit import candidate_paths, fit_static_tree, main, measure_path_acceptance
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import TARGET_LOADERS
from models.target import ImageTarget

PROMPTS = ["a big green square on stripes", "a small red circle at the top left", "two blue triangles"]


def closed(paths: set[tuple[int, ...]]) -> bool:
    """Every path's parent and earlier sibling are in the set (or are the root)."""
    have = paths | {()}
    return all(p[:-1] in have and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in have) for p in paths)


def test_candidate_tree_holds_every_path_within_its_depth_and_budget():
    paths = candidate_paths(3, 1)
    assert set(paths) == {(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)}
    assert len(candidate_paths(7, 3)) == 329 and closed(set(candidate_paths(7, 3)))
    StaticTreeSpec(candidate_paths(4, 2))  # a valid static list
    with pytest.raises(ValueError, match="depth >= 1"):
        candidate_paths(0, 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fitted_tree_is_the_best_closed_sub_tree(seed):
    """Frequencies that fall from a node to its children and later siblings (as an accepted path's do): the
    greedy fit equals the best of every closed sub-tree of that size, found by enumeration."""
    rng = random.Random(seed)
    candidate = candidate_paths(3, 2)
    rank_factor = [sorted((rng.uniform(0.2, 0.95) for _ in range(3)), reverse=True) for _ in range(3)]
    frequencies = {p: 1.0 for p in candidate}
    for p in candidate:
        for depth, rank in enumerate(p):
            frequencies[p] *= rank_factor[depth][rank]
    for drafts in range(1, 6):
        paths, tau = fit_static_tree(frequencies, drafts)
        assert len(paths) == drafts and closed(set(paths)) and list(paths) == sorted(paths, key=lambda p: (len(p), p))
        best = max(sum(frequencies[p] for p in subset)
                   for subset in itertools.combinations(candidate, drafts) if closed(set(subset)))  # fmt: skip
        assert tau == pytest.approx(1.0 + best)
    shallow, _ = fit_static_tree(frequencies, 3, max_depth=1)
    assert all(len(p) == 1 for p in shallow)
    with pytest.raises(ValueError, match="fewer than 4 drafts within depth 1"):
        fit_static_tree(frequencies, 4, max_depth=1)


def test_acceptance_frequencies_add_up_to_the_tau_of_the_same_decode(tiny_target):
    drafter, rule, candidate = OracleDrafter(tiny_target, scale=0.7), ExactRule(), candidate_paths(4, 1)
    frequencies, steps = measure_path_acceptance(tiny_target, drafter, PROMPTS, rule, candidate, seed=5)
    assert set(frequencies) == set(candidate) and all(0.0 <= f <= 1.0 for f in frequencies.values())
    assert frequencies[(0,)] >= frequencies[(0, 0)] >= frequencies[(0, 0, 0)]  # a child only after its parent
    total_steps, total = 0, 0.0
    config = DecoderConfig(tree="static", static_tree=candidate)
    for i, prompt in enumerate(PROMPTS):  # the same decodes, tallied by the decoder itself
        result = generate_speculative(tiny_target, drafter, [prompt], rule, config,
                                      generator=torch.Generator().manual_seed(5 + i))  # fmt: skip
        count, summed = result.tally()
        total_steps, total = total_steps + count, total + summed
    assert steps == total_steps > 0
    assert 1.0 + sum(frequencies.values()) == pytest.approx(total / total_steps)
    assert sum(frequencies.values()) > 0.5  # the oracle drafter gets drafts accepted: the test sees real paths


def test_the_toy_target_names_its_fitted_default_tree_and_others_keep_eagles(tiny_target):
    assert DecoderConfig().for_target(tiny_target).static_tree == "toy_demo_fit_8"
    assert DecoderConfig(static_tree="naive_extend_57").for_target(tiny_target).static_tree == "naive_extend_57"
    assert ImageTarget.default_static_tree == "mc_sim_7b_63" and load_static_tree("mc_sim_7b_63") == MC_SIM_7B_63
    resolved = DecoderConfig().for_target(tiny_target)
    assert (resolved.num_nodes, resolved.max_depth) == (9, 7)
    with pytest.raises(ValueError, match="for_target"):
        _ = DecoderConfig().spec
    result = generate_speculative(tiny_target, OracleDrafter(tiny_target, scale=0.7), PROMPTS[:1], ExactRule(),
                                  generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert result.tokens.shape == (1, 16) and result.tau >= 1.0


def test_a_bad_tree_file_is_refused_with_its_name_and_field(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=f"static tree file {missing}.*inference.tree_fit"):
        DecoderConfig(static_tree=str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"paths": [[0], [-1]]}))
    with pytest.raises(ValueError, match=f"static tree file {bad}: field 'paths'"):
        load_static_tree(str(bad))
    with pytest.raises(ValueError, match="neither a known list"):
        DecoderConfig(static_tree="mc_sim")
    orphan = tmp_path / "orphan.json"
    orphan.write_text(json.dumps({"paths": [[0], [1, 0, 0]]}))
    with pytest.raises(ValueError, match="lacks its parent path"):
        _ = DecoderConfig(static_tree=str(orphan)).spec


def test_the_cli_writes_trees_that_decode_and_never_overwrites_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(TARGET_LOADERS, "tiny-fit", lambda **kwargs: build_tiny_toy_target(grid=6))
    torch.manual_seed(0)
    drafter_dir = EagleDraftModel(drafter_preset("tiny", "eagle3")).save_pretrained(tmp_path / "drafter")
    out = tmp_path / "fit"
    base = ["--target", "tiny-fit", "--drafter", str(drafter_dir), "--num-prompts", "2", "--candidate-depth", "3",
            "--candidate-budget", "1"]  # fmt: skip
    fitted = main([*base, "--drafts", "2,4", "--out", str(out)])
    assert [r["drafts"] for r in fitted] == [2, 4] and "| drafts | depth | expected tau |" in capsys.readouterr().out
    record = json.loads((out / "drafts4.json").read_text())
    assert record["fitted_on"]["candidate"]["drafts"] == 9 and record["fitted_on"]["prompts"] == 2
    assert len(record["paths"]) == 4 and closed({tuple(p) for p in record["paths"]})
    acceptance = json.loads((out / "acceptance.json").read_text())["frequency"]
    assert len(acceptance) == 9 and list(acceptance.values()) == sorted(acceptance.values(), reverse=True)
    assert load_static_tree(str(out / "drafts4.json")) == tuple(tuple(p) for p in record["paths"])
    target = build_tiny_toy_target(grid=6)
    config = DecoderConfig(static_tree=str(out / "drafts4.json"))
    decoded = generate_speculative(target, OracleDrafter(target, scale=0.7), PROMPTS[:1], ExactRule(), config,
                                   generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert decoded.tokens.shape == (1, 36) and config.num_nodes == 5
    before = (out / "drafts4.json").read_bytes()
    with pytest.raises(SystemExit, match="acceptance.json exists: pass --overwrite"):
        main([*base, "--drafts", "4", "--out", str(out)])
    assert (out / "drafts4.json").read_bytes() == before
    with pytest.raises(SystemExit, match="--drafts 12: the candidate tree has fewer than 12"):
        main([*base, "--drafts", "12", "--out", str(tmp_path / "other")])
