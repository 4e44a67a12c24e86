"""The toy text-to-image world: its vocabulary of attributes and its caption grammar.

The embedded default target of this project draws small RGB scenes of 1-3 coloured shapes at
named positions over plain, gradient, striped or checkered backgrounds, and describes each scene
with a caption from a small grammar, e.g.

    "a small red circle at the top left , a large blue square in the center on a striped pink background"

This module holds only the definitions that both sides need: the attribute values, the scene
record, caption rendering and parsing, and the word vocabulary the caption encoder reads. Drawing
scenes lives in `models/toy/scenes.py`; reading attributes back from pixels lives in
`models/toy/metrics.py`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# Named colours: saturated RGB for shapes; backgrounds use pale tints of the same names.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 205, 20),
    "purple": (130, 40, 180),
    "orange": (245, 125, 15),
    "cyan": (20, 195, 205),
    "pink": (240, 100, 180),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
SIZES: tuple[str, ...] = ("small", "large")
BACKGROUNDS: tuple[str, ...] = ("plain", "gradient", "striped", "checkered")

# A 3x3 grid of named positions, in reading order; the phrase is the caption's wording.
POSITIONS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
POSITION_PHRASES: dict[str, str] = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}
MAX_SHAPES = 3

# Geometry: a 36 x 36 canvas, 3 x 3 cells of 12 x 12 px, each cell 2 x 2 patches of the 6 x 6 tokenizer.
IMAGE_SIZE = 36
CELL_SIZE = IMAGE_SIZE // 3
PATCH_SIZE = CELL_SIZE // 2

# Every word the grammar can produce, plus padding and unknown; index 0 is padding.
PAD_WORD, UNKNOWN_WORD = "<pad>", "<unk>"
WORDS: tuple[str, ...] = (
    PAD_WORD, UNKNOWN_WORD, "a", ",", "and", "at", "on", "in", "the", "background",
    *COLOUR_NAMES, *SHAPES, *SIZES, *BACKGROUNDS, "top", "bottom", "left", "right", "center",
)  # fmt: skip
WORD_INDEX: dict[str, int] = {word: i for i, word in enumerate(WORDS)}
MAX_CAPTION_WORDS = 32
HELD_OUT_BUCKETS = 20  # one caption in 20 (by hash) is held out of training


@dataclass(frozen=True)
class ShapeSpec:
    """One shape of a scene."""

    colour: str
    shape: str
    size: str
    position: str


@dataclass(frozen=True)
class SceneSpec:
    """What a caption says: the shapes (in reading order of their positions) and the background."""

    shapes: tuple[ShapeSpec, ...]
    background: str
    background_colour: str

    def __post_init__(self) -> None:
        if not 1 <= len(self.shapes) <= MAX_SHAPES:
            raise ValueError(f"a scene has 1..{MAX_SHAPES} shapes, got {len(self.shapes)}")
        positions = [s.position for s in self.shapes]
        if len(set(positions)) != len(positions):
            raise ValueError(f"two shapes share a position in {positions}; each position holds at most one shape")
        for spec in self.shapes:
            _check_value("colour", spec.colour, COLOUR_NAMES)
            _check_value("shape", spec.shape, SHAPES)
            _check_value("size", spec.size, SIZES)
            _check_value("position", spec.position, POSITIONS)
        _check_value("background", self.background, BACKGROUNDS)
        _check_value("background colour", self.background_colour, COLOUR_NAMES)


def _check_value(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; the toy world knows {', '.join(allowed)}")


def canonical(scene: SceneSpec) -> SceneSpec:
    """The same scene with its shapes sorted by position (reading order), as captions list them."""
    ordered = tuple(sorted(scene.shapes, key=lambda s: POSITIONS.index(s.position)))
    return SceneSpec(ordered, scene.background, scene.background_colour)


def caption_of(scene: SceneSpec) -> str:
    """Render the caption of a scene, e.g. 'a small red circle at the top left on a plain blue background'."""
    scene = canonical(scene)
    phrases = [f"a {s.size} {s.colour} {s.shape} {POSITION_PHRASES[s.position]}" for s in scene.shapes]
    if len(phrases) == 1:
        objects = phrases[0]
    else:
        objects = " , ".join(phrases[:-1]) + " and " + phrases[-1]
    return f"{objects} on a {scene.background} {scene.background_colour} background"


_SHAPE_PATTERN = re.compile(
    r"a (?P<size>\w+) (?P<colour>\w+) (?P<shape>\w+) (?:at|on|in) the (?P<position>top left|top right|bottom left"
    r"|bottom right|top|bottom|left|right|center)"
)
_BACKGROUND_PATTERN = re.compile(r" on a (?P<background>\w+) (?P<colour>\w+) background$")


def normalise_caption(text: str) -> str:
    """Lower-case, put spaces around commas and collapse whitespace, so captions compare as word lists."""
    return " ".join(text.lower().replace(",", " , ").split())


def parse_caption(text: str) -> SceneSpec:
    """Parse a caption of the toy grammar back into a scene.

    Raises:
        ValueError: naming the caption and what could not be read, when it is not of the grammar.
    """
    caption = normalise_caption(text)
    background = _BACKGROUND_PATTERN.search(caption)
    if background is None:
        raise ValueError(
            f"caption {text!r} does not end with 'on a <plain|gradient|striped|checkered> <colour> background'"
        )
    objects = caption[: background.start()]
    shapes = [ShapeSpec(m["colour"], m["shape"], m["size"], m["position"]) for m in _SHAPE_PATTERN.finditer(objects)]
    if not shapes:
        raise ValueError(f"caption {text!r} names no shape like 'a small red circle at the top left'")
    scene = SceneSpec(tuple(shapes), background["background"], background["colour"])
    if caption_of(scene) != caption:
        raise ValueError(f"caption {text!r} is not in the toy grammar; the closest caption is {caption_of(scene)!r}")
    return scene


def is_held_out(caption: str) -> bool:
    """Whether a caption belongs to the held-out split (a fixed 1-in-20 hash bucket), never seen in training."""
    digest = hashlib.sha1(normalise_caption(caption).encode()).hexdigest()
    return int(digest[:8], 16) % HELD_OUT_BUCKETS == 0


def caption_word_ids(
    text: str, length: int = MAX_CAPTION_WORDS, word_index: dict[str, int] | None = None
) -> tuple[list[int], int]:
    """Word ids of a caption, left-padded to `length` as LlamaGen left-pads T5 features.

    `word_index` maps words to ids (padding 0, unknown 1); None means the toy grammar's `WORD_INDEX`.

    Returns:
        (ids, num_valid): `length` ids whose last `num_valid` are the caption's words.

    Raises:
        ValueError: when the caption has more than `length` words.
    """
    words = normalise_caption(text).split()
    if len(words) > length:
        raise ValueError(f"caption has {len(words)} words, more than the {length} caption slots: {text!r}")
    index = WORD_INDEX if word_index is None else word_index
    ids = [index.get(word, index[UNKNOWN_WORD]) for word in words]
    return [index[PAD_WORD]] * (length - len(ids)) + ids, len(ids)
