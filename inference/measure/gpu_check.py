"""The GPU check: run the `gpu`-marked tests (tests/test_gpu.py) and write what they found to one JSON file.

    python -m inference.measure.gpu_check                      # writes gpu_check.json
    python -m inference.measure.gpu_check --out runs/gpu_check_h100.json --timeout 480

On one 80 GB GPU it takes about 5 minutes: a real-size Janus-Pro-7B (random weights) trains its EAGLE-3 drafter
for two steps under DeepSpeed ZeRO-2 in bf16 with online features, the decode latency command runs for the three
real-size targets, and `exact` speculative sampling is checked against AR on CUDA. The JSON holds the device, the
versions (torch, CUDA, cuDNN, DeepSpeed, Lightning, transformers), each test's outcome, duration and skip or
failure message, and the figures the tests record with `record_property` (peak memory, step latencies, p-values).
Without CUDA every test is skipped with its reason and the file is still written.

pytest runs in a child process (a CUDA error or a crash there cannot lose the report) with this module as its
plugin (`-p inference.measure.gpu_check`): each test report goes to a JSON-lines file, read back here. Exit
status: 0 when nothing failed (skips included), 1 when a test failed, 2 when pytest could not finish
(timeout, crash, collection error).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from inference.decoding.files import write_atomic

RECORDS_ENV = "GPU_CHECK_RECORDS"
"""The JSON-lines file the plugin half of this module appends test reports to (set for the pytest child only)."""
PLUGIN = "inference.measure.gpu_check"
"""This module, loaded by the pytest child as its plugin (`-p`)."""
ROOT = Path(__file__).resolve().parents[2]
TESTS = "tests/test_gpu.py"
"""The gpu tests, relative to the repository root `ROOT` (pytest's working folder)."""
DEFAULT_TIMEOUT_S = 480
PACKAGES = ("torch", "deepspeed", "lightning", "transformers", "pytest")


# ----------------------------------------------------------------------------- the pytest plugin half


def pytest_runtest_logreport(report: Any) -> None:
    """Append one phase report (setup, call, teardown) of one test to $GPU_CHECK_RECORDS."""
    path = os.environ.get(RECORDS_ENV)
    if not path:
        return
    message = None
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])  # (file, line, reason)
    elif report.failed:
        message = str(report.longrepr)[-4000:]
    record = {
        "test": report.nodeid,
        "phase": report.when,
        "outcome": report.outcome,
        "seconds": report.duration,
        "message": message,
        "figures": {str(name): _plain(value) for name, value in report.user_properties},
    }
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _plain(value: Any) -> Any:
    """A recorded figure as JSON can hold it (numbers, strings, lists of them); anything else as its str."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


# ----------------------------------------------------------------------------- the runner half


def merge_phases(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per test from its phase reports: failed if any phase failed, skipped if setup skipped,
    else the call's outcome; seconds summed over the phases; figures from every phase."""
    tests: dict[str, dict[str, Any]] = {}
    for record in records:
        entry = tests.setdefault(record["test"], {"test": record["test"], "outcome": None, "seconds": 0.0,
                                                  "message": None, "figures": {}})  # fmt: skip
        entry["seconds"] += record["seconds"]
        entry["figures"].update(record["figures"])
        if record["outcome"] == "failed":
            if entry["outcome"] != "failed":
                entry["message"] = f"{record['phase']}: {record['message']}"
            entry["outcome"] = "failed"
        elif entry["outcome"] != "failed" and (record["phase"] == "call" or record["outcome"] == "skipped"):
            entry["outcome"] = record["outcome"]
            entry["message"] = record["message"] or entry["message"]
    for entry in tests.values():
        entry["seconds"] = round(entry["seconds"], 3)
        entry["outcome"] = entry["outcome"] or "error"  # a setup that passed but no call report: pytest died
    return list(tests.values())


def device_info() -> dict[str, Any] | None:
    """The GPU this process sees first (name, memory, compute capability, count), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return {
        "name": properties.name,
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "capability": f"{properties.major}.{properties.minor}",
        "count": torch.cuda.device_count(),
    }


def versions() -> dict[str, Any]:
    """Python, CUDA and cuDNN as torch was built with them, and the installed packages that run the tests."""
    found: dict[str, Any] = {"python": platform.python_version(), "cuda": torch.version.cuda}
    found["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def run_gpu_tests(
    records: Path, timeout_s: float, extra: list[str], tests: str | Path = TESTS
) -> tuple[int | None, bool, str]:
    """pytest on the `gpu`-marked tests of `tests` in a child process run in `ROOT`; (its exit code or None, timed
    out, the tail of its output). Each phase report lands in `records` (JSON lines)."""
    env = {**os.environ, RECORDS_ENV: str(records), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cuda"  # DeepSpeed's accelerator from the start (tests/conftest.py leaves it then)
    command = [sys.executable, "-m", "pytest", str(tests), "-m", "gpu", "-p", PLUGIN, "-rA", "-q", *extra]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or b""
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        return None, True, text[-6000:]
    return done.returncode, False, (done.stdout + done.stderr)[-6000:]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the report (default gpu_check.json)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds before pytest is stopped (default {DEFAULT_TIMEOUT_S})")  # fmt: skip
    parser.add_argument("-k", dest="select", help="only the gpu tests whose names match (pytest -k)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started, began = time.perf_counter(), datetime.now(UTC)
    with tempfile.TemporaryDirectory() as folder:
        records_path = Path(folder) / "records.jsonl"
        records_path.touch()
        code, timed_out, output = run_gpu_tests(records_path, args.timeout, ["-k", args.select] if args.select else [])
        lines = records_path.read_text(encoding="utf-8").splitlines()
    tests = merge_phases([json.loads(line) for line in lines if line.strip()])
    counts = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failed", "skipped")}
    finished = code in (0, 1, 5) and not timed_out  # 5: nothing collected
    gpu = device_info()
    report: dict[str, Any] = {
        "command": "python -m inference.measure.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": began.isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "device": gpu,
        "versions": versions(),
        "pytest_exit_code": code,
        "timed_out": timed_out,
        "summary": {**counts, "total": len(tests)},
        "tests": tests,
        "output_tail": None if finished and not counts["failed"] else output,
    }
    write_atomic(args.out, json.dumps(report, indent=2) + "\n")
    device = gpu["name"] if gpu else "no CUDA device"
    print(f"{device}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in "
          f"{report['seconds']} s; wrote {args.out}")  # fmt: skip
    for test in tests:
        figures = ", ".join(f"{name} {value}" for name, value in test["figures"].items())
        line = f"  {test['outcome']:<8} {test['seconds']:7.1f} s  {test['test']}"
        print(line + (f"  ({figures})" if figures else ""))
    if not finished:
        reason = "timed out" if timed_out else f"exit code {code}"
        print(f"pytest did not finish ({reason}):\n{output}", file=sys.stderr)
        return 2
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
