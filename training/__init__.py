"""Drafter training: `fit.py` (LightningCLI), the `DrafterSystem` LightningModule, its objective and losses,
online features, callbacks (decoding validation, progress), DeepSpeed on CPU, checkpoints and Hub export. What
measures it lives in `inference/measure/pipeline/`."""
