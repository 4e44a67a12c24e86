"""Shared fixtures: tiny random models built in memory, and test hygiene (default dtype, seeds)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from models.llamagen import LlamaGenConfig  # noqa: E402
from models.toy_model import CaptionEncoderConfig, ToyTextToImage  # noqa: E402
from models.toy_target import ToyTarget  # noqa: E402
from models.toy_world import MAX_CAPTION_WORDS  # noqa: E402
from models.vq import PatchVQ  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype = torch.get_default_dtype()
    torch.set_num_threads(1)  # tiny models run fastest on one thread; two stall on a busy 2-core machine
    yield
    torch.set_default_dtype(dtype)


def build_tiny_toy_target(seed: int = 0, grid: int = 4, vocab: int = 64) -> ToyTarget:
    """A random toy target with the real structure at a tiny size (2 layers, width 32, grid 4x4)."""
    torch.manual_seed(seed)
    encoder = CaptionEncoderConfig(dim=32, num_layers=1, num_heads=2)
    gpt = LlamaGenConfig(
        dim=32, num_layers=4, num_heads=2, multiple_of=32, vocab_size=vocab, caption_dim=32,
        cls_token_num=MAX_CAPTION_WORDS, grid_size=grid, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    network = ToyTextToImage(encoder, gpt)
    for parameter in network.parameters():  # larger weights than the init, so outputs differ clearly
        parameter.data.normal_(0, 0.15)
    vq = PatchVQ(num_codes=vocab, patch=4, image_size=4 * grid)
    vq.codebook.uniform_(0, 1)
    return ToyTarget(network, vq, name="tiny-toy")


@pytest.fixture
def tiny_target() -> ToyTarget:
    return build_tiny_toy_target()
