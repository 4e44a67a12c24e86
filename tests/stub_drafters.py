"""Stub drafters for the decoder tests: no training needed (`FixedLogitsDrafter`, `OracleDrafter`)."""

from __future__ import annotations

import torch
from torch import Tensor

from inference.decoding.drafter import DraftOutput
from models.kv_cache import KVCache
from models.target import Conditioning, ImageTarget, TargetOutput


class FixedLogitsDrafter:
    """Proposes the same logits (V,) everywhere, whatever the context (put them on the decoding device)."""

    feature_source = "hidden"

    def __init__(self, logits: Tensor) -> None:
        self.logits = logits

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        return KVCache.allocate(1, rows, 1, capacity, 1, device=self.logits.device)  # only counts columns

    def prefill(self, conditioning: Conditioning, target_prefix: TargetOutput, cache: KVCache) -> None:
        cache.advance(conditioning.valid)

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
        logits_at: Tensor | None = None,
        cfg_scale: float | None = None,
        attention_mask: Tensor | None = None,
    ) -> DraftOutput:
        rows, length = tokens.shape
        cache.advance(valid if valid is not None else torch.ones_like(tokens, dtype=torch.bool))
        logits = self.logits.to(features.device).expand(rows, 1 if logits_at is not None else length, -1)
        return DraftOutput(logits, torch.zeros(rows, length, 1, device=features.device))  # never guided


class OracleDrafter:
    """Drafts with the target itself: with scale 1, q equals the target's distribution at every node.

    `scale` multiplies the target logits: -1 proposes the target's least likely tokens first (an
    always-wrong drafter), other values give an imperfect but informed drafter. With `wrong_every`
    = m > 0 the logits are negated where the predicted image index i has i % m == m - 1, so greedy
    drafting is right up to such an index and wrong there. Draft-tree levels are recomputed over
    all draft columns (the target's forward only masks among new tokens), fine for a test stub.
    """

    feature_source = "hidden"

    def __init__(self, target: ImageTarget, scale: float = 1.0, wrong_every: int = 0) -> None:
        self.target = target
        self.scale = scale
        self.wrong_every = wrong_every
        self._draft: tuple[Tensor, Tensor, Tensor] | None = None  # tokens, positions, mask since tree_start

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        return self.target.allocate_cache(rows, capacity)

    def prefill(self, conditioning: Conditioning, target_prefix: TargetOutput, cache: KVCache) -> None:
        self.target.prefill(conditioning, cache)

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
        logits_at: Tensor | None = None,
        cfg_scale: float | None = None,
        attention_mask: Tensor | None = None,
    ) -> DraftOutput:
        rows, length = tokens.shape
        if tree_start is None:
            start = cache.length
            out = self.target.forward(tokens, positions, cache)
            if valid is not None:
                cache.column_valid[:, start : start + length] = valid
        else:
            if cache.length == tree_start:
                self._draft = None
            if tree_mask is None:
                raise ValueError("OracleDrafter needs a tree_mask while drafting a tree")
            if self._draft is not None:
                old_tokens, old_positions, old_mask = self._draft  # (R, J), (R, J), (R, J, J)
                pad = torch.zeros(rows, old_mask.shape[1], length, dtype=torch.bool, device=tokens.device)
                tokens = torch.cat([old_tokens, tokens], 1)
                positions = torch.cat([old_positions, positions], 1)
                tree_mask = torch.cat([torch.cat([old_mask, pad], 2), tree_mask], 1)  # (R, J + T, J + T)
            self._draft = (tokens, positions, tree_mask)
            cache.truncate(tree_start)
            out = self.target.forward(tokens, positions, cache, tree_mask)
        logits, hidden = out.logits[:, -length:] * self.scale, out.hidden[:, -length:]
        if self.wrong_every:
            predicted = positions[:, -length:] - self.target.image_positions(torch.zeros_like(positions[:, :1])) + 1
            wrong = predicted % self.wrong_every == self.wrong_every - 1  # (R, T)
            logits = torch.where(wrong[..., None], -logits, logits)
        if logits_at is not None:
            logits = logits[torch.arange(rows, device=logits.device), logits_at][:, None]  # (R, 1, V)
        return DraftOutput(logits, hidden)  # raw: the decoder applies CFG
