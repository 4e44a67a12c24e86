"""`python -m training.convert` is `python -m training.export` under its old name: checkpoint -> drafter folder.

    python -m training.convert --ckpt runs/demo/version_0/checkpoints/last.ckpt --out drafters/toy
    python -m training.convert --ckpt runs/demo/version_0/checkpoints/last.ckpt/ --out drafters/toy   # DeepSpeed

Reading is `training.checkpoints` (the one checkpoint reader), writing is `training.export` (serving
layout checked, model card, atomic folder); this module only keeps the old command and names working.
"""

from __future__ import annotations

import sys
from pathlib import Path

from training.checkpoints import CheckpointError, drafter_from_checkpoint
from training.export import export_drafter
from training.export import main as export_main

__all__ = ["CheckpointError", "convert_checkpoint", "drafter_from_checkpoint", "main"]


def convert_checkpoint(ckpt: str | Path, out: str | Path) -> Path:
    """Export the drafter of `ckpt` to the folder `out` (`training.export.export_drafter`); returns `out`."""
    return export_drafter(ckpt, out).folder


def main(argv: list[str] | None = None) -> int:
    """`python -m training.export` with the same arguments."""
    return export_main(argv)


if __name__ == "__main__":
    sys.exit(main())
