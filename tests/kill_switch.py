"""A callback that kills its own process with SIGKILL at a given training step (no hooks, no cleanup run)."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch.callbacks import Callback


class KillAtStep(Callback):
    """SIGKILL this process once the trainer's global step reaches `step` (after that step's checkpoints)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordStartStep(Callback):
    """Write the global step at which training (re)starts into `path`: 0 for a fresh run, N after a resume."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        with open(self.path, "w") as handle:
            handle.write(str(trainer.global_step))
