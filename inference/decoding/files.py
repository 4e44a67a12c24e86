"""Atomic file writes for everything `inference/` writes: results, tables, plots, images, statistics.

    write_atomic(path, png_bytes)            # bytes or text
    write_json(summary, path)                # indented JSON with a final newline

A file is written under a temporary name in its own folder, `.<name>.<host>.<pid>.tmp`, then renamed
into place, so a reader (or a rerun after a kill) never sees half a file. The name says which
process on which host wrote it, so a rerun can tell a dead writer's leftover (`TEMP_NAME`) from a
live one's (`inference.evaluation.eval_folder.remove_stale_temps`).
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.tmp$")
"""A temporary file of `write_atomic`: the final name, the writer's host and process id."""


def host_name() -> str:
    """This machine's name as temporary file names carry it (no dots)."""
    return socket.gethostname().replace(".", "-") or "host"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` (text is UTF-8) to `path` through a temporary name in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{host_name()}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def write_json(payload: Any, path: Path) -> None:
    """`payload` as indented JSON (non-JSON values as their str) with a final newline, atomically."""
    write_atomic(Path(path), json.dumps(payload, indent=2, default=str) + "\n")
