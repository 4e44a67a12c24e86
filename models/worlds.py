"""The embedded text-to-image worlds by target name: what the tools need of a world beyond its target.

    world = embedded_world("texture")                     # None for a real target such as "janus-pro-7b"
    prompts = world.captions(256, 2026, "heldout")        # captions the drafter never trained on
    reader = world.scene_reader()                         # prompt fidelity and FID-style features

An embedded world ships a caption grammar with a held-out split, a renderer of its own scenes and a
scene reader (a `models.toy.SceneReader`: `.fidelity(images (N, S, S, 3) uint8, captions)`, `.matches`,
`.attribute_errors`, `.embed`, `.image_size`) that reads captions back from pixels. Real targets have
none of these: the tools take a prompt file for them and report no prompt fidelity. The world packages
are imported only when a callable runs, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

SPLITS = ("train", "heldout", "any")
"""Caption splits of every world: the training split, the held-out one (1 caption in 20 by hash), or either."""


@dataclass(frozen=True)
class EmbeddedWorld:
    """One embedded world: its registry target name, image side, captions, renderings and scene reader."""

    name: str
    """The registry target name (`models.registry.load_target(name)`), also its prompt source name."""
    image_size: int
    """Side S of its square images, in pixels."""
    captions: Callable[[int, int, str], list[str]]
    """(count, seed, split) -> `count` captions of `split` ("train", "heldout" or "any"), fixed by `seed`."""
    render_dataset: Callable[[int, int, str], tuple[list[str], np.ndarray]]
    """(count, seed, split) -> the captions and their scenes drawn by the world, (count, S, S, 3) uint8."""
    scene_reader: Callable[[], Any]
    """() -> the world's shipped scene reader (a `models.toy.SceneReader` or a subclass)."""


def _toy_captions(count: int, seed: int, split: str) -> list[str]:
    from models.toy import toy_captions

    return toy_captions(count, seed, split)


def _toy_dataset(count: int, seed: int, split: str) -> tuple[list[str], np.ndarray]:
    from models.toy import render_dataset

    return render_dataset(count, seed, split)


def _toy_reader() -> Any:
    from models.toy import scene_reader

    return scene_reader()


def _texture_captions(count: int, seed: int, split: str) -> list[str]:
    from models.texture import texture_captions

    return texture_captions(count, seed, split)


def _texture_dataset(count: int, seed: int, split: str) -> tuple[list[str], np.ndarray]:
    from models.texture import render_texture_dataset

    return render_texture_dataset(count, seed, split)


def _texture_reader() -> Any:
    import models.texture

    return models.texture.scene_reader()  # FileNotFoundError naming texture_reader.safetensors when it is missing


EMBEDDED_WORLDS: dict[str, EmbeddedWorld] = {
    "toy": EmbeddedWorld("toy", 36, _toy_captions, _toy_dataset, _toy_reader),  # models.toy.IMAGE_SIZE
    "texture": EmbeddedWorld("texture", 48, _texture_captions, _texture_dataset, _texture_reader),  # texture IMAGE_SIZE
}
"""Every embedded world by its registry target name (tests/test_worlds.py checks the sizes against the packages)."""


def embedded_world(target_name: str) -> EmbeddedWorld | None:
    """The embedded world of the target registered as `target_name`; None for a real target."""
    return EMBEDDED_WORLDS.get(target_name)


def caption_world(target_name: str) -> EmbeddedWorld:
    """Where a tool draws its default held-out captions for `target_name`: the target's own world, else the toy's
    (a real target has no caption grammar; the tools take a prompt file for it)."""
    return EMBEDDED_WORLDS.get(target_name, EMBEDDED_WORLDS["toy"])


def reading_world(target_name: str, image_size: tuple[int, int]) -> EmbeddedWorld | None:
    """The world whose scene reader can score a target's (H, W) images: its own world, else the toy's for a
    target drawing toy-sized images (the test targets built on the toy's network, such as `tiny-toy`); None when
    no reader can read them."""
    world = EMBEDDED_WORLDS.get(target_name)
    if world is not None:
        return world
    toy = EMBEDDED_WORLDS["toy"]
    return toy if tuple(image_size) == (toy.image_size, toy.image_size) else None
