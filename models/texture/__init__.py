"""The texture world: a second embedded text-to-image world, in the real targets' high-entropy regime.

The toy world (`models/toy/`) is far easier than LlamaGen, Janus-Pro or Lumina-mGPT: 36 tokens, a
grain independent of its neighbours, half the mass on the top token. This world keeps the toy's
machinery (caption encoder + LlamaGen GPT, k-means patch VQ, the `ToyTarget` decoder interface) and
changes what is drawn: shaded, soft-edged objects spanning many tokens over procedural textures
(clouds, marble, wood, sand, granite) whose frequency, orientation, contrast and phase are drawn per
image, on a 48 x 48 canvas of 4 x 4 patches (144 tokens) with an 8192-code codebook full of
near-duplicates. Parts: the caption grammar (`world`, one caption in 20 held out by hash), scene
drawing (`scenes`), the network sizes (`model`), the target (`target`), the scene reader for prompt
fidelity and FID-style features (`reader`), training
(`python -m models.texture.train`) and the shipped VQ, target and reader with the model card
(`assets/`). `python -m inference.world_calibrate` measures a target's entropy, top-1 and
prompt fidelity at its default sampling, and with `--drafter` the lossless tau of its trees.

Code outside this package uses only the names below.
"""

from __future__ import annotations

from models.texture.model import network_from_checkpoint
from models.texture.reader import READER_FILE, TextureSceneReader
from models.texture.scenes import render_texture_dataset, render_texture_scene, texture_captions
from models.texture.target import ASSETS, TEXTURE_SAMPLING, TextureTarget
from models.texture.world import IMAGE_SIZE, TextureScene, parse_texture_caption, texture_caption

__all__ = [
    "ASSETS",
    "IMAGE_SIZE",
    "TEXTURE_SAMPLING",
    "TextureScene",
    "TextureSceneReader",
    "TextureTarget",
    "network_from_checkpoint",
    "parse_texture_caption",
    "render_texture_dataset",
    "render_texture_scene",
    "scene_reader",
    "texture_caption",
    "texture_captions",
]


def scene_reader() -> TextureSceneReader:
    """The shipped scene reader (`assets/texture_reader.safetensors`): prompt fidelity and FID-style features."""
    path = ASSETS / READER_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; train it with `python -m models.texture.train --stage reader`")
    return TextureSceneReader.load(path)
