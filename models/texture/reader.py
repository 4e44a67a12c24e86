"""The texture world's scene reader: prompt fidelity and FID-style features for 48 x 48 images.

The toy's `SceneReader` (a small CNN read by attribute heads) with this world's vocabulary: at each of
the nine named positions, whether an object is there and its colour, shape (circle, square, triangle)
and size; for the whole image, the texture (clouds, marble, wood, sand, granite), its scale (fine,
coarse) and its tone (brown, grey, green, blue). An image matches its caption when every object and
the tone read as the caption says; the texture's kind and scale are read and reported by
`attribute_errors`, but not matched, because the reader cannot name them reliably even on the
world's own renders (MODEL_CARD.md). Its 256-d embedding is the FID-style feature network.

It is trained by `python -m models.texture.train --stage reader` on freshly drawn scenes of both
splits, half of every batch passed through the VQ as generated images are, into
`texture_reader.safetensors`.

Shapes: B images of 48 x 48 RGB, P = 9 positions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.texture.world import (
    IMAGE_SIZE,
    OBJECT_COLOURS,
    OBJECT_SHAPES,
    OBJECT_SIZES,
    TEXTURE_COLOUR_NAMES,
    TEXTURE_SCALES,
    TEXTURES,
    parse_texture_caption,
)
from models.toy import SceneReader, object_labels

READER_FILE = "texture_reader.safetensors"


class TextureSceneReader(SceneReader):
    """Reads a texture-world scene's objects and background texture back from its pixels."""

    image_size = IMAGE_SIZE
    object_heads = {"colour": len(OBJECT_COLOURS), "shape": len(OBJECT_SHAPES), "size": len(OBJECT_SIZES)}
    scene_heads = {"texture": len(TEXTURES), "scale": len(TEXTURE_SCALES), "tone": len(TEXTURE_COLOUR_NAMES)}
    # The texture's kind and scale are read but not matched: on ground-truth scenes the reader names them right for
    # 80-82 % and 85-88 % of images (MODEL_CARD.md), so a match on them would measure the reader, not the target.
    matched_scene_heads = ("tone",)

    def feature_layers(self) -> list[nn.Module]:
        """(B, 3, 48, 48) -> (B, 256): three stride-2 stages to 6 x 6 (a texture's scale needs a wider view)."""
        return [
            nn.Conv2d(3, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.GELU(),  # 24 x 24
            nn.Conv2d(64, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, 96, 3, padding=1, stride=2), nn.GELU(),  # 12 x 12
            nn.Conv2d(96, 96, 3, padding=1, stride=2), nn.GELU(),  # 6 x 6
            nn.Flatten(),
            nn.Linear(96 * (self.image_size // 8) ** 2, self.embedding_dim), nn.GELU(),
        ]  # fmt: skip

    def labels(self, captions: list[str]) -> dict[str, Tensor]:
        """present/colour/shape/size (B, P) with IGNORE where no object is; texture/scale/tone (B,)."""
        scenes = [parse_texture_caption(caption) for caption in captions]
        labels = object_labels([scene.objects for scene in scenes], OBJECT_COLOURS, OBJECT_SHAPES, OBJECT_SIZES)
        labels["texture"] = torch.tensor([TEXTURES.index(s.texture) for s in scenes], dtype=torch.long)
        labels["scale"] = torch.tensor([TEXTURE_SCALES.index(s.scale) for s in scenes], dtype=torch.long)
        labels["tone"] = torch.tensor([TEXTURE_COLOUR_NAMES.index(s.tone) for s in scenes], dtype=torch.long)
        return labels
