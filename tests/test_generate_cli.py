"""`python -m inference.generate` with the shipped toy target writes PNGs, a grid and a JSON summary."""

from __future__ import annotations

import json

from PIL import Image

from inference.generate import main


def test_generate_writes_images_grid_and_summary(tmp_path):
    prompt = "a large yellow circle in the center on a plain blue background"
    main(["--target", "toy", "--prompt", prompt, "--num-images", "3", "--out", str(tmp_path),
          "--cfg-scale", "2.0", "--top-k", "50", "--seed", "1"])  # fmt: skip
    summary = json.loads((tmp_path / "generation.json").read_text())
    assert [record["file"] for record in summary["images"]] == ["00000.png", "00001.png", "00002.png"]
    assert summary["sampling"]["cfg_scale"] == 2.0 and summary["sampling"]["top_k"] == 50
    assert Image.open(tmp_path / "00000.png").size == (32, 32)
    assert Image.open(tmp_path / "grid.png").size[0] > 32
