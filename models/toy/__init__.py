"""The embedded toy text-to-image world, whole: captions, scenes, the VQ tokenizer, the target, its metrics.

A tiny but real text-to-image target that every code path of the pipeline runs on a CPU: a caption
grammar over shapes, colours, sizes, positions and backgrounds (`world`), a deterministic scene
renderer and sampler (`scenes`), a 6x6-pixel patch VQ (`vq`), a caption encoder + LlamaGen GPT
(`model`) behind the `ImageTarget` interface (`target`), a scene reader that reads captions back from
pixels for prompt fidelity and FID-style features (`metrics`), the training of all three (`train`,
`python -m models.toy.train`) and the shipped weights with their model card (`assets/`).

The rest of the project sees the target through the registry (`load_target("toy")`) and uses only
the names below (the texture world, `models/texture/`, builds on several of them); no module outside
this package imports its submodules (tests/test_imports.py).
"""

from __future__ import annotations

from models.toy.metrics import SceneFeatures, SceneReader, frechet_distance, object_labels
from models.toy.model import CaptionEncoderConfig, ToyTextToImage
from models.toy.scenes import cell_centre, render_dataset, render_scene, shape_mask, toy_captions
from models.toy.target import ASSETS, ToyTarget
from models.toy.train import (
    atomic_save,
    copy_by_nearest_code,
    fit_scene_reader,
    learning_rate,
    reader_ceiling,
    target_loss,
)
from models.toy.vq import PatchVQ, reconstruction_error
from models.toy.world import (
    COLOURS,
    IMAGE_SIZE,
    PAD_WORD,
    POSITION_PHRASES,
    POSITIONS,
    UNKNOWN_WORD,
    ShapeSpec,
    is_held_out,
    normalise_caption,
    parse_caption,
)

__all__ = [
    "ASSETS",
    "COLOURS",
    "IMAGE_SIZE",
    "PAD_WORD",
    "POSITIONS",
    "POSITION_PHRASES",
    "UNKNOWN_WORD",
    "ShapeSpec",
    "CaptionEncoderConfig",
    "PatchVQ",
    "ToyTextToImage",
    "atomic_save",
    "copy_by_nearest_code",
    "cell_centre",
    "fit_scene_reader",
    "is_held_out",
    "learning_rate",
    "normalise_caption",
    "object_labels",
    "reconstruction_error",
    "shape_mask",
    "reader_ceiling",
    "target_loss",
    "SceneFeatures",
    "SceneReader",
    "ToyTarget",
    "frechet_distance",
    "parse_caption",
    "render_dataset",
    "render_scene",
    "scene_reader",
    "toy_captions",
]


def scene_reader() -> SceneReader:
    """The shipped scene reader (`assets/scene_reader.safetensors`)."""
    return SceneReader.load(ASSETS / "scene_reader.safetensors")
