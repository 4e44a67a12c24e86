"""What the tree decoder needs from a drafter and how it drafts a tree with one (test stubs: tests/stub_drafters.py).

A drafter is an EAGLE-style model with its own KV cache. It reads pairs (feature, token): the
feature is the state that predicted `token` and its output at that element predicts the token after
`token` (docs/method.md, section "Drafting a tree"). Features come from the target after a verification step and from
the drafter itself deeper in a draft tree:

- EAGLE-1 (`feature_source = "hidden"`): target last-layer post-norm hidden (R, T, D); deeper tree
  levels feed back the drafter's own predicted features.
- EAGLE-3 (`feature_source = "aux"`): the target's low/mid/high streams `aux` (R, T, 3D), fused by the
  drafter's fc; deeper levels feed back the drafter's own hidden (no fc): `from_target=False`.

The drafter runs every CFG row ([cond; uncond]) and returns raw logits, or, given `cfg_scale` and a
linear head of its own, logits already combined by CFG (`DraftOutput.guided`); the decoder applies the
rest of the target's processing (CFG if not done, the target's `constrain_logits` at the image index
each element predicts, temperature, top-k, top-p) to them (docs/method.md, section "Drafting a tree").

Cache protocol: pairs with `from_target=True` are committed context. While drafting a tree the
decoder notes `tree_start = cache.length`, calls the drafter once per level with `tree_start` and
`tree_mask` (which draft columns, from `tree_start` on, each new element may attend to), then
truncates the cache back to `tree_start`. `build_draft_attention_mask` turns this into a full mask;
on a static tree the decoder builds that mask once per tree, as an additive bias, and passes each
level its slice as `attention_mask`, which a drafter may use instead.

The processed distribution q of a drafter output is a `Proposal`: under top-k its k probabilities and
token ids, drawn from as they are and written over the vocabulary only for the tree's `q_full`.

Shapes: B prompts, R rows (2B with CFG), T new elements, J draft columns cached since tree_start,
S cache columns, D hidden size, Df feature width, V vocabulary, K top-k, N tree nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from inference.decoding.sampling import Proposal, proposal_distribution
from models.kv_cache import KVCache
from models.target import Conditioning, ImageTarget, SamplingDefaults, TargetOutput


@dataclass
class DraftOutput:
    logits: Tensor  # (R, T', V) raw drafter logits before CFG, or (B, T', V) already guided when `guided`;
    # T' = T, or 1 with `logits_at`
    hidden: Tensor  # (R, T, D) the drafter's own features, fed to the next tree level
    guided: bool = False  # the drafter applied the CFG it was given (`cfg_scale`) before its head


class Drafter(Protocol):
    """An EAGLE-1/EAGLE-3 style drafter that owns its KV cache."""

    feature_source: str  # "hidden" (EAGLE-1) or "aux" (EAGLE-3): which target output feeds `forward`

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        """An empty cache for `rows` rows of up to `capacity` elements."""

    def prefill(self, conditioning: Conditioning, target_prefix: TargetOutput, cache: KVCache) -> None:
        """Consume the prompt prefix (the target's prefill outputs over it). No image token yet."""

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
        position_encoding: Any = None,
    ) -> DraftOutput:
        """Run T (feature, token) pairs, appending them to `cache`.

        Args:
            features: (R, T, Df) target hidden/aux (`from_target`) or the drafter's own hidden.
            tokens: (R, T) image tokens; positions: (R, T) their target position ids.
            valid: (R, T) bool, False for padding (written but never attended to); None = all valid.
            tree_start, tree_mask: while drafting a tree, (R, T, cache.length - tree_start + T) bool
                over the draft columns, each element's ancestors and itself (the tree decoder's masks
                are ancestor-or-self); None = causal over the new elements.
            logits_at: (R,) the one element per row whose logits are wanted (the last one read before a
                tree); None = every element.
            cfg_scale: the CFG scale of [cond; uncond] rows. A drafter whose head is linear may combine
                the rows before it (half the rows through the head) and return `guided` logits (B, T', V);
                otherwise it ignores it and the decoder applies CFG.
            attention_mask: (R, T, cache.length + T), the whole mask that `tree_start` and `tree_mask`
                describe (`tree_attention_mask`), when the decoder has it, as the additive bias attention
                adds (`attention_bias`: 0 or -inf, in the cache's dtype): a static tree's is built once
                per tree and each level passes a slice. A drafter may use it instead of building its own;
                one that always does when given it says so with a class attribute `reads_attention_mask = True`,
                and the decoder then passes tree_mask=None where it passes `attention_mask` (a dynamic tree's
                levels need not derive it: a slice and a compare a level).
            position_encoding: one entry of `position_encodings(positions)`, which a drafter may define: what
                its layers derive from a position (rotary cos and sin), computed once per tree for every
                level and passed to a level whose elements all sit at that position. Passed only to a
                drafter that defines `position_encodings`; None = derive it from `positions`.
        """


def build_draft_attention_mask(
    cache: KVCache, new_valid: Tensor, tree_start: int | None = None, tree_mask: Tensor | None = None
) -> Tensor:
    """Full attention mask of T new elements over S = cache.length + T columns, for drafter implementations.

    Columns before `tree_start` follow `cache.column_valid`; later columns follow `tree_mask`
    (causal when None); every element attends to itself. Returns (R, T, S) bool.
    """
    rows, length = new_valid.shape
    device = new_valid.device
    if tree_start is None and tree_mask is None:  # a causal run after the cache (the accepted path): 8 ops, not 17
        # element i sees the valid elements j <= i and itself: tril(valid_j or i == j)
        own = (torch.eye(length, dtype=torch.bool, device=device) | new_valid[:, None, :]).tril()  # (R, T, T)
        context = cache.column_valid[:, None, : cache.length].expand(rows, length, -1)  # (R, T, S - T)
        return torch.cat([context, own], dim=-1)
    start = cache.length if tree_start is None else tree_start
    if tree_mask is None:
        tree_mask = torch.ones(length, cache.length - start + length, dtype=torch.bool, device=device)
        tree_mask = tree_mask.tril(cache.length - start)
    tree_mask = tree_mask.expand(rows, length, -1)
    valid = torch.cat([cache.column_valid[:, start : cache.length], new_valid], dim=1)  # (R, J + T)
    eye = torch.zeros_like(tree_mask)
    eye[:, :, cache.length - start :] = torch.eye(length, dtype=torch.bool, device=device)
    context = cache.column_valid[:, None, :start].expand(rows, length, start)  # (R, T, start)
    return torch.cat([context, (tree_mask & valid[:, None, :]) | eye], dim=-1)


def tree_attention_mask(cache: KVCache, tree_start: int, tree_mask: Tensor) -> Tensor:
    """`build_draft_attention_mask` for a tree level whose T new elements are all valid and whose
    `tree_mask` (R, T, cache.length - tree_start + T) already lets each element see itself (an
    ancestor-or-self mask): the committed columns' validity, then the tree mask. -> (R, T, S) bool."""
    rows, length = tree_mask.shape[:2]
    context = cache.column_valid[:, None, :tree_start].expand(rows, length, tree_start)  # (R, T, start)
    return torch.cat([context, tree_mask], dim=-1)


def attention_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool attention mask as the additive bias scaled-dot-product attention makes of it: 0 where allowed,
    -inf elsewhere, in the attention's dtype (the drafter's, which its cache has). Built once per tree, it
    spares each drafter call the conversion (three kernels). (...) bool -> (...) `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def to_rows(x: Tensor, cfg: bool) -> Tensor:
    """Per-prompt (B, ...) -> per-row (R, ...): the conditional and unconditional rows share tokens."""
    return torch.cat([x, x]) if cfg else x


@dataclass
class DraftContext:
    """Everything tree drafting needs for one verification step."""

    drafter: Drafter
    cache: KVCache
    target: ImageTarget
    settings: SamplingDefaults
    cfg: bool
    root_index: Tensor  # (B,) image-token index of the root
    max_depth: int  # deepest draft level of the tree
    forwards: int = 0  # drafter calls made while drafting this tree

    def __post_init__(self) -> None:
        # image index of every level, built once per step: level d's nodes sit at root + d, and their
        # outputs predict root + d + 1 (past the end: never accepted, any position does)
        steps = torch.arange(self.max_depth + 2, device=self.root_index.device)
        index = (self.root_index[:, None] + steps).clamp_max(self.target.geometry.num_tokens - 1)  # (B, D + 2)
        positions = to_rows(self.target.image_positions(index), self.cfg)  # (R, D + 2)
        # each level's column as a view, split off once per step rather than sliced per drafter call
        self.level_index = index.split(1, dim=1)  # D + 2 of (B, 1)
        self.level_positions = positions.split(1, dim=1)  # D + 2 of (R, 1)
        # and what the drafter's layers derive from them (its rotary tables), for all levels at once
        encode = getattr(self.drafter, "position_encodings", None)
        self.level_encodings: list[Any] | None = None if encode is None else encode(positions)

    def run_level(
        self,
        parent_hidden: Tensor,
        tokens: Tensor,
        depth: int,
        tree_start: int,
        tree_mask: Tensor | None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Proposal, Tensor]:
        """One drafter call over the W nodes of one level. parent_hidden (R, W, D), tokens (B, W),
        tree_mask (W, J + W) shared by every row, (B, W, J + W) per prompt or (R, W, J + W) per row, None with
        `attention_mask` for a drafter that reads it (`wants_tree_mask`), attention_mask (R, W, S) or None
        (`Drafter.forward`) -> q (B, W, V) as a `Proposal`, hidden (R, W, D)."""
        rows, width = parent_hidden.shape[:2]
        if tree_mask is None and attention_mask is None:
            raise ValueError("a tree level needs its tree_mask, or the attention_mask for a drafter that reads it")
        if tree_mask is not None and tree_mask.dim() == 2:
            tree_mask = tree_mask.expand(rows, -1, -1)
        elif tree_mask is not None and tree_mask.shape[0] != rows:
            tree_mask = to_rows(tree_mask, self.cfg)
        positions = self.level_positions[depth]  # (R, 1): one level, one position
        predicted = self.level_index[depth + 1]  # (B, 1)
        out = self.drafter.forward(
            parent_hidden,
            to_rows(tokens, self.cfg),
            positions if width == 1 else positions.expand(rows, width),
            self.cache,
            from_target=False,
            tree_start=tree_start,
            tree_mask=tree_mask,
            cfg_scale=self.cfg_scale,
            attention_mask=attention_mask,
            **({} if self.level_encodings is None else {"position_encoding": self.level_encodings[depth]}),
        )
        self.forwards += 1
        return self.proposal(out, predicted if width == 1 else predicted.expand(tokens.shape)), out.hidden

    @property
    def wants_tree_mask(self) -> bool:
        """Whether a level given its attention mask must also get its tree mask: not for a drafter that reads the
        attention mask whenever given (`reads_attention_mask`, `Drafter.forward`)."""
        return not getattr(self.drafter, "reads_attention_mask", False)

    @property
    def cfg_scale(self) -> float | None:
        """The guidance a drafter may apply before its head (`Drafter.forward`), None without CFG."""
        return self.settings.cfg_scale if self.cfg else None

    def proposal(self, out: DraftOutput, predicted: Tensor) -> Proposal:
        """q (B, T, V) from a drafter output, guided by the drafter or here (under top-k: on its support)."""
        return proposal_distribution(out.logits, self.settings, self.cfg and not out.guided, self.target, predicted)
