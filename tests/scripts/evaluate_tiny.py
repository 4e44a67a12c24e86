"""`python -m inference.evaluate` on the tiny random toy target: the subprocess half of the evaluation tests.

    python tests/scripts/evaluate_tiny.py --target tiny-eval --prompts CAPTIONS --out OUT [evaluate options]
    RANK=1 WORLD_SIZE=2 EVAL_KILL_AT_WRITE=3 python tests/scripts/evaluate_tiny.py ...

`EVAL_KILL_AT_WRITE=N` makes the N-th file write of this process write half of its bytes to the temporary
name and then send this process SIGKILL, so the run dies the way `kill -9` kills it: mid-write, with a
partial temporary file left behind (N even: an image's record, its PNG already in place).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny target

import torch  # noqa: E402
from conftest import build_tiny_toy_target  # noqa: E402

import inference.evaluation.eval_folder as eval_folder  # noqa: E402
from inference.evaluation.evaluate import main  # noqa: E402
from models.registry import TARGET_LOADERS  # noqa: E402

TARGET_LOADERS["tiny-eval"] = lambda **kwargs: build_tiny_toy_target(grid=6)
KILL_AT = int(os.environ.get("EVAL_KILL_AT_WRITE", "0"))
_writes = 0
_write_atomic = eval_folder.write_atomic


def _dying_write(path: Path, data: bytes | str) -> None:
    global _writes
    _writes += 1
    if _writes == KILL_AT:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        path.with_name(f".{path.name}.{eval_folder.host_name()}.{os.getpid()}.tmp").write_bytes(raw[: len(raw) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    _write_atomic(path, data)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if KILL_AT:
        eval_folder.write_atomic = _dying_write
    main(sys.argv[1:])
