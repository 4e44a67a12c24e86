"""Inference users need no training stack: importing models and inference pulls in none of it."""

from __future__ import annotations

import subprocess
import sys

TRAINING_STACK = ("lightning", "pytorch_lightning", "deepspeed", "webdataset")


def test_models_and_inference_import_without_the_training_stack():
    code = (
        "import sys, importlib, pkgutil\n"
        "import models, inference\n"
        "for package in (models, inference):\n"
        "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        f"print(sorted(m for m in {TRAINING_STACK!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
