"""The texture world's caption grammar: shaded objects at named positions over a procedural texture.

A second embedded text-to-image world, harder than the toy (`models/toy/`) in the ways real images
are: backgrounds are procedural textures (wood, marble, clouds, sand, granite) whose frequency,
orientation, contrast and phase are drawn per image, so a patch's code depends on its neighbours;
objects are shaded and have soft edges and span many tokens. A caption names the objects and the
texture, e.g.

    "a large red circle at the top left and a small blue square in the center on coarse brown wood"

This module holds the vocabulary, the scene record, caption rendering and parsing; drawing lives in
`models/texture/scenes.py`. Positions, object colours and shapes are the toy's; the held-out split
is the toy's hash rule (`models.toy.is_held_out`, one caption in 20).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.toy import COLOURS, PAD_WORD, POSITION_PHRASES, POSITIONS, UNKNOWN_WORD, ShapeSpec, normalise_caption

IMAGE_SIZE = 48
PATCH_SIZE = 4  # 12 x 12 = 144 tokens
GRID = IMAGE_SIZE // PATCH_SIZE

OBJECT_COLOURS: tuple[str, ...] = tuple(COLOURS)
OBJECT_SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
OBJECT_SIZES: tuple[str, ...] = ("small", "large")
MAX_OBJECTS = 3

TEXTURES: tuple[str, ...] = ("clouds", "marble", "wood", "sand", "granite")
TEXTURE_SCALES: tuple[str, ...] = ("fine", "coarse")
# Base tones of the textures (RGB): muted, so objects stand out and one texture's codes are many near-duplicates.
TEXTURE_COLOURS: dict[str, tuple[int, int, int]] = {
    "brown": (150, 105, 70),
    "grey": (135, 135, 135),
    "green": (95, 130, 80),
    "blue": (85, 110, 155),
}
TEXTURE_COLOUR_NAMES: tuple[str, ...] = tuple(TEXTURE_COLOURS)

WORDS: tuple[str, ...] = (
    PAD_WORD, UNKNOWN_WORD, "a", ",", "and", "at", "on", "in", "the",
    *OBJECT_COLOURS, *OBJECT_SHAPES, *OBJECT_SIZES, *TEXTURES, *TEXTURE_SCALES, *TEXTURE_COLOUR_NAMES,
    "top", "bottom", "left", "right", "center",
)  # fmt: skip
MAX_CAPTION_WORDS = 32


@dataclass(frozen=True)
class TextureScene:
    """What a caption says: the objects (in reading order of their positions) and the background texture."""

    objects: tuple[ShapeSpec, ...]
    texture: str
    scale: str
    tone: str

    def __post_init__(self) -> None:
        if not 1 <= len(self.objects) <= MAX_OBJECTS:
            raise ValueError(f"a texture scene has 1..{MAX_OBJECTS} objects, got {len(self.objects)}")
        positions = [o.position for o in self.objects]
        if len(set(positions)) != len(positions):
            raise ValueError(f"two objects share a position in {positions}; each position holds at most one")
        for item in self.objects:
            _check("object colour", item.colour, OBJECT_COLOURS)
            _check("shape", item.shape, OBJECT_SHAPES)
            _check("size", item.size, OBJECT_SIZES)
            _check("position", item.position, POSITIONS)
        _check("texture", self.texture, TEXTURES)
        _check("texture scale", self.scale, TEXTURE_SCALES)
        _check("texture colour", self.tone, TEXTURE_COLOUR_NAMES)

    def in_reading_order(self) -> TextureScene:
        """The same scene with its objects sorted by position, as captions list them."""
        ordered = tuple(sorted(self.objects, key=lambda o: POSITIONS.index(o.position)))
        return TextureScene(ordered, self.texture, self.scale, self.tone)


def _check(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; the texture world knows {', '.join(allowed)}")


def texture_caption(scene: TextureScene) -> str:
    """The caption of a scene, e.g. 'a small red circle at the top left on fine grey marble'."""
    items = [
        f"a {o.size} {o.colour} {o.shape} {POSITION_PHRASES[o.position]}" for o in scene.in_reading_order().objects
    ]
    listed = items[0] if len(items) == 1 else " , ".join(items[:-1]) + " and " + items[-1]
    return f"{listed} on {scene.scale} {scene.tone} {scene.texture}"


_POSITION_ALTERNATIVES = "|".join(sorted(POSITIONS, key=len, reverse=True))  # longest first: "top left" before "top"
_OBJECT = re.compile(
    rf"a (?P<size>\w+) (?P<colour>\w+) (?P<shape>\w+) (?:at|on|in) the (?P<position>{_POSITION_ALTERNATIVES})"
)
_TEXTURE = re.compile(r" on (?P<scale>\w+) (?P<tone>\w+) (?P<texture>\w+)$")


def parse_texture_caption(text: str) -> TextureScene:
    """Read a caption of the texture grammar back into its scene.

    Raises:
        ValueError: naming the caption and what could not be read, when it is not of the grammar.
    """
    caption = normalise_caption(text)
    texture = _TEXTURE.search(caption)
    if texture is None:
        raise ValueError(f"caption {text!r} does not end with 'on <fine|coarse> <tone> <texture>'")
    found = [ShapeSpec(m["colour"], m["shape"], m["size"], m["position"]) for m in _OBJECT.finditer(caption)]
    if not found:
        raise ValueError(f"caption {text!r} names no object like 'a small red circle at the top left'")
    scene = TextureScene(tuple(found), texture["texture"], texture["scale"], texture["tone"])
    if texture_caption(scene) != caption:
        raise ValueError(f"caption {text!r} is not in the texture grammar; closest: {texture_caption(scene)!r}")
    return scene
