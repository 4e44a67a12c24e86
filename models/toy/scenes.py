"""Deterministic generator of the toy world's captioned scenes (and so of its captions).

A scene is drawn from a `numpy.random.Generator`, so `(seed, index)` fixes it: the same seed gives
the same scenes, captions and pixels on every machine. Captions follow the grammar in
`models/toy/world.py`; one caption in twenty (by hash) is held out of training, so evaluation can
use captions the target never saw.

    scenes = sample_scenes(64, seed=0, split="heldout")
    pixels = render_scene(scenes[0], rng)            # (36, 36, 3) uint8
    captions = toy_captions(16, seed=5, split="heldout")

The toy world lives in `models/` because every package needs its captions: inference decodes
held-out captions (`inference.measure.bench`, `inference.decoding.calibrate`), data extracts features over them
(`data.prompts`), training renders scenes to build the toy target (`models.toy.train`).

The geometry is laid out for the 6 x 6-pixel patch tokenizer (`models/toy/vq.py`): a 36 x 36 canvas is
a 6 x 6 grid of patches, and each of the 3 x 3 named positions is a 12 x 12 cell of 2 x 2 patches.
A shape is centred on its cell's centre, which is a patch corner, so every shape is exactly four
patch-sized quarter pieces and a caption fixes its pixels. Backgrounds are aligned to patches too
(gradients in patch-wide bands, stripes one patch per period, patch-sized checks). What the caption
leaves open is drawn from the generator: the gradient's axis and direction, the stripes'
orientation, the checks' phase, and a fine grain on every background pixel, so that, as in real
images, many nearly identical patches (and tokens) can fill the same place: with the 4096-code
tokenizer 90 % of a plain background patch's mass lies on 50-62 codes, the ten likeliest holding about a quarter.
"""

from __future__ import annotations

import numpy as np

from models.toy.world import (
    BACKGROUNDS,
    COLOUR_NAMES,
    COLOURS,
    IMAGE_SIZE,
    MAX_SHAPES,
    PATCH_SIZE,
    POSITIONS,
    SHAPES,
    SIZES,
    SceneSpec,
    ShapeSpec,
    canonical,
    caption_of,
    is_held_out,
)

SHAPE_RADIUS = {"small": 4.0, "large": 5.6}  # a cell is 12 px: a large shape spans 11 px, a small one 8 px
GRAIN = 10  # background pixels get a uniform grain in [-GRAIN, GRAIN] grey levels
SHAPE_COUNT_PROBABILITIES = (0.4, 0.35, 0.25)  # for 1, 2 and 3 shapes
SPLITS = ("train", "heldout", "any")


def _pale(colour: str, amount: float) -> np.ndarray:
    """A tint of a named colour mixed with near-white; `amount` is the share of the colour. (3,) float."""
    return amount * np.asarray(COLOURS[colour], dtype=np.float32) + (1.0 - amount) * 245.0


def _draw_background(kind: str, colour: str, rng: np.random.Generator, size: int) -> np.ndarray:
    """A (size, size, 3) float background of the given kind and colour, aligned to the tokenizer's patches."""
    light, dark = _pale(colour, 0.3), _pale(colour, 0.6)
    patch = max(1, PATCH_SIZE * size // IMAGE_SIZE)
    ys, xs = np.mgrid[0:size, 0:size]
    if kind == "plain":
        weight = np.zeros((size, size), dtype=np.float32)
    elif kind == "gradient":  # one band per patch row or column
        axis = xs if rng.integers(2) else ys
        weight = (axis // patch) / max(1, size // patch - 1)
        if rng.integers(2):
            weight = 1.0 - weight
    elif kind == "striped":  # stripes half a patch wide: one period per patch
        axis = xs if rng.integers(2) else ys
        weight = (axis % patch) >= patch // 2
    elif kind == "checkered":  # patch-sized checks
        weight = ((ys // patch) + (xs // patch) + rng.integers(2)) % 2
    else:
        raise ValueError(f"unknown background {kind!r}; the toy world knows {', '.join(BACKGROUNDS)}")
    weight = weight.astype(np.float32)[..., None]
    grain = rng.integers(-GRAIN, GRAIN + 1, size=(size, size, 1)).astype(np.float32)  # grey, shared by R, G, B
    return (1.0 - weight) * light + weight * dark + grain


def shape_mask(shape: str, centre_y: float, centre_x: float, radius: float, size: int = IMAGE_SIZE) -> np.ndarray:
    """Boolean (size, size) mask of one shape, tested at pixel centres."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dy, dx = ys - centre_y, xs - centre_x
    if shape == "circle":
        return dy**2 + dx**2 <= radius**2
    if shape == "square":
        half = 0.85 * radius
        return (np.abs(dy) <= half) & (np.abs(dx) <= half)
    if shape == "triangle":  # pointing up: apex at the top, base at the bottom
        top, bottom = -radius, 0.85 * radius
        half_width = (dy - top) / (bottom - top) * radius
        return (dy >= top) & (dy <= bottom) & (np.abs(dx) <= half_width)
    if shape == "cross":
        arm = 0.3 * radius  # thin enough that a small cross and a small circle differ in every quarter
        return ((np.abs(dy) <= arm) & (np.abs(dx) <= radius)) | ((np.abs(dx) <= arm) & (np.abs(dy) <= radius))
    raise ValueError(f"unknown shape {shape!r}; the toy world knows {', '.join(SHAPES)}")


def cell_centre(position: str, size: int = IMAGE_SIZE) -> tuple[float, float]:
    """Pixel coordinates (y, x) of the centre of a named position's cell."""
    row, col = divmod(POSITIONS.index(position), 3)
    cell = size / 3
    return (row + 0.5) * cell, (col + 0.5) * cell  # a patch corner when size == IMAGE_SIZE


def render_scene(scene: SceneSpec, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw a scene. The generator picks what the caption leaves open (stripe direction, grain, ...).

    Returns:
        (size, size, 3) uint8 RGB pixels.
    """
    canvas = _draw_background(scene.background, scene.background_colour, rng, size)
    for spec in scene.shapes:
        centre_y, centre_x = cell_centre(spec.position, size)
        mask = shape_mask(spec.shape, centre_y, centre_x, SHAPE_RADIUS[spec.size] * size / IMAGE_SIZE, size)
        canvas[mask] = np.asarray(COLOURS[spec.colour], dtype=np.float32)
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def sample_scene(rng: np.random.Generator, split: str = "train") -> SceneSpec:
    """Draw a random scene whose caption belongs to `split` ('train', 'heldout' or 'any')."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    while True:
        num_shapes = int(rng.choice(np.arange(1, MAX_SHAPES + 1), p=SHAPE_COUNT_PROBABILITIES))
        positions = rng.choice(len(POSITIONS), size=num_shapes, replace=False)
        shapes = tuple(
            ShapeSpec(
                colour=COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))],
                shape=SHAPES[rng.integers(len(SHAPES))],
                size=SIZES[rng.integers(len(SIZES))],
                position=POSITIONS[int(p)],
            )
            for p in positions
        )
        scene = canonical(
            SceneSpec(
                shapes, BACKGROUNDS[rng.integers(len(BACKGROUNDS))], COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))]
            )
        )
        if split == "any" or is_held_out(caption_of(scene)) == (split == "heldout"):
            return scene


def sample_scenes(count: int, seed: int, split: str = "train") -> list[SceneSpec]:
    """`count` scenes of a split, fixed by `seed`."""
    rng = np.random.default_rng(seed)
    return [sample_scene(rng, split) for _ in range(count)]


def toy_captions(count: int, seed: int = 0, split: str = "train") -> list[str]:
    """The captions of `sample_scenes(count, seed, split)`, in order: the toy world's prompts."""
    return [caption_of(scene) for scene in sample_scenes(count, seed=seed, split=split)]


def render_dataset(count: int, seed: int, split: str = "train") -> tuple[list[str], np.ndarray]:
    """Captions and pixels of `count` scenes fixed by `seed`.

    Returns:
        (captions, images): `count` captions and a (count, 36, 36, 3) uint8 array.
    """
    rng = np.random.default_rng(seed)
    captions, images = [], np.empty((count, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for i in range(count):
        scene = sample_scene(rng, split)
        captions.append(caption_of(scene))
        images[i] = render_scene(scene, rng)
    return captions, images
