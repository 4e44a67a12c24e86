"""`python -m inference.decoding_table`: one command, every tree kind, the table and plot of docs/results.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_toy_target
from PIL import Image

from inference.decoding.peer_rules import LANTERN_PP_K, LANTERN_PP_LAM, LANTERN_PP_REPO_RUNS
from inference.measure.decoding_table import main
from inference.measure.methods import SWEEP_GRID, load_grid
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import TARGET_LOADERS


@pytest.fixture
def drafter(tmp_path, monkeypatch):
    monkeypatch.setitem(TARGET_LOADERS, "tiny-bench", lambda **kwargs: build_tiny_toy_target(grid=6))
    torch.manual_seed(0)
    return EagleDraftModel(drafter_preset("tiny", "eagle3")).save_pretrained(tmp_path / "drafter")


def test_one_command_writes_the_table_the_plot_and_the_records_for_every_tree(drafter, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([
        {"series": "exact", "rule": "exact"},
        {"series": "cascade", "rule": "cascade", "options": {"delta": 0.5}},
    ]))  # fmt: skip
    out = tmp_path / "table"
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--grid", str(grid), "--num-prompts", "2",
            "--trees", "static,dynamic", "--prompt-seed", "7", "--tuned-on", "3", "--out", str(out)]  # fmt: skip
    records = main(argv)
    assert [(r["tree"], r["label"]) for r in records] == [
        (tree, label) for tree in ("static", "dynamic") for label in ("ar", "exact", "cascade[delta=0.5]")
    ]
    table = (out / "table.md").read_text()
    assert table.count("### Tree ") == 2 and "### Tree static toy_demo_fit_8 (9 nodes)" in table
    assert "python -m inference.decoding_table" in table and "seed 7; settings tuned on seed 3" in table
    assert table.count("| cascade[delta=0.5] | delta 0.5") == 2  # each rule's settings, once per tree
    saved = json.loads((out / "table.json").read_text())
    assert saved["prompt_seed"] == 7 and saved["tuned_on"] == 3 and len(saved["records"]) == 6
    assert {r["series"] for r in saved["records"]} >= {"exact (static)", "cascade (dynamic)", "ar"}
    assert Image.open(out / "tau_quality.png").size[0] > 400


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt-seed", "11", "--tuned-on", "11"], "is the seed the grid was tuned on"),
        (["--trees", "static,bushy"], "unknown tree kind.*bushy.*accepted: static, dynamic, dynamic-sampled"),
    ],
)
def test_bad_requests_are_refused_before_decoding(drafter, tmp_path, extra, message):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"series": "exact", "rule": "exact"}]))
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--grid", str(grid), "--out", str(tmp_path / "t")]
    with pytest.raises(SystemExit, match=message):
        main([*argv, *extra])
    assert not (tmp_path / "t").exists()


def test_a_static_tree_file_replaces_the_default_and_a_tree_with_a_hole_is_refused(drafter, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"series": "exact", "rule": "exact"}]))
    tree = tmp_path / "fitted.json"
    tree.write_text(json.dumps({"paths": [[0], [1], [0, 0]]}))
    argv = ["--target", "tiny-bench", "--drafter", str(drafter), "--grid", str(grid), "--num-prompts", "1",
            "--trees", "static", "--out", str(tmp_path / "t")]  # fmt: skip
    main([*argv, "--static-tree", str(tree)])
    saved = json.loads((tmp_path / "t" / "table.json").read_text())
    assert saved["trees"][0]["tree"]["static_tree"] == str(tree)
    assert f"### Tree static {tree} (4 nodes)" in (tmp_path / "t" / "table.md").read_text()
    # (1,) is missing: a hole (docs/method.md, section "Tree verification")
    tree.write_text(json.dumps({"paths": [[0], [2]]}))
    with pytest.raises(SystemExit, match=r"--static-tree .*fitted.json.*\(1,\)"):
        main([*argv[:-2], "--out", str(tmp_path / "u"), "--static-tree", str(tree)])
    with pytest.raises(SystemExit, match="has none"):
        main([*argv[:-4], "--trees", "dynamic", "--out", str(tmp_path / "u"), "--static-tree", str(tree)])
    assert not (tmp_path / "u").exists()


def test_the_shipped_grid_lists_lanterns_published_settings():
    """configs/decoding_table.json (and bench's SWEEP_GRID) run LANTERN++ at the CASCADE authors' baseline (k 10,
    lam 3) and at the LANTERN repository's own runs (run.sh: k 10 lam 5, k 5 lam 10, k 5 lam 20)."""
    published = {(LANTERN_PP_K, LANTERN_PP_LAM), *LANTERN_PP_REPO_RUNS}
    assert published == {(10, 3.0), (10, 5.0), (5, 10.0), (5, 20.0)}
    for grid in (load_grid(Path(__file__).parents[1] / "configs" / "decoding_table.json"), SWEEP_GRID):
        lantern_pp = {(o["k"], o["lam"]) for series, rule, o in grid if rule == "lantern++"}
        assert lantern_pp == published
