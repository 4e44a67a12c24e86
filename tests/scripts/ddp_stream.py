"""Two-rank Lightning DDP on CPU (gloo) over a dataset with uneven shards: who saw which samples.

    python tests/scripts/ddp_stream.py DATASET_DIR OUT_DIR [--epochs 2] [--batch-size 4]

Writes OUT_DIR/rank{r}.json: per epoch, the keys of every batch (padding rows as ""). Every step
all-reduces gradients, so a rank with fewer batches than the other would hang or crash the run.
Lightning relaunches this script for rank 1, which is why DDP is tested through a script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

from data.data_config import DataConfig
from data.datamodule import FeatureDataModule
from data.shards import load_manifest


class KeyRecorder(L.LightningModule):
    """A linear probe on the hidden features that records the keys it trained on."""

    def __init__(self, width: int, out_dir: str) -> None:
        super().__init__()
        self.probe = torch.nn.Linear(width, 1)
        self.out_dir = out_dir
        self.seen: dict[str, list[list[str]]] = {}
        self.val_seen: dict[str, list[list[str]]] = {}

    def training_step(self, batch, batch_index):
        self.seen.setdefault(str(self.current_epoch), []).append(batch["keys"])
        mask = batch["loss_mask"].float()
        values = self.probe(batch["hidden"].float()).squeeze(-1)  # (B, L)
        return (values**2 * mask).sum() / mask.sum().clamp_min(1.0)

    def validation_step(self, batch, batch_index):
        self.val_seen.setdefault(str(self.current_epoch), []).append(batch["keys"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_fit_end(self) -> None:
        path = Path(self.out_dir) / f"rank{self.global_rank}.json"
        path.write_text(json.dumps({"train": self.seen, "val": self.val_seen, "world_size": self.trainer.world_size}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    manifest = load_manifest(args.dataset)
    config = DataConfig(train_dir=args.dataset, num_val_shards=1, batch_size=args.batch_size, shuffle_buffer=4)
    datamodule = FeatureDataModule(config, target=manifest.target)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(KeyRecorder(manifest.target.hidden_size, args.out_dir), datamodule=datamodule)
    print(f"rank {trainer.global_rank} of {trainer.world_size} done (pid {os.getpid()})", file=sys.stderr)
    # tear gloo down before the interpreter does: left to exit, a rank once aborted after finishing
    # ("terminate called without an active exception", return code -6)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
