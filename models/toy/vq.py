"""Patch vector quantiser of the toy world: k-means over image patches, with encode and decode.

An image of (H, W) pixels is cut into non-overlapping P x P patches, read in raster order, and
each patch becomes the index of its nearest codebook entry (squared Euclidean distance over the
P*P*3 RGB values scaled to [0, 1]). Decoding pastes the codebook patches back. The codebook is
fitted with Lloyd's k-means, seeded by k-means++.

Shapes: B images, H x W pixels, P patch side, G = (H/P)*(W/P) tokens, C = P*P*3, K codes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.toy.world import IMAGE_SIZE, PATCH_SIZE


def image_to_patches(images: Tensor, patch: int) -> Tensor:
    """(B, H, W, 3) uint8 or float -> (B, G, C) float in [0, 1], patches in raster order."""
    batch, height, width, channels = images.shape
    if height % patch or width % patch:
        raise ValueError(f"image size {height}x{width} is not a multiple of the patch size {patch}")
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    x = x.view(batch, height // patch, patch, width // patch, patch, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(batch, (height // patch) * (width // patch), -1)  # (B, G, C)


def patches_to_image(patches: Tensor, grid: tuple[int, int], patch: int) -> Tensor:
    """(B, G, C) float in [0, 1] -> (B, H, W, 3) uint8."""
    rows, cols = grid
    batch = patches.shape[0]
    x = patches.view(batch, rows, cols, patch, patch, 3).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(batch, rows * patch, cols * patch, 3)  # (B, H, W, 3)
    return (x.clamp(0, 1) * 255.0).round().to(torch.uint8)


class PatchVQ(nn.Module):
    """K-means patch tokenizer: `encode` pixels to code ids, `decode` code ids to pixels."""

    codebook: Tensor  # (K, C), a registered buffer

    def __init__(self, num_codes: int = 4096, patch: int = PATCH_SIZE, image_size: int = IMAGE_SIZE) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size {image_size} must be a multiple of patch {patch}")
        self.patch, self.image_size = patch, image_size
        self.register_buffer("codebook", torch.zeros(num_codes, patch * patch * 3))  # (K, C)

    @property
    def num_codes(self) -> int:
        return self.codebook.shape[0]

    @property
    def grid(self) -> tuple[int, int]:
        side = self.image_size // self.patch
        return side, side

    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:
        """(B, H, W, 3) uint8 -> (B, G) int64 code ids."""
        patches = image_to_patches(images, self.patch)  # (B, G, C)
        return nearest_code(patches.flatten(0, 1), self.codebook).view(patches.shape[:2])

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        """(B, G) code ids -> (B, H, W, 3) uint8."""
        if tokens.min() < 0 or tokens.max() >= self.num_codes:
            raise ValueError(f"token ids must lie in [0, {self.num_codes}), got [{tokens.min()}, {tokens.max()}]")
        return patches_to_image(self.codebook[tokens], self.grid, self.patch)

    @torch.no_grad()
    def fit(self, images: Tensor, iterations: int = 25, seed: int = 0) -> list[float]:
        """Fit the codebook to the patches of `images` ((B, H, W, 3) uint8) with k-means.

        Returns:
            the mean squared patch error after each iteration.
        """
        data = image_to_patches(images, self.patch).flatten(0, 1)  # (B*G, C)
        generator = torch.Generator().manual_seed(seed)
        centres = _kmeans_plus_plus(data, self.num_codes, generator)
        errors = []
        for _ in range(iterations):
            assignment = nearest_code(data, centres)
            sums = torch.zeros_like(centres).index_add_(0, assignment, data)
            counts = torch.bincount(assignment, minlength=self.num_codes).float()
            empty = counts == 0
            centres = torch.where(empty[:, None], centres, sums / counts.clamp(min=1)[:, None])
            if empty.any():  # re-seed empty clusters with the worst-fitted patches
                residual = (data - centres[assignment]).pow(2).sum(-1)
                centres[empty] = data[residual.topk(int(empty.sum())).indices]
            errors.append(float((data - centres[nearest_code(data, centres)]).pow(2).mean()))
        self.codebook.copy_(centres)
        return errors

    def save(self, path: str | Path) -> None:
        """Write the codebook and its geometry to a safetensors file."""
        metadata = {"patch": str(self.patch), "image_size": str(self.image_size)}
        save_file({"codebook": self.codebook.contiguous()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> PatchVQ:
        """Read a tokenizer written by `save`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if "patch" not in metadata or "image_size" not in metadata:
            raise ValueError(f"{path} has no 'patch'/'image_size' metadata; it was not written by PatchVQ.save")
        codebook = load_file(str(path))["codebook"]
        vq = cls(codebook.shape[0], int(metadata["patch"]), int(metadata["image_size"]))
        vq.codebook.copy_(codebook)
        return vq


def nearest_code(points: Tensor, codebook: Tensor, chunk: int | None = None) -> Tensor:
    """Index of the nearest codebook row for each point. (N, C), (K, C) -> (N,) int64.

    Points go `chunk` at a time; by default as many as keep each (chunk, K) distance block near
    2^26 entries (256 MB), so an 8192-code fit does not hold tens of GB at once.
    """
    chunk = chunk or max(1024, 2**26 // codebook.shape[0])
    codebook_sq = codebook.pow(2).sum(-1)  # (K,)
    out = []
    for start in range(0, points.shape[0], chunk):
        block = points[start : start + chunk]
        distance = codebook_sq[None, :] - 2.0 * block @ codebook.T  # (n, K), up to the constant |x|^2
        out.append(distance.argmin(-1))
    return torch.cat(out)


def _kmeans_plus_plus(data: Tensor, num_codes: int, generator: torch.Generator) -> Tensor:
    """k-means++ seeding on a subsample of at most 50k points. (N, C) -> (K, C)."""
    if data.shape[0] < num_codes:
        raise ValueError(f"k-means needs at least {num_codes} patches, got {data.shape[0]}")
    sample = data[torch.randperm(data.shape[0], generator=generator)[:50_000]]
    centres = [sample[torch.randint(sample.shape[0], (1,), generator=generator)]]
    distance = (sample - centres[0]).pow(2).sum(-1)
    for _ in range(num_codes - 1):
        probabilities = distance / distance.sum() if distance.sum() > 0 else torch.ones_like(distance)
        chosen = sample[torch.multinomial(probabilities, 1, generator=generator)]
        centres.append(chosen)
        distance = torch.minimum(distance, (sample - chosen).pow(2).sum(-1))
    return torch.cat(centres)


def reconstruction_error(vq: PatchVQ, images: np.ndarray | Tensor) -> float:
    """Mean absolute pixel error (0-255 scale) of an encode/decode round trip."""
    pixels = torch.as_tensor(images)
    return float((vq.decode(vq.encode(pixels)).float() - pixels.float()).abs().mean())
