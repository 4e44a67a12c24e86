"""`python -m inference.measure.gpu_check` on a CPU: the report's plumbing (tests/test_gpu.py itself needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inference.measure.gpu_check import main, merge_phases, run_gpu_tests

FAKE_GPU_TESTS = """
import pytest

pytestmark = pytest.mark.gpu


def test_records_figures(record_property):
    record_property("peak_memory_gib", 12.5)
    record_property("p_values", [0.5, 0.25])


def test_fails():
    assert 1 == 2, "one is not two"


def test_skips():
    pytest.skip("no such device")


@pytest.mark.skip(reason="skipped at setup")
def test_skipped_at_setup():
    pass
"""


def test_the_plugin_reports_outcomes_durations_and_figures(tmp_path: Path):
    tests = tmp_path / "test_fake_gpu.py"
    tests.write_text(FAKE_GPU_TESTS)
    records = tmp_path / "records.jsonl"
    code, timed_out, output = run_gpu_tests(records, 120, ["-p", "no:cacheprovider"], tests=tests)
    assert code == 1 and not timed_out, output  # one test failed
    merged = {entry["test"].rsplit("::", 1)[-1]: entry for entry in merge_phases(
        [json.loads(line) for line in records.read_text().splitlines()])}  # fmt: skip
    assert {name: entry["outcome"] for name, entry in merged.items()} == {
        "test_records_figures": "passed", "test_fails": "failed", "test_skips": "skipped",
        "test_skipped_at_setup": "skipped",
    }  # fmt: skip
    assert merged["test_records_figures"]["figures"] == {"peak_memory_gib": 12.5, "p_values": [0.5, 0.25]}
    assert "one is not two" in merged["test_fails"]["message"] and merged["test_fails"]["message"].startswith("call")
    assert "no such device" in merged["test_skips"]["message"]
    assert "skipped at setup" in merged["test_skipped_at_setup"]["message"]
    assert all(entry["seconds"] >= 0 for entry in merged.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu tests run: see tests/test_gpu.py")
def test_without_cuda_every_gpu_test_is_skipped_and_the_report_is_written(tmp_path: Path, capsys):
    out = tmp_path / "reports" / "gpu_check.json"
    assert main(["--out", str(out), "-k", "lossless"]) == 0
    report = json.loads(out.read_text())
    assert report["device"] is None and report["versions"]["torch"] and report["timed_out"] is False
    assert report["summary"]["skipped"] == report["summary"]["total"] == 3 and report["summary"]["failed"] == 0
    assert all("needs a CUDA GPU" in test["message"] for test in report["tests"])
    assert f"wrote {out}" in capsys.readouterr().out
