"""Deterministic generator and renderer of the texture world's captioned scenes.

A scene is drawn from a `numpy.random.Generator`, so `(seed, index)` fixes its caption and pixels on
every machine. What the caption leaves open is drawn per image, as real images leave it open to a
text-to-image model:

- the texture's exact frequency (within its scale's band), orientation, contrast and noise phase;
  the texture is smooth value noise (fractal sums of octaves) shaped into clouds, marble veins, wood
  rings, sand ripples or granite speckle, plus a fine detail: value noise on a lattice of 2.5-4 px, so
  every patch holds a few fresh random values (what the caption and the smooth field leave open) and
  shares the rest with its neighbours across its borders (what the tokens before it reveal), and a
  faint per-pixel grain;
- the light direction, which shades every object (spheres for circles, tilted planes otherwise) and
  casts a soft shadow on the texture;
- each object's offset of up to 2 px from its cell centre, and edges anti-aliased over about a pixel
  (coverage from 4x supersampling), so object borders fall anywhere inside a patch.

    captions, images = render_texture_dataset(64, seed=0, split="heldout")  # (64, 48, 48, 3) uint8
"""

from __future__ import annotations

import math

import numpy as np

from models.texture.world import (
    IMAGE_SIZE,
    MAX_OBJECTS,
    OBJECT_COLOURS,
    OBJECT_SHAPES,
    OBJECT_SIZES,
    TEXTURE_COLOURS,
    TEXTURE_SCALES,
    TEXTURES,
    ShapeSpec,
    TextureScene,
    texture_caption,
)
from models.toy import COLOURS, POSITIONS, cell_centre, is_held_out, shape_mask

OBJECT_RADIUS = {"small": 5.0, "large": 7.5}  # px on the 48 px canvas: a large object spans about 4 x 4 patches
OBJECT_COUNT_PROBABILITIES = (0.45, 0.35, 0.2)  # for 1, 2 and 3 objects
# Cycles per pixel of the texture's base octave, by caption scale.
FREQUENCY_BANDS = {"coarse": (1 / 26, 1 / 14), "fine": (1 / 11, 1 / 6)}
CONTRAST_RANGE = (0.5, 1.0)  # drawn per image: how far the texture swings around its tone
TEXTURE_SWING = 0.45  # relative brightness swing of a full-contrast texture
# Fine detail, grey levels (standard deviation) and lattice period in px: value noise whose lattice points a
# patch shares with its neighbours, so a patch's detail is random where the patch holds new lattice points and
# fixed by the codes above and to its left where it shares them. It spreads a texture patch over many
# near-duplicate codes, as the grain of a real texture does, but the spread depends on the context.
DETAIL_STD = {"clouds": 11.0, "marble": 11.0, "wood": 11.0, "sand": 15.0, "granite": 13.0}
DETAIL_PERIOD = (2.5, 4.0)  # px between lattice points, drawn per image
# Per-pixel grain, grey levels: a grey part shared by R, G, B and an independent part per channel. It is what a
# patch holds that no neighbour predicts; kept faint, so most of a patch's spread depends on its context.
GRAIN_STD = {"clouds": 3.0, "marble": 3.0, "wood": 3.0, "sand": 4.0, "granite": 4.0}
CHROMA_GRAIN_STD = 2.0
OBJECT_GRAIN_STD = 2.0
SUPERSAMPLE = 4
JITTER = 2.0  # px an object may sit off its cell centre
SPLITS = ("train", "heldout", "any")
# "texture": the world's images; "plain": the same scenes (the same draws) over the flat tone, no texture, detail or
# grain. The plain images are a first training stage's data: a target learns which words place and colour which
# object where the background does not dominate the loss, then a second stage adds the textures.
BACKGROUNDS = ("texture", "plain")


def value_noise(
    rng: np.random.Generator, size: int, frequency: float, angle: float, stretch: float = 1.0
) -> np.ndarray:
    """Smooth value noise on a (size, size) canvas, about frequency cycles per pixel along a rotated frame.

    Random values on a lattice (one per cycle) are interpolated with smoothstep weights; `stretch`
    > 1 squeezes the noise across `angle` (grain along wood fibres). Values lie in [-1, 1].
    """
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    along = (xs * math.cos(angle) + ys * math.sin(angle)) * frequency
    across = (-xs * math.sin(angle) + ys * math.cos(angle)) * frequency * stretch
    along = along - along.min() + rng.random()
    across = across - across.min() + rng.random()
    lattice = rng.uniform(-1.0, 1.0, size=(int(across.max()) + 2, int(along.max()) + 2))
    row, col = np.floor(across).astype(int), np.floor(along).astype(int)
    fy, fx = across - row, along - col
    wy, wx = fy * fy * (3 - 2 * fy), fx * fx * (3 - 2 * fx)
    top = lattice[row, col] * (1 - wx) + lattice[row, col + 1] * wx
    bottom = lattice[row + 1, col] * (1 - wx) + lattice[row + 1, col + 1] * wx
    return top * (1 - wy) + bottom * wy


def fractal_noise(rng: np.random.Generator, size: int, frequency: float, angle: float, octaves: int,
                  persistence: float, stretch: float = 1.0) -> np.ndarray:  # fmt: skip
    """A sum of `octaves` value noises, each twice the frequency and `persistence` times the amplitude
    of the last, scaled to about unit standard deviation. (size, size) float."""
    total = np.zeros((size, size))
    for octave in range(octaves):
        total += persistence**octave * value_noise(rng, size, frequency * 2**octave, angle, stretch)
    return total / max(float(total.std()), 1e-6)


def texture_field(texture: str, frequency: float, angle: float, rng: np.random.Generator, size: int) -> np.ndarray:
    """The texture's brightness pattern, (size, size) float of about unit scale, before contrast and colour."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    along = xs * math.cos(angle) + ys * math.sin(angle)
    if texture == "clouds":
        return fractal_noise(rng, size, frequency, angle, octaves=5, persistence=0.6)
    if texture == "marble":  # veins: a sine bent by turbulence
        turbulence = fractal_noise(rng, size, frequency, angle, octaves=4, persistence=0.55)
        return np.sin(2 * math.pi * frequency * along + 2.2 * turbulence) * 1.2
    if texture == "wood":  # rings around a centre off the canvas, with fibres along the grain
        across = -xs * math.sin(angle) + ys * math.cos(angle)
        centre_along, centre_across = rng.uniform(-2, 3) * size, rng.uniform(-1.5, -0.5) * size
        radius = np.hypot((along - centre_along) * 0.25, across - centre_across)
        bend = fractal_noise(rng, size, frequency / 2, angle, octaves=2, persistence=0.5)
        rings = np.sin(2 * math.pi * frequency * 1.5 * radius + 1.5 * bend)
        fibres = fractal_noise(rng, size, frequency * 2, angle + math.pi / 2, octaves=2, persistence=0.6, stretch=6.0)
        return rings + 0.45 * fibres
    if texture == "sand":  # soft ripples under a coarse grain (most of sand's look is its grain)
        ripple = fractal_noise(rng, size, frequency / 2, angle, octaves=2, persistence=0.5)
        return 0.6 * np.sin(2 * math.pi * frequency * along + 1.5 * ripple)
    if texture == "granite":  # speckle: high octaves plus sparse dark and light crystals
        speckle = fractal_noise(rng, size, frequency * 2, angle, octaves=3, persistence=0.85)
        crystals = rng.random((size, size))
        return 0.8 * speckle - 1.6 * (crystals < 0.06) + 1.0 * (crystals > 0.95)
    raise ValueError(f"unknown texture {texture!r}; the texture world knows {', '.join(TEXTURES)}")


def _coverage(shape: str, centre_y: float, centre_x: float, radius: float, size: int) -> np.ndarray:
    """Share of each pixel the shape covers, (size, size) float in [0, 1], from a 4x supersampled mask."""
    s = SUPERSAMPLE
    fine = shape_mask(shape, centre_y * s, centre_x * s, radius * s, size * s).astype(np.float32)
    return fine.reshape(size, s, size, s).mean(axis=(1, 3))


def _shading(shape: str, centre_y: float, centre_x: float, radius: float, light: np.ndarray, size: int) -> np.ndarray:
    """Brightness factor of an object lit from `light` (unit (y, x, z)): a sphere for circles, a tilted plane else."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    dy, dx = (ys - centre_y) / radius, (xs - centre_x) / radius
    if shape == "circle":
        dz = np.sqrt(np.clip(1.0 - dy**2 - dx**2, 0.0, None))
        lambert = np.clip(dy * light[0] + dx * light[1] + dz * light[2], 0.0, None)
        return 0.35 + 0.8 * lambert
    return 0.9 + 0.3 * (dy * light[0] + dx * light[1])


def render_texture_scene(scene: TextureScene, rng: np.random.Generator, size: int = IMAGE_SIZE,
                         background: str = "texture") -> np.ndarray:  # fmt: skip
    """Draw a scene; the generator picks what the caption leaves open. Returns (size, size, 3) uint8 RGB.
    `background` "plain" draws the same scene over its flat tone (BACKGROUNDS)."""
    return render_texture_scene_with_coverage(scene, rng, size, background)[0]


def render_texture_scene_with_coverage(
    scene: TextureScene, rng: np.random.Generator, size: int = IMAGE_SIZE, background: str = "texture"
) -> tuple[np.ndarray, np.ndarray]:
    """`render_texture_scene` (the same draws, the same pixels) and the share of each pixel the objects cover:
    (size, size, 3) uint8 RGB and (size, size) float32 in [0, 1] (the largest object coverage at the pixel)."""
    if background not in BACKGROUNDS:
        raise ValueError(f"unknown background {background!r}; use one of {', '.join(BACKGROUNDS)}")
    low, high = FREQUENCY_BANDS[scene.scale]
    frequency = float(np.exp(rng.uniform(math.log(low), math.log(high)))) * IMAGE_SIZE / size
    angle = float(rng.uniform(0.0, math.pi))
    contrast = float(rng.uniform(*CONTRAST_RANGE))
    field = texture_field(scene.texture, frequency, angle, rng, size)
    tone = np.asarray(TEXTURE_COLOURS[scene.tone], dtype=np.float64)
    period = float(rng.uniform(*DETAIL_PERIOD)) * size / IMAGE_SIZE
    detail = value_noise(rng, size, 1.0 / period, float(rng.uniform(0.0, math.pi)))
    detail = DETAIL_STD[scene.texture] * detail / max(float(detail.std()), 1e-6)  # (size, size)
    grain = rng.normal(0.0, GRAIN_STD[scene.texture], size=(size, size, 1))
    grain = grain + rng.normal(0.0, CHROMA_GRAIN_STD, size=(size, size, 3))
    canvas = tone * (1.0 + TEXTURE_SWING * contrast * np.tanh(field))[..., None] + detail[..., None] + grain
    if background == "plain":  # the draws above are made either way, so both backgrounds show the same objects
        canvas = np.broadcast_to(tone, canvas.shape).copy()

    light_angle = float(rng.uniform(0.0, 2 * math.pi))
    light = np.array([math.sin(light_angle) * 0.6, math.cos(light_angle) * 0.6, 0.8])  # unit (y, x, z)
    placed = []
    for item in scene.objects:
        centre_y, centre_x = cell_centre(item.position, size)
        centre_y += float(rng.uniform(-JITTER, JITTER)) * size / IMAGE_SIZE
        centre_x += float(rng.uniform(-JITTER, JITTER)) * size / IMAGE_SIZE
        placed.append((item, centre_y, centre_x, OBJECT_RADIUS[item.size] * size / IMAGE_SIZE))
    for item, centre_y, centre_x, radius in placed:  # soft shadows first, away from the light
        offset = 0.25 * radius
        shadow = _coverage(item.shape, centre_y - light[0] * offset, centre_x - light[1] * offset, radius * 1.05, size)
        canvas *= (1.0 - 0.35 * shadow)[..., None]
    covered = np.zeros((size, size), dtype=np.float32)
    for item, centre_y, centre_x, radius in placed:
        alpha = _coverage(item.shape, centre_y, centre_x, radius, size)[..., None]
        covered = np.maximum(covered, alpha[..., 0])
        shade = _shading(item.shape, centre_y, centre_x, radius, light, size)[..., None]
        colour = np.asarray(COLOURS[item.colour], dtype=np.float64) * shade
        colour = colour + rng.normal(0.0, OBJECT_GRAIN_STD, size=(size, size, 1))
        canvas = (1.0 - alpha) * canvas + alpha * colour
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8), covered


def sample_texture_scene(rng: np.random.Generator, split: str = "train") -> TextureScene:
    """Draw a random scene whose caption belongs to `split` ('train', 'heldout' or 'any')."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    while True:
        count = int(rng.choice(np.arange(1, MAX_OBJECTS + 1), p=OBJECT_COUNT_PROBABILITIES))
        cells = rng.choice(len(POSITIONS), size=count, replace=False)
        objects = tuple(
            ShapeSpec(
                colour=OBJECT_COLOURS[rng.integers(len(OBJECT_COLOURS))],
                shape=OBJECT_SHAPES[rng.integers(len(OBJECT_SHAPES))],
                size=OBJECT_SIZES[rng.integers(len(OBJECT_SIZES))],
                position=POSITIONS[int(cell)],
            )
            for cell in cells
        )
        scene = TextureScene(
            objects,
            TEXTURES[rng.integers(len(TEXTURES))],
            TEXTURE_SCALES[rng.integers(len(TEXTURE_SCALES))],
            tuple(TEXTURE_COLOURS)[rng.integers(len(TEXTURE_COLOURS))],
        ).in_reading_order()
        if split == "any" or is_held_out(texture_caption(scene)) == (split == "heldout"):
            return scene


def texture_captions(count: int, seed: int = 0, split: str = "train") -> list[str]:
    """Captions of `count` scenes of a split, fixed by `seed`: the texture world's prompts."""
    rng = np.random.default_rng(seed)
    return [texture_caption(sample_texture_scene(rng, split)) for _ in range(count)]


def render_texture_dataset(count: int, seed: int, split: str = "train", size: int = IMAGE_SIZE,
                           background: str = "texture") -> tuple[list[str], np.ndarray]:  # fmt: skip
    """Captions and pixels of `count` scenes fixed by `seed`: `count` captions and (count, size, size, 3) uint8."""
    captions, images, _ = render_texture_dataset_with_coverage(count, seed, split, size, background)
    return captions, images


def render_texture_dataset_with_coverage(
    count: int, seed: int, split: str = "train", size: int = IMAGE_SIZE, background: str = "texture"
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """`render_texture_dataset` (the same captions and pixels) and each pixel's object coverage:
    `count` captions, (count, size, size, 3) uint8 and (count, size, size) float32 in [0, 1]."""
    rng = np.random.default_rng(seed)
    captions, images = [], np.empty((count, size, size, 3), dtype=np.uint8)
    coverage = np.empty((count, size, size), dtype=np.float32)
    for i in range(count):
        scene = sample_texture_scene(rng, split)
        captions.append(texture_caption(scene))
        images[i], coverage[i] = render_texture_scene_with_coverage(scene, rng, size, background)
    return captions, images, coverage
