"""The toy world's target behind the `ImageTarget` interface: caption encoder + LlamaGen GPT + patch VQ.

    target = ToyTarget.from_assets()                 # the shipped weights in models/toy/assets/
    conditioning = target.condition(["a small red circle at the top left on a plain blue background"])

It follows LlamaGen's text-to-image sampler: the caption slots hold the caption features
(left-padded; padded slots masked), the unconditional rows hold the learned unconditional caption
with the conditional rows' mask, and image token j sits at position C + j of the 2D rotary table.

Shapes: B prompts, R rows, T new tokens, C caption slots, D width, V image vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import torch
from torch import Tensor

from models.kv_cache import KVCache
from models.target import Conditioning, DecoderTarget, ImageGeometry, SamplingDefaults, TargetOutput
from models.toy.model import ToyTextToImage
from models.toy.vq import PatchVQ

ASSETS = Path(__file__).resolve().parent / "assets"
# CFG 1.5 is where held-out prompt fidelity peaks (MODEL_CARD.md); top-k 256 of 4096 codes keeps about
# the share of the vocabulary that LlamaGen's top-k 1000 of 16384 keeps.
TOY_SAMPLING = SamplingDefaults(cfg_scale=1.5, temperature=1.0, top_k=256, top_p=None)


class ToyTarget(DecoderTarget):
    """The embedded toy text-to-image target."""

    family = "llamagen"
    default_static_tree = "toy_demo_fit_8"  # fitted to the demo drafter on a 2-core CPU (inference.decoding.tree)

    def __init__(self, network: ToyTextToImage, vq: PatchVQ, name: str = "toy",
                 sampling: SamplingDefaults = TOY_SAMPLING) -> None:  # fmt: skip
        gpt_config = network.gpt.config
        if vq.num_codes != gpt_config.vocab_size or vq.grid != (gpt_config.grid_size, gpt_config.grid_size):
            raise ValueError(
                f"VQ ({vq.num_codes} codes, grid {vq.grid}) does not match the GPT "
                f"(vocab {gpt_config.vocab_size}, grid {gpt_config.grid_size})"
            )
        self.network = network.eval().requires_grad_(False)
        self.vq = vq
        self.name = name
        self.sampling = sampling
        self.geometry = ImageGeometry(grid=vq.grid, image_size=(vq.image_size, vq.image_size))

    @classmethod
    def from_assets(cls, folder: str | Path = ASSETS, device: torch.device | str | None = None) -> ToyTarget:
        """Load the shipped (or a retrained) toy target from `toy_target.safetensors` + `toy_vq.safetensors`.

        device None = the CPU (the trainer passes its root device); the weights stay float32.
        """
        folder = Path(folder)
        for file in ("toy_target.safetensors", "toy_vq.safetensors"):
            if not (folder / file).exists():
                raise FileNotFoundError(
                    f"{folder / file} is missing; train it with `python -m models.toy.train --out {folder}`"
                )
        network = ToyTextToImage.load(folder / "toy_target.safetensors")
        target = cls(network, PatchVQ.load(folder / "toy_vq.safetensors"))
        return target if device is None else target.to(device)

    def to(self, device: torch.device | str) -> Self:
        """Move the caption encoder, the GPT (its rotary table included) and the VQ codebook to `device`."""
        self.network.to(device)
        self.vq.to(device)
        return self

    @property
    def hidden_size(self) -> int:
        return self.network.gpt.config.dim

    @property
    def num_layers(self) -> int:
        return self.network.gpt.config.num_layers

    @property
    def image_vocab_size(self) -> int:
        return self.network.gpt.config.vocab_size

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.network.gpt.config.aux_layer_ids or ())

    @property
    def prefix_length(self) -> int:
        return self.network.gpt.config.cls_token_num

    @torch.no_grad()
    def condition(self, prompts: list[str], cfg: bool = True) -> Conditioning:
        gpt = self.network.gpt
        features, valid = self.network.caption_features(prompts)  # (B, C, F), (B, C)
        if cfg:  # LlamaGen: uncond rows = the learned caption, masked like their conditional rows
            features = torch.cat([features, gpt.unconditional_captions(len(prompts))])
            valid = torch.cat([valid, valid])
        positions = torch.arange(self.prefix_length, device=features.device)
        return Conditioning(gpt.embed_captions(features), valid, positions, len(prompts), cfg)

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        return self.network.gpt.allocate_cache(rows, capacity)

    def run_decoder(self, inputs: Tensor, positions: Tensor, cache: KVCache | None, tree_mask: Tensor | None,
                    new_valid: Tensor | None, return_aux: bool,
                    logits_at: Tensor | None = None) -> TargetOutput:  # fmt: skip
        hidden, aux = self.network.gpt(inputs, positions, cache, tree_mask, new_valid, return_aux)
        return self.output(hidden, aux, logits_at)

    def image_positions(self, token_index: Tensor) -> Tensor:
        return token_index + self.prefix_length

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        return self.network.gpt.tok_embeddings(tokens)

    def latent_table(self) -> Tensor:
        """(V, P*P*3) the PatchVQ codebook (`vq.codebook`, a buffer): each code's mean RGB patch."""
        return self.vq.codebook

    def lm_embedding_table(self) -> Tensor:
        """(V, D) the GPT's input embedding table (`tok_embeddings.weight`): LM ids are the image codes."""
        return self.network.gpt.tok_embeddings.weight.detach()

    def image_head(self, hidden: Tensor) -> Tensor:
        return self.network.gpt.output(hidden)

    def image_head_weight(self) -> Tensor:
        return self.network.gpt.output.weight

    @torch.no_grad()
    def decode_images(self, tokens: Tensor) -> Tensor:
        return self.vq.decode(tokens.to(self.vq.codebook.device)).cpu()  # (B, H, W, 3) uint8 on the CPU
