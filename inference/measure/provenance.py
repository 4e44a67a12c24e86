"""Where a figure comes from: the stamp every benchmark command puts in its JSON, and the results page reads.

    {"provenance": provenance(), ...}        # date, machine, torch and the commit a figure was made at

It sits beside the results page code (`inference.measure.results`), which prints the stamp under every table and
refuses a figure whose commit carries `UNCOMMITTED`: one made from a work tree that differed from its commit.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

UNCOMMITTED = "+changes"
"""The suffix `provenance` puts on a commit when the work tree differed from it."""


def provenance() -> dict[str, str]:
    """Where a measurement comes from, for the JSON a benchmark writes: date, machine (CPU cores, GPU or none),
    torch version and the commit (with "+changes" when the work tree differs from it; "unknown" outside git)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()  # fmt: skip
        commit += UNCOMMITTED if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores, {gpu}",
        "torch": torch.__version__,
        "commit": commit,
    }
