"""The toy text-to-image network: a word-level caption encoder feeding a small LlamaGen GPT.

The caption encoder stands in for LlamaGen's FLAN-T5: caption words (left-padded to the caption
slots, as LlamaGen left-pads T5 features) go through word and slot embeddings and a small
bidirectional transformer encoder; padded slots come out as zeros (LlamaGen's `emb * mask`). The
GPT is `models.llamagen.LlamaGenTransformer` at a small size, trained with caption dropout so that
its learned unconditional caption serves classifier-free guidance.

Weights travel as one safetensors file whose metadata holds both configs as JSON, so the network
rebuilds from the file alone (`ToyTextToImage.load`).

Shapes: B captions, C caption slots, F caption feature width, D GPT width.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.llamagen import LlamaGenConfig, LlamaGenTransformer
from models.toy.world import IMAGE_SIZE, MAX_CAPTION_WORDS, PATCH_SIZE, WORDS, caption_word_ids


@dataclass(kw_only=True)
class CaptionEncoderConfig:
    """Size of the toy caption encoder."""

    vocab_size: int = len(WORDS)
    """Number of words, padding included."""
    words: tuple[str, ...] = WORDS
    """The word list, padding (index 0) and unknown (index 1) first: the toy grammar's, or another world's."""
    num_slots: int = MAX_CAPTION_WORDS
    """Caption slots C (words, left-padded)."""
    dim: int = 128
    """Width of the encoder, which is also the caption feature width F."""
    num_layers: int = 2
    """Bidirectional encoder layers."""
    num_heads: int = 4
    """Attention heads of the encoder."""


class CaptionEncoder(nn.Module):
    """Words -> caption features, the toy world's stand-in for a T5 encoder."""

    def __init__(self, config: CaptionEncoderConfig) -> None:
        super().__init__()
        if len(config.words) != config.vocab_size:
            raise ValueError(f"caption encoder: vocab_size {config.vocab_size} != {len(config.words)} words")
        self.config = config
        self.word_index = {word: i for i, word in enumerate(config.words)}
        self.word_embedding = nn.Embedding(config.vocab_size, config.dim)
        self.slot_embedding = nn.Parameter(torch.randn(config.num_slots, config.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            config.dim, config.num_heads, 2 * config.dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(config.dim)

    def forward(self, word_ids: Tensor, valid: Tensor) -> Tensor:
        """(B, C) word ids and (B, C) bool validity -> (B, C, F) features, zero on padded slots."""
        x = self.word_embedding(word_ids) + self.slot_embedding  # (B, C, F)
        x = self.encoder(x, src_key_padding_mask=~valid)
        return self.final_norm(x) * valid[..., None]

    def tokenize(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """Captions -> (word ids (B, C) int64, valid (B, C) bool) on this encoder's device."""
        ids, lengths = zip(
            *(caption_word_ids(c, self.config.num_slots, self.word_index) for c in captions), strict=True
        )
        device = self.slot_embedding.device
        word_ids = torch.tensor(ids, dtype=torch.long, device=device)
        slots = torch.arange(self.config.num_slots, device=device)
        valid = slots[None, :] >= self.config.num_slots - torch.tensor(lengths, device=device)[:, None]
        return word_ids, valid


TOY_GPT_CONFIG = LlamaGenConfig(
    dim=128, num_layers=8, num_heads=2, multiple_of=64, vocab_size=4096, caption_dim=128,
    cls_token_num=MAX_CAPTION_WORDS, grid_size=IMAGE_SIZE // PATCH_SIZE,
)  # fmt: skip


class ToyTextToImage(nn.Module):
    """Caption encoder + LlamaGen GPT; `forward` is the teacher-forced training pass."""

    def __init__(self, encoder_config: CaptionEncoderConfig, gpt_config: LlamaGenConfig) -> None:
        super().__init__()
        if encoder_config.dim != gpt_config.caption_dim or encoder_config.num_slots != gpt_config.cls_token_num:
            raise ValueError(
                f"caption encoder (dim {encoder_config.dim}, slots {encoder_config.num_slots}) must match the GPT's "
                f"caption_dim {gpt_config.caption_dim} and cls_token_num {gpt_config.cls_token_num}"
            )
        self.caption_encoder = CaptionEncoder(encoder_config)
        self.gpt = LlamaGenTransformer(gpt_config)

    def caption_features(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """Captions -> (features (B, C, F), valid (B, C) bool)."""
        word_ids, valid = self.caption_encoder.tokenize(captions)
        return self.caption_encoder(word_ids, valid), valid

    def forward(self, features: Tensor, valid: Tensor, image_tokens: Tensor) -> Tensor:
        """Teacher-forced logits of every image token.

        Args:
            features: (B, C, F) caption features (or the unconditional caption for dropped rows).
            valid: (B, C) bool, the caption slots that hold words.
            image_tokens: (B, G) int64, the image's code ids in raster order.

        Returns:
            (B, G, V) logits; row g predicts image token g from the caption and tokens < g.
        """
        gpt = self.gpt
        num_slots = features.shape[1]
        inputs = torch.cat([gpt.embed_captions(features), gpt.tok_embeddings(image_tokens[:, :-1])], dim=1)
        new_valid = torch.cat([valid, torch.ones_like(image_tokens[:, :-1], dtype=torch.bool)], dim=1)
        positions = torch.arange(inputs.shape[1], device=inputs.device)  # caption slots, then grid cells
        hidden, _ = gpt(inputs, positions, new_valid=new_valid)  # (B, C + G - 1, D)
        return gpt.output(hidden[:, num_slots - 1 :])  # (B, G, V)

    def save(self, path: str | Path, extra_metadata: dict[str, str] | None = None) -> None:
        """Write weights and both configs to one safetensors file."""
        metadata = {
            "caption_encoder": json.dumps(asdict(self.caption_encoder.config)),
            "gpt": json.dumps(asdict(self.gpt.config)),
            **(extra_metadata or {}),
        }
        state = {key: value.contiguous() for key, value in self.state_dict().items()}
        save_file(state, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> ToyTextToImage:
        """Rebuild the network from a file written by `save` (strict keys)."""
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if "caption_encoder" not in metadata or "gpt" not in metadata:
            raise ValueError(f"{path} lacks the 'caption_encoder'/'gpt' config metadata of ToyTextToImage.save")
        encoder_fields = json.loads(metadata["caption_encoder"])
        encoder_fields["words"] = tuple(encoder_fields.get("words", WORDS))  # files older than the field: toy words
        gpt_fields = json.loads(metadata["gpt"])
        gpt_fields["aux_layer_ids"] = tuple(gpt_fields["aux_layer_ids"])
        model = cls(CaptionEncoderConfig(**encoder_fields), LlamaGenConfig(**gpt_fields))
        model.load_state_dict(load_file(str(path)), strict=True)
        return model
