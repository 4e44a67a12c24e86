"""Extraction as the user runs it: both CLI forms, kill -9 then resume, and two ranks under torchrun.

These run subprocesses (each imports torch), so they take a few seconds each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data.shard_reader import iter_raw_samples
from data.shards import load_manifest
from data.validate import validate_dataset

REPO = Path(__file__).resolve().parents[1]
EXTRACT_TINY = REPO / "tests" / "scripts" / "extract_tiny.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(args: list[str], cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def sample_set(folder: Path) -> dict[str, tuple]:
    """Every sample of a dataset, as (key -> raw bytes of each member)."""
    manifest = load_manifest(folder)
    return {
        raw["__key__"]: tuple(sorted((k, bytes(v)) for k, v in raw.items() if k != "__key__"))
        for info in manifest.shards
        for raw in iter_raw_samples(folder / info.name)
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted extraction of 12 samples (3 shards of 4) by the test script."""
    out = tmp_path_factory.mktemp("reference") / "ds"
    result = run([str(EXTRACT_TINY), str(out)])
    assert result.returncode == 0, result.stderr
    return out


def test_both_cli_forms_validate_a_dataset(reference, tmp_path):
    script = run([str(REPO / "data" / "extract.py"), "--validate", str(reference), "--no-progress"], cwd=tmp_path)
    module = run(["-m", "data.extract", "--validate", str(reference), "--no-progress"])
    for result in (script, module):
        assert result.returncode == 0, result.stderr
        assert "OK, 3 shards, 12 samples" in result.stdout
    missing = run(["-m", "data.extract", "--config", str(tmp_path / "nope.yaml")])
    assert missing.returncode != 0 and "nope.yaml" in missing.stderr


def test_kill_9_mid_shard_then_rerun_gives_the_identical_sample_set(reference, tmp_path):
    out = tmp_path / "ds"
    killed = run([str(EXTRACT_TINY), str(out), "--kill-after-writes", "6"])  # dies inside the second shard
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["shard-000000.tar", "shard-000001.tar.partial"]
    finished = (out / "shard-000000.tar").stat()
    resumed = run([str(EXTRACT_TINY), str(out)])
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "shard-000000.tar").stat().st_mtime_ns == finished.st_mtime_ns  # never rewritten
    assert not list(out.glob("*.partial"))
    assert load_manifest(out).shards == load_manifest(reference).shards  # same names, counts and sha256
    assert sample_set(out) == sample_set(reference)
    assert validate_dataset(out, progress=False)["samples"] == 12


def test_two_ranks_under_torchrun_split_the_prompts_and_merge_the_manifest(reference, tmp_path):
    out = tmp_path / "ds"
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0", str(EXTRACT_TINY), str(out)]
    result = run(args, timeout=180)
    assert result.returncode == 0, result.stderr
    sidecars = [json.loads(p.read_text()) for p in sorted((out / ".extract").glob("shard-*.json"))]
    assert [s["first_index"] for s in sidecars] == [0, 4, 8]
    assert load_manifest(out).shards == load_manifest(reference).shards


@pytest.mark.parametrize(
    "name", ["extract_toy", "extract_texture", "extract_janus", "extract_llamagen", "extract_lumina"]
)
def test_every_extraction_recipe_parses_and_prints_its_resolved_config(name, capsys):
    from data.extract import main

    config = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    assert main(["--config", str(config), "--prompts.count", "16", "--batch_size=2", "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    recipe = yaml.safe_load(config.read_text())
    assert printed["target"] == recipe["target"] and printed["out_dir"] == recipe["out_dir"]
    assert printed["prompts"]["count"] == 16 and printed["batch_size"] == 2  # both override styles applied
    assert printed["store_aux"] and printed["store_uncond"]


def test_a_dotted_flag_without_value_or_an_unknown_key_is_an_error(capsys):
    from data.extract import main

    config = Path(__file__).resolve().parents[1] / "configs" / "extract_toy.yaml"
    assert main(["--config", str(config), "--prompts.count", "--print_config"]) == 1
    assert "--prompts.count needs a value" in capsys.readouterr().err
    assert main(["--config", str(config), "--prompt.count", "3", "--print_config"]) == 1
    assert "unknown key(s) ['prompt']" in capsys.readouterr().err
