"""Metrics of the toy world: prompt fidelity and a FID-style distance, both from one small CNN.

`SceneReader` reads a scene's attributes back from pixels: for each of the nine named positions,
whether a shape is there and its colour, kind and size, plus the background's kind and colour. It
is trained here (`python -m models.toy.train --stage reader`) on rendered scenes, half of them
passed through the VQ so that it reads decoded images as well as clean ones.

- Prompt fidelity (our CLIP-score analogue) is the fraction of images whose every attribute, as
  read, matches the caption: the right shapes at the right places and nothing else, with the
  right colours, kinds and sizes, on the right background.
- The FID-style distance is torchmetrics' `FrechetInceptionDistance` with the reader's 256-d
  embedding as the feature network (nothing is downloaded).

Shapes: B images of S x S RGB (36 x 36 in the toy world), P = 9 positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.toy.world import (
    BACKGROUNDS,
    COLOUR_NAMES,
    IMAGE_SIZE,
    POSITIONS,
    SHAPES,
    SIZES,
    ShapeSpec,
    parse_caption,
)

NUM_POSITIONS = len(POSITIONS)
IGNORE = -100


def object_labels(scenes: Sequence[Sequence[ShapeSpec]], colours: Sequence[str], shapes: Sequence[str],
                  sizes: Sequence[str]) -> dict[str, Tensor]:  # fmt: skip
    """Per-position object labels of B scenes, each a list of objects at named positions.

    Returns present (B, P) 0/1 and colour/shape/size (B, P), the index of each object's attribute in
    `colours`/`shapes`/`sizes`, IGNORE (-100) at positions without an object.
    """
    batch = len(scenes)
    absent = torch.full((batch, NUM_POSITIONS), IGNORE, dtype=torch.long)
    labels = {name: absent.clone() for name in ("colour", "shape", "size")}
    labels["present"] = torch.zeros(batch, NUM_POSITIONS, dtype=torch.long)
    for row, objects in enumerate(scenes):
        for spec in objects:
            cell = POSITIONS.index(spec.position)
            labels["present"][row, cell] = 1
            labels["colour"][row, cell] = colours.index(spec.colour)
            labels["shape"][row, cell] = shapes.index(spec.shape)
            labels["size"][row, cell] = sizes.index(spec.size)
    return labels


def scene_labels(captions: list[str]) -> dict[str, Tensor]:
    """Toy attribute labels of captions: present/colour/shape/size (B, P), background/background_colour (B,).

    Colour, shape and size are IGNORE (-100) at positions without a shape.
    """
    scenes = [parse_caption(caption) for caption in captions]
    labels = object_labels([scene.shapes for scene in scenes], COLOUR_NAMES, SHAPES, SIZES)
    labels["background"] = torch.tensor([BACKGROUNDS.index(s.background) for s in scenes], dtype=torch.long)
    labels["background_colour"] = torch.tensor([COLOUR_NAMES.index(s.background_colour) for s in scenes])
    return labels


class SceneReader(nn.Module):
    """A small CNN from S x S RGB to scene attributes and a 256-d embedding (the toy world's: S = 36).

    What a world reads is set by class attributes, so another world subclasses it: `image_size`,
    `object_heads` (per-position attributes of an object and their class counts; presence is always
    read), `scene_heads` (whole-image attributes), `feature_layers` (the convolutional stack) and
    `labels` (captions -> the attribute indices, keyed like the heads). A match needs every object
    attribute and the scene heads in `matched_scene_heads` (all by default); `attribute_errors` reports
    every head.
    """

    embedding_dim = 256
    image_size = IMAGE_SIZE
    object_heads: dict[str, int] = {"colour": len(COLOUR_NAMES), "shape": len(SHAPES), "size": len(SIZES)}
    scene_heads: dict[str, int] = {"background": len(BACKGROUNDS), "background_colour": len(COLOUR_NAMES)}
    matched_scene_heads: tuple[str, ...] | None = None  # the scene heads a match needs (None: all of them)

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(*self.feature_layers())
        self.cell_width = 2 + sum(self.object_heads.values())  # presence (2) + each object attribute's classes
        self.heads = nn.Linear(self.embedding_dim, NUM_POSITIONS * self.cell_width + sum(self.scene_heads.values()))

    def feature_layers(self) -> list[nn.Module]:
        """(B, 3, S, S) -> (B, 256): two stride-2 stages to S / 4, flattened into the embedding."""
        return [
            nn.Conv2d(3, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.GELU(),  # S/2
            nn.Conv2d(64, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, 96, 3, padding=1, stride=2), nn.GELU(),  # S/4
            nn.Flatten(),
            nn.Linear(96 * (self.image_size // 4) ** 2, self.embedding_dim), nn.GELU(),
        ]  # fmt: skip

    def labels(self, captions: list[str]) -> dict[str, Tensor]:
        """The attributes `captions` ask for: present (B, P), each object head (B, P), each scene head (B,)."""
        return scene_labels(captions)

    def embed(self, images: Tensor) -> Tensor:
        """(B, S, S, 3) uint8 -> (B, 256) float embedding."""
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (B, 3, S, S)
        return self.features(x)

    def forward(self, images: Tensor) -> dict[str, Tensor]:
        """(B, S, S, 3) uint8 -> attribute logits: present (B, P, 2), each object head (B, P, classes), each
        scene head (B, classes)."""
        out = self.heads(self.embed(images))
        cells, scene = out.split([NUM_POSITIONS * self.cell_width, out.shape[1] - NUM_POSITIONS * self.cell_width], 1)
        cells = cells.view(-1, NUM_POSITIONS, self.cell_width)  # (B, P, cell)
        present, *objects = cells.split([2, *self.object_heads.values()], dim=-1)
        logits = {"present": present, **dict(zip(self.object_heads, objects, strict=True))}
        logits.update(zip(self.scene_heads, scene.split(list(self.scene_heads.values()), dim=-1), strict=True))
        return logits

    def loss(self, images: Tensor, labels: dict[str, Tensor]) -> Tensor:
        """Sum of the attribute cross-entropies (absent positions ignored for the object attributes)."""
        logits = self(images)
        return sum(
            (
                F.cross_entropy(logits[name].flatten(0, -2), labels[name].flatten(), ignore_index=IGNORE)
                for name in logits
            ),
            start=torch.zeros(()),
        )

    @torch.no_grad()
    def read(self, images: Tensor) -> dict[str, Tensor]:
        """Predicted attribute indices, keyed like `labels`."""
        return {name: logits.argmax(-1) for name, logits in self(images).items()}

    @torch.no_grad()
    def matches(self, images: Tensor, captions: list[str], batch_size: int = 256) -> Tensor:
        """Whether each image shows exactly what its caption says. (B, S, S, 3) uint8 -> (B,) bool.

        Reads `batch_size` images at a time.
        """
        if len(captions) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
        if len(captions) > batch_size:
            return torch.cat([
                self.matches(images[i : i + batch_size], captions[i : i + batch_size], batch_size)
                for i in range(0, len(captions), batch_size)
            ])  # fmt: skip
        read, labels = self.read(images), self.labels(captions)
        present = labels["present"].bool()
        ok = (read["present"] == labels["present"]).all(1)
        for name in self.object_heads:
            ok &= ((read[name] == labels[name]) | ~present).all(1)
        for name in self.scene_heads if self.matched_scene_heads is None else self.matched_scene_heads:
            ok &= read[name] == labels[name]
        return ok

    @torch.no_grad()
    def attribute_errors(self, images: Tensor, captions: list[str]) -> dict[str, float]:
        """Which attributes fail: the fraction of images with at least one error of each kind.

        Keys: `spurious` (an object read where the caption has none), `missing` (a captioned object not
        read), each object head (e.g. `colour`, `shape`, `size`, of a captioned object that is there) and
        each scene head (e.g. `background`). An image may count under several keys; prompt fidelity is
        the share with none. (B, S, S, 3) uint8 images.
        """
        if len(captions) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
        read, labels = self.read(images), self.labels(captions)
        present = labels["present"].bool()
        read_present = read["present"].bool()
        errors = {
            "spurious": (read_present & ~present).any(1),
            "missing": (~read_present & present).any(1),
            **{name: ((read[name] != labels[name]) & present & read_present).any(1) for name in self.object_heads},
            **{name: read[name] != labels[name] for name in self.scene_heads},
        }
        return {name: float(wrong.float().mean()) for name, wrong in errors.items()}

    def fidelity(self, images: Tensor, captions: list[str], batch_size: int = 256) -> float:
        """Prompt fidelity: the fraction of images whose attributes, read from pixels, match the caption."""
        return float(self.matches(images, captions, batch_size).float().mean())

    def save(self, path: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> Self:
        reader = cls()
        reader.load_state_dict(load_file(str(path)), strict=True)
        return reader.eval()


class SceneFeatures(nn.Module):
    """The reader's embedding as a torchmetrics FID feature network: (N, 3, H, W) uint8 -> (N, 256)."""

    def __init__(self, reader: SceneReader) -> None:
        super().__init__()
        self.reader = reader
        self.num_features = reader.embedding_dim

    def forward(self, images: Tensor) -> Tensor:
        return self.reader.embed(images.permute(0, 2, 3, 1))


@torch.no_grad()
def frechet_distance(real: Tensor, generated: Tensor, reader: SceneReader) -> float:
    """FID-style distance between two image sets ((N, S, S, 3) uint8 each) in the reader's feature space."""
    from torchmetrics.image.fid import FrechetInceptionDistance  # lazy: torchmetrics takes seconds to import

    metric = FrechetInceptionDistance(feature=SceneFeatures(reader), normalize=False)
    metric.update(real.permute(0, 3, 1, 2), real=True)
    metric.update(generated.permute(0, 3, 1, 2), real=False)
    return float(metric.compute())
