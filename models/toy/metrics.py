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

Shapes: B images of 36 x 36 RGB, P = 9 positions.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.toy.world import BACKGROUNDS, COLOUR_NAMES, IMAGE_SIZE, POSITIONS, SHAPES, SIZES, parse_caption

NUM_POSITIONS = len(POSITIONS)
# Per position: presence (2), colour, shape kind, size; then background kind and colour.
_CELL_WIDTH = 2 + len(COLOUR_NAMES) + len(SHAPES) + len(SIZES)
_HEAD_WIDTH = NUM_POSITIONS * _CELL_WIDTH + len(BACKGROUNDS) + len(COLOUR_NAMES)
IGNORE = -100


def scene_labels(captions: list[str]) -> dict[str, Tensor]:
    """Attribute labels of captions: present/colour/shape/size (B, P), background/background_colour (B,).

    Colour, shape and size are IGNORE (-100) at positions without a shape.
    """
    batch = len(captions)
    labels = {
        name: torch.full((batch, NUM_POSITIONS), IGNORE, dtype=torch.long) for name in ("colour", "shape", "size")
    }
    labels["present"] = torch.zeros(batch, NUM_POSITIONS, dtype=torch.long)
    labels["background"] = torch.empty(batch, dtype=torch.long)
    labels["background_colour"] = torch.empty(batch, dtype=torch.long)
    for row, caption in enumerate(captions):
        scene = parse_caption(caption)
        for spec in scene.shapes:
            cell = POSITIONS.index(spec.position)
            labels["present"][row, cell] = 1
            labels["colour"][row, cell] = COLOUR_NAMES.index(spec.colour)
            labels["shape"][row, cell] = SHAPES.index(spec.shape)
            labels["size"][row, cell] = SIZES.index(spec.size)
        labels["background"][row] = BACKGROUNDS.index(scene.background)
        labels["background_colour"][row] = COLOUR_NAMES.index(scene.background_colour)
    return labels


class SceneReader(nn.Module):
    """A small CNN from 36 x 36 RGB to scene attributes and a 256-d embedding."""

    embedding_dim = 256
    image_size = IMAGE_SIZE

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.GELU(),  # 18 x 18
            nn.Conv2d(64, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, 96, 3, padding=1, stride=2), nn.GELU(),  # 9 x 9
            nn.Flatten(),
            nn.Linear(96 * (IMAGE_SIZE // 4) ** 2, self.embedding_dim), nn.GELU(),
        )  # fmt: skip
        self.heads = nn.Linear(self.embedding_dim, _HEAD_WIDTH)

    def embed(self, images: Tensor) -> Tensor:
        """(B, 36, 36, 3) uint8 -> (B, 256) float embedding."""
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (B, 3, 36, 36)
        return self.features(x)

    def forward(self, images: Tensor) -> dict[str, Tensor]:
        """(B, 36, 36, 3) uint8 -> attribute logits: present (B, P, 2), colour (B, P, 8), shape, size,
        background (B, 4), background_colour (B, 8)."""
        out = self.heads(self.embed(images))
        cells, background = out.split([NUM_POSITIONS * _CELL_WIDTH, out.shape[1] - NUM_POSITIONS * _CELL_WIDTH], 1)
        cells = cells.view(-1, NUM_POSITIONS, _CELL_WIDTH)  # (B, P, cell)
        present, colour, shape, size = cells.split([2, len(COLOUR_NAMES), len(SHAPES), len(SIZES)], dim=-1)
        kind, background_colour = background.split([len(BACKGROUNDS), len(COLOUR_NAMES)], dim=-1)
        return {"present": present, "colour": colour, "shape": shape, "size": size,
                "background": kind, "background_colour": background_colour}  # fmt: skip

    def loss(self, images: Tensor, labels: dict[str, Tensor]) -> Tensor:
        """Sum of the attribute cross-entropies (absent positions ignored for colour/shape/size)."""
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
        """Predicted attribute indices, keyed like `scene_labels`."""
        return {name: logits.argmax(-1) for name, logits in self(images).items()}

    @torch.no_grad()
    def matches(self, images: Tensor, captions: list[str], batch_size: int = 256) -> Tensor:
        """Whether each image shows exactly what its caption says. (B, 36, 36, 3) uint8 -> (B,) bool.

        Reads `batch_size` images at a time.
        """
        if len(captions) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
        if len(captions) > batch_size:
            return torch.cat([
                self.matches(images[i : i + batch_size], captions[i : i + batch_size], batch_size)
                for i in range(0, len(captions), batch_size)
            ])  # fmt: skip
        read, labels = self.read(images), scene_labels(captions)
        present = labels["present"].bool()
        ok = (read["present"] == labels["present"]).all(1)
        for name in ("colour", "shape", "size"):
            ok &= ((read[name] == labels[name]) | ~present).all(1)
        return (
            ok
            & (read["background"] == labels["background"])
            & (read["background_colour"] == labels["background_colour"])
        )

    @torch.no_grad()
    def attribute_errors(self, images: Tensor, captions: list[str]) -> dict[str, float]:
        """Which attributes fail: the fraction of images with at least one error of each kind.

        Keys: `spurious` (a shape read where the caption has none), `missing` (a captioned shape not
        read), `colour`, `shape`, `size` (of a captioned shape that is there), `background`,
        `background_colour`. An image may count under several keys; prompt fidelity is the share
        with none. (B, 36, 36, 3) uint8 images.
        """
        if len(captions) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
        read, labels = self.read(images), scene_labels(captions)
        present = labels["present"].bool()
        read_present = read["present"].bool()
        errors = {
            "spurious": (read_present & ~present).any(1),
            "missing": (~read_present & present).any(1),
            **{
                name: ((read[name] != labels[name]) & present & read_present).any(1)
                for name in ("colour", "shape", "size")
            },
            "background": read["background"] != labels["background"],
            "background_colour": read["background_colour"] != labels["background_colour"],
        }
        return {name: float(wrong.float().mean()) for name, wrong in errors.items()}

    def fidelity(self, images: Tensor, captions: list[str], batch_size: int = 256) -> float:
        """Prompt fidelity: the fraction of images whose attributes, read from pixels, match the caption."""
        return float(self.matches(images, captions, batch_size).float().mean())

    def save(self, path: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> SceneReader:
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
    """FID-style distance between two image sets ((N, 36, 36, 3) uint8 each) in the reader's feature space."""
    from torchmetrics.image.fid import FrechetInceptionDistance  # lazy: torchmetrics takes seconds to import

    metric = FrechetInceptionDistance(feature=SceneFeatures(reader), normalize=False)
    metric.update(real.permute(0, 3, 1, 2), real=True)
    metric.update(generated.permute(0, 3, 1, 2), real=False)
    return float(metric.compute())
