"""What measures the training pipeline: the Lightning step and the online step against their alternatives, the
data readers, and the convergence-region study on the training data.

The one part of `inference/` that imports `training`, `data` and the training stack (lightning, deepspeed,
webdataset): it measures them. It also imports `models`, `inference.decoding` and `inference.measure`; nothing else
in `inference/` imports it but its `python -m` entry points (docs/architecture.md).
"""
