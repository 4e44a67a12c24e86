"""A trained EAGLE-1/EAGLE-3 draft head, wired to its target, as a tree-decoder `Drafter`.

    drafter = EagleDrafter.from_pretrained("runs/demo/drafter", target)
    result = generate_speculative(target, drafter, prompts, CascadeRule())

The drafter attends only to image elements, exactly as it was trained on extracted features: the
caption reaches it through the target features (row 0 is the last prefix slot's state), so
`prefill` adds nothing to its cache.

Shapes: R rows, T new elements, S cache columns, H drafter hidden size, Df feature width, V image vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from inference.drafter import DraftOutput, build_draft_attention_mask
from models.eagle import EagleDraftModel
from models.kv_cache import KVCache
from models.target import Conditioning, ImageTarget, TargetOutput


def check_compatible(model: EagleDraftModel, target: ImageTarget) -> None:
    """Refuse a drafter whose shapes do not fit `target`, naming the field and both values."""
    config = model.config
    problems = []
    if config.vocab_size != target.image_vocab_size:
        problems.append(f"vocab_size {config.vocab_size} vs the target's image vocabulary {target.image_vocab_size}")
    if config.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {config.target_hidden_size} vs the target's hidden size {target.hidden_size}"
        )
    if config.architecture == "eagle3" and config.num_aux_layers != len(target.aux_layer_ids):
        problems.append(
            f"num_aux_layers {config.num_aux_layers} vs the target's {len(target.aux_layer_ids)} aux layers"
        )
    if problems:
        raise ValueError(
            f"drafter built for target {config.target!r} does not fit {target.name!r}: " + "; ".join(problems)
        )


class EagleDrafter:
    """`inference.drafter.Drafter` over an `EagleDraftModel` and the target's frozen embedding and head."""

    def __init__(self, model: EagleDraftModel, target: ImageTarget) -> None:
        check_compatible(model, target)
        self.model = model.eval()
        self.target = target
        self.feature_source = "hidden" if model.config.architecture == "eagle1" else "aux"

    @classmethod
    def from_pretrained(cls, folder: str | Path, target: ImageTarget) -> EagleDrafter:
        """Load a drafter folder (config.json + model.safetensors) onto the target's device."""
        return cls(EagleDraftModel.from_pretrained(folder, map_location=target.device), target)

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        config = self.model.config
        weight = self.model.fc.weight
        return KVCache.allocate(1, rows, config.kv_heads, capacity, config.head_dim, weight.dtype, weight.device)

    def prefill(self, conditioning: Conditioning, target_prefix: TargetOutput, cache: KVCache) -> None:
        """Nothing to do: the drafter's context is image elements only (see the module docstring)."""

    @torch.no_grad()
    def forward(
        self,
        features: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        *,
        from_target: bool,
        valid: Tensor | None = None,
        tree_start: int | None = None,
        tree_mask: Tensor | None = None,
    ) -> DraftOutput:
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        mask = build_draft_attention_mask(cache, valid, tree_start, tree_mask)  # (R, T, S)
        hidden, _, _ = self.model(
            self.target.embed_image_tokens(tokens), features, positions, mask, from_target=from_target, cache=cache
        )
        cache.advance(valid)
        logits = self.model.to_image_vocab(self.model.draft_logits(hidden, self.image_head))  # (R, T, V)
        return DraftOutput(logits.float(), hidden)

    def image_head(self, hidden: Tensor) -> Tensor:
        weight = self.target.image_head_weight()
        return self.target.image_head(hidden.to(weight.dtype))
