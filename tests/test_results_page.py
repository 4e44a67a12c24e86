"""docs/results.md is what `python -m inference.results` renders, and every table on it names its command."""

from __future__ import annotations

import json
import re

import pytest

from inference.measure.results import PAGE, RESULTS, main, regeneration, render_page, uncommitted_sources

PROVENANCE = re.compile(r"\d{4}-\d{2}-\d{2}, \d+ CPU cores, [^,]+, torch [0-9][^ ,;]*(, commit [0-9a-f]{7}|;|\.)")
"""Date, machine, torch, and the commit, or (a table of several runs) no commit: each row's is in its JSON."""
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")


def tables_without_provenance(page: str) -> list[str]:
    """The first line of every Markdown table that has no ```bash command block with a `python` line, or no
    date/machine/commit line, between it and the previous table or heading."""
    problems, context, in_table, in_code = [], [], False, False
    for line in page.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            context.append(line)
            continue
        if line.startswith("|") and not in_code:
            if not in_table:
                commands = [c for c in context if c.startswith(("python ", "torchrun "))]
                if not commands or not any(PROVENANCE.search(c) for c in context):
                    problems.append(line)
            in_table = True
            continue
        if in_table or line.startswith("#"):
            context = []
        in_table = False
        context.append(line)
    return problems


def test_the_checker_finds_a_table_without_its_command():
    page = (
        "## A\n\n```bash\npython -m inference.bench --rules exact\n```\n\n"
        "2026-12-07, 2 CPU cores, no GPU, torch 2.13.0, commit abcdef1.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "| c |\n|---|\n| 3 |\n\n## B\n\n| d |\n|---|\n"
    )
    assert tables_without_provenance(page) == ["| c |", "| d |"]


def test_every_table_of_the_results_page_names_its_command_date_and_machine():
    page = PAGE.read_text(encoding="utf-8")
    assert page.count("\n|---") >= 3, "the results page has no tables to check"
    assert tables_without_provenance(page) == []


def test_no_table_names_more_than_one_commit():
    for section in PAGE.read_text(encoding="utf-8").split("\n## ")[1:]:
        commits = {
            c for line in section.splitlines() if not line.startswith(("|", "python ")) for c in COMMIT.findall(line)
        }
        assert len(commits) <= 1, f"section {section.splitlines()[0]!r} names commits {sorted(commits)}"


def test_the_results_page_is_what_its_sources_render():
    # whether each source was made at a commit is the next test's question
    page = render_page(RESULTS, allow_uncommitted=True)
    assert PAGE.read_text(encoding="utf-8") == page, "run python -m inference.results"


def test_every_results_source_was_made_at_a_commit():
    assert uncommitted_sources(RESULTS) == []


def test_a_source_made_from_uncommitted_changes_is_refused_and_check_says_how_to_remake_it(tmp_path, capsys):
    clean = _decoding_table({"exact": 3.0, "cascade": 3.2}, "runs/a")
    dirty = _decoding_table({"exact": 3.1, "cascade": 3.3}, "runs/b")
    dirty["provenance"]["commit"] = "abcdef1+changes"
    dirty["command"] += ["--out", "outputs/b"]
    (tmp_path / "a.json").write_text(json.dumps(clean))
    (tmp_path / "b.json").write_text(json.dumps(dirty))
    sources = [{"label": "a", "file": "a.json"}, {"label": "b", "file": "b.json"}]
    (tmp_path / "page.json").write_text(json.dumps([{"title": "D", "kind": "drafters", "sources": sources}]))
    with pytest.raises(ValueError, match=r"b\.json: made at commit abcdef1\+changes"):
        render_page(tmp_path)
    page = tmp_path / "results.md"
    page.write_text(render_page(tmp_path, allow_uncommitted=True))  # the page itself is up to date
    with pytest.raises(SystemExit) as refused:
        main(["--results", str(tmp_path), "--out", str(page), "--check"])
    message = str(refused.value)
    assert "a.json" not in message  # the clean source is not named
    assert "b.json: made at commit abcdef1+changes" in message
    remake = "python -m inference.decoding_table --drafter runs/b --out outputs/b && cp outputs/b/table.json"
    assert remake in message
    dirty["provenance"]["commit"] = "abcdef1"  # remade at a commit: the check passes
    (tmp_path / "b.json").write_text(json.dumps(dirty))
    page.write_text(render_page(tmp_path))
    main(["--results", str(tmp_path), "--out", str(page), "--check"])
    assert "up to date" in capsys.readouterr().out


def test_a_source_recorded_under_a_moved_command_is_remade_by_the_command_of_now():
    """training.convergence_region moved to inference.convergence_region: the source keeps its recorded command, its
    regeneration runs the new one and copies the JSON that one writes."""
    recorded = {"command": ["python", "-m", "training.convergence_region", "--config", "demo", "--out", "outputs/c"]}
    assert regeneration(recorded, "c.json") == (
        "python -m inference.convergence_region --config demo --out outputs/c"
        " && cp outputs/c/convergence_region.json docs/results/c.json"
    )
    assert recorded["command"][2] == "training.convergence_region"  # the payload itself is left as recorded


def _decoding_table(taus: dict[str, float], drafter: str) -> dict:
    records = [
        {"rule": rule, "series": f"{rule} (static)" if rule != "ar" else "ar", "label": rule, "tree": "static",
         "settings": {}, "tau": tau, "target_forwards_per_image": 36 / tau, "seconds_per_image": 0.1,
         "speedup_vs_ar": 1.0, "fidelity": 0.95, "fidelity_se": 0.01, "fid_vs_ar": 50.0}
        for rule, tau in {"ar": 1.0, **taus}.items()
    ]  # fmt: skip
    summary = {"tree": {"tree": "static"}, "num_prompts": 4, "prompt_source": "toy heldout, seed 2026", "seed": 0,
               "threads": 2, "seconds": 3.0}  # fmt: skip
    provenance = {"date": "2026-12-07", "machine": "2 CPU cores, no GPU", "torch": "2.13.0", "commit": "abcdef1"}
    command = ["python", "-m", "inference.decoding_table", "--drafter", drafter]
    return {"command": command, "provenance": provenance, "trees": [summary], "records": records}


def test_drafter_rows_and_arm_means_come_from_their_sources(tmp_path):
    sources = []
    for name, arm, exact, cascade in [("a0", "w2", 3.0, 3.3), ("a1", "w2", 3.2, 3.4), ("b0", "w1", 2.0, 2.1)]:
        (tmp_path / f"{name}.json").write_text(json.dumps(_decoding_table({"exact": exact, "cascade": cascade}, name)))
        sources.append({"label": name, "file": f"{name}.json", "arm": arm})
    page = [{"title": "Drafters", "kind": "drafters", "sources": sources}]
    (tmp_path / "page.json").write_text(json.dumps(page))
    rendered = render_page(tmp_path)
    assert "| a0 | 3.00 | 3.30 (1.100) |" in rendered
    # each arm's mean and max - min over its seeds
    assert (
        "- arm w2 (2 seeds, rows above): τ exact mean 3.100, seed spread 0.200; τ cascade mean 3.350, seed "
        "spread 0.100" in rendered
    )
    assert "- arm w1 (1 seeds, rows above): τ exact mean 2.000, seed spread 0.000" in rendered
    assert tables_without_provenance(rendered) == []


def test_each_row_of_a_drafters_table_reads_its_own_runs_tree(tmp_path):
    dynamic = _decoding_table({"exact": 1.5, "cascade": 1.8}, "d")
    dynamic["trees"][0]["tree"]["tree"] = "dynamic"
    for record in dynamic["records"]:
        record["tree"] = "dynamic"
    (tmp_path / "s.json").write_text(json.dumps(_decoding_table({"exact": 3.0, "cascade": 3.1}, "s")))
    (tmp_path / "d.json").write_text(json.dumps(dynamic))
    sources = [{"label": "static", "file": "s.json"}, {"label": "dynamic", "file": "d.json"}]
    (tmp_path / "page.json").write_text(json.dumps([{"title": "T", "kind": "drafters", "sources": sources}]))
    rendered = render_page(tmp_path)
    assert "| static | 3.00 | 3.10 (1.033) |" in rendered and "| dynamic | 1.50 | 1.80 (1.200) |" in rendered
    assert "| drafter | τ exact |" in rendered  # the default row header


def test_a_source_without_provenance_or_command_is_refused(tmp_path):
    payload = _decoding_table({"exact": 3.0}, "d")
    del payload["provenance"]
    (tmp_path / "d.json").write_text(json.dumps(payload))
    (tmp_path / "page.json").write_text(json.dumps([{"title": "T", "kind": "decoding_table", "file": "d.json"}]))
    with pytest.raises(ValueError, match="provenance"):
        render_page(tmp_path)
    del payload["command"]
    (tmp_path / "d.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="command"):
        render_page(tmp_path)


def test_a_table_of_runs_at_several_commits_names_none(tmp_path):
    sources = []
    for name, commit in [("a", "abcdef1"), ("b", "1234567")]:
        payload = _decoding_table({"exact": 3.0, "cascade": 3.1}, name)
        payload["provenance"]["commit"] = commit
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))
        sources.append({"label": name, "file": f"{name}.json"})
    (tmp_path / "page.json").write_text(json.dumps([{"title": "D", "kind": "drafters", "sources": sources}]))
    rendered = render_page(tmp_path)
    assert "abcdef1" not in rendered and "1234567" not in rendered
    assert "different commits, each in its JSON (a.json, b.json)" in rendered
    assert tables_without_provenance(rendered) == []


def test_a_json_with_its_own_table_renders_under_its_command(tmp_path):
    from inference.measure.pipeline.convergence_region import format_table

    summary = {"positions": 10, "convergent_share": 0.5, "pixel_threshold": 10.0,
               "config": {"source": "hidden raw", "tau": 0.625, "flagged_share": 0.4, "precision": 1.0, "recall": 0.8},
               "candidates": {"hidden raw": {"auc": 0.9, "threshold_same_share": 0.6}}}  # fmt: skip
    payload = {"command": ["python", "-m", "inference.convergence_region", "--config", "demo"],
               "provenance": _decoding_table({}, "d")["provenance"], "table": format_table(summary)}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(payload))
    (tmp_path / "page.json").write_text(json.dumps([{"title": "R", "kind": "table", "file": "r.json"}]))
    rendered = render_page(tmp_path)
    assert "| hidden raw | 0.900 | 0.600 |" in rendered and "precision 1.000, recall 0.800" in rendered
    assert tables_without_provenance(rendered) == []
    del payload["table"]
    (tmp_path / "r.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="'table' field"):
        render_page(tmp_path)
