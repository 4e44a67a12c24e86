"""The texture world's network: the toy's caption encoder + LlamaGen GPT at the texture world's sizes.

The architecture is `models.toy.ToyTextToImage` (a word-level caption encoder feeding
`models.llamagen.LlamaGenTransformer`), built over the texture grammar's words, a 12 x 12 token grid
and the texture codebook.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from models.llamagen import LlamaGenConfig
from models.texture.world import GRID, MAX_CAPTION_WORDS, WORDS
from models.toy import CaptionEncoderConfig, ToyTextToImage

TEXTURE_ENCODER_CONFIG = CaptionEncoderConfig(vocab_size=len(WORDS), words=WORDS, num_slots=MAX_CAPTION_WORDS)
TEXTURE_GPT_CONFIG = LlamaGenConfig(
    dim=128, num_layers=8, num_heads=2, multiple_of=64, vocab_size=8192, caption_dim=128,
    cls_token_num=MAX_CAPTION_WORDS, grid_size=GRID,
)  # fmt: skip


def texture_network(vocab_size: int, gpt_config: LlamaGenConfig = TEXTURE_GPT_CONFIG) -> ToyTextToImage:
    """A fresh (randomly initialised) texture-world network for a codebook of `vocab_size` codes."""
    encoder = dataclasses.replace(TEXTURE_ENCODER_CONFIG, dim=gpt_config.caption_dim)
    return ToyTextToImage(encoder, dataclasses.replace(gpt_config, vocab_size=vocab_size))


def network_from_checkpoint(path: Path) -> ToyTextToImage:
    """The network of a resumable checkpoint (`texture_target.partial.pt`), in eval mode: a run in progress."""
    state = torch.load(path, weights_only=True)
    fields = json.loads(state["gpt_config"])
    fields["aux_layer_ids"] = tuple(fields["aux_layer_ids"])
    config = LlamaGenConfig(**fields)
    model = texture_network(config.vocab_size, config)
    model.load_state_dict(state["model"])
    return model.eval()
