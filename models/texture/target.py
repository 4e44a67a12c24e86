"""The texture world's target behind the `ImageTarget` interface: the toy target's machinery, texture weights.

    target = TextureTarget.from_assets(folder)   # texture_target.safetensors + texture_vq.safetensors in folder

Everything the decoder calls (conditioning with the learned unconditional caption for CFG, the KV
cache, the 2D rotary positions, decoding pixels through the patch VQ) is `models.toy.ToyTarget`;
this class only names the files, the sampling defaults and the default draft tree.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.target import DecoderTarget, SamplingDefaults
from models.toy import PatchVQ, ToyTarget, ToyTextToImage

ASSETS = Path(__file__).resolve().parent / "assets"
TARGET_FILE, VQ_FILE = "texture_target.safetensors", "texture_vq.safetensors"
# top-k 512 of 8192 codes keeps 6.25 % of the vocabulary, about LlamaGen's share (top-k 1000 of 16384).
TEXTURE_SAMPLING = SamplingDefaults(cfg_scale=1.5, temperature=1.0, top_k=512, top_p=None)


class TextureTarget(ToyTarget):
    """The embedded texture-world text-to-image target."""

    default_static_tree = DecoderTarget.default_static_tree  # no tree has been fitted to this world yet

    def __init__(self, network: ToyTextToImage, vq: PatchVQ, name: str = "texture",
                 sampling: SamplingDefaults = TEXTURE_SAMPLING) -> None:  # fmt: skip
        super().__init__(network, vq, name, sampling)

    @classmethod
    def from_assets(cls, folder: str | Path = ASSETS, device: torch.device | str | None = None) -> TextureTarget:
        """Load the target from `texture_target.safetensors` + `texture_vq.safetensors` in `folder`, on `device`
        (None = the CPU)."""
        folder = Path(folder)
        for file in (TARGET_FILE, VQ_FILE):
            if not (folder / file).exists():
                raise FileNotFoundError(
                    f"{folder / file} is missing; train it with `python -m models.texture.train --out {folder}`"
                )
        target = cls(ToyTextToImage.load(folder / TARGET_FILE), PatchVQ.load(folder / VQ_FILE))
        return target if device is None else target.to(device)
