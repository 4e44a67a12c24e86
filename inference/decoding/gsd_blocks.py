"""GSD-blocks, the CASCADE authors' tree port of GSD (dev commit 8dc3300; docs/method.md, section "The baselines, as
their authors' code runs them"), and its closed form for deterministic drafts.

The cluster of x is the block of G consecutive ranks of the current target distribution that holds x; x is accepted
w.p. min(1, p(C) / q(C)) (q(C) under the parent's q as drafted, as the port measures it), and a rejection zeroes the
block, then relu(p - q). Tested slot by slot, that is one sort of the vocabulary per slot (`GSDBlocksRule.test_slot`).
On deterministic drafts (q one-hot at x, so a rejection only zeroes the block) every slot is answered at once from one
sort of p (`walk_blocks`):

- Zeroing a block and renormalising keeps the order of the positive tokens left; the zeroed ones join the zeros,
  which a stable descending sort orders by token id. A rejection of a positive x zeroes a whole rank chunk
  [kG, kG + G) of p's order, so the positive tokens left still fall into p's own chunks: x's block under p_c is
  x's chunk of p, unless an earlier sibling's rejection took that chunk.
- Only the partial chunk (the last one holding positive tokens, P mod G of them, P the number of positive tokens)
  shares its block with zeros. An x that is 0 under p_c ranks P_c + (the zeros of p_c with a smaller id), P_c the
  positive tokens left; its block holds positive mass only when that rank falls in the partial chunk's block, and
  its rejection then zeroes the partial chunk.
- Where no positive token is left, the next slot sees the uniform fallback (`normalise_or_uniform`); from there on the
  same holds with the uniform distribution, ordered by id, in the place of p (a second phase, `Ranking.uniform`).

The slot loop renormalises after each rejection: a rounding that made two adjacent probabilities equal would order
them by id there and by p here (as for GSD's closed form, `GSDRule.acceptance_at_once`).

Shapes: B rows, I parent nodes, K child slots, V vocabulary, G the block size, C = V // G + 1 rank chunks (the last
may be partial or empty), and the chunk tables hold one more, past the vocabulary (0 mass): C + 1 columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from inference.decoding.rule_inputs import (
    SlotInputs,
    SlotTest,
    TreeInputs,
    descending_ranks,
    exact_residual,
    normalise_or_uniform,
)
from inference.decoding.tree import node_range, strictly_lower


@dataclass(frozen=True, kw_only=True, eq=False)
class GSDBlocksRule:
    """The CASCADE authors' tree port of GSD (dev commit 8dc3300, `models/ea2_model_llamagen.py`,
    `evaluate_posterior_v1`; docs/method.md, section "The baselines, as their authors' code runs them"): rank-block
    clusters.

    The cluster of x is the block of G consecutive ranks of the current target distribution p_c holding x;
    accept w.p. min(1, p_c(C) / q(C)); on rejection the block is zeroed, then relu(p_c - q_c), q_c the
    distribution x was drawn from (the parent's q without the earlier siblings' tokens). q(C) is the
    block's mass under the parent's q as drafted, for every sibling, as the port computes it
    (`proposal_mass="parent"`), or under q_c (`"draw"`: the mass of the distribution x was actually drawn
    from, which recursive rejection sampling would use; the earlier siblings' tokens then count 0). On
    deterministic drafts the proposal is one-hot at x and q(C) = 1 either way. `test_slot` answers one
    slot (one sort of p_c); `own_chain` every slot of a step.
    """

    group: int = 25
    proposal_mass: str = "parent"
    """Where q(C) is measured on sampled drafts: "parent" (the port: the parent's q as drafted) or "draw" (q_c)."""
    name: str = "gsd-blocks"

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"gsd-blocks group (cluster size G) must be >= 1, got {self.group}")
        if self.proposal_mass not in ("parent", "draw"):
            raise ValueError(
                f"gsd-blocks proposal_mass must be 'parent' (the port's q(C)) or 'draw' (q_c's), "
                f"got {self.proposal_mass!r}"
            )

    def prepare(self, inputs: TreeInputs) -> Any:
        return None

    def _cluster(self, slot: SlotInputs) -> Tensor:
        _, ranks = descending_ranks(slot.p)
        block = ranks // self.group
        return block == block.gather(2, slot.x_column)  # (B, I, V)

    def test_slot(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> SlotTest:
        cluster = self._cluster(slot)
        mass = (slot.p * cluster).sum(-1)
        residual = exact_residual(slot.p.masked_fill(cluster, 0.0), slot.x_column, slot.q_draw)
        if slot.q_draw is None:  # q(C) = 1; `verify` clamps a0 to 1
            return SlotTest(mass, None, residual)
        proposal = (self._proposal(inputs, slot.q_draw) * cluster).sum(-1)
        return SlotTest(mass / proposal.clamp_min(1e-30), None, residual)

    def _proposal(self, inputs: TreeInputs, q_draw: Tensor) -> Tensor:
        """The distribution q(C) is measured under: the parent's q (B, I, V) or q_draw (B, I, V) itself; for q_draw
        with a K axis, (B, I, 1, V) or q_draw (B, I, K, V)."""
        if self.proposal_mass == "draw":
            return q_draw
        if inputs.q_parent is None:
            raise ValueError("gsd-blocks on sampled drafts needs the parent's q (TreeInputs.q_parent, prepare_tree)")
        return inputs.q_parent if q_draw.dim() == inputs.q_parent.dim() else inputs.q_parent[:, :, None]

    def greedy_mass(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> Tensor:
        return (slot.p * self._cluster(slot)).sum(-1)

    def own_chain(
        self, inputs: TreeInputs, state: Any, draws: Tensor | None, q_x: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """Every slot at once: a0 (B, I, K) and the residual after every tested child (B, I, V). Deterministic drafts
        (draws None): from one sort of p (`block_slots`; None where it does not apply, and the slot loop tests).
        Sampled drafts: `sampled_chain`."""
        if draws is None:
            answer = block_slots(inputs, self.group)
            return None if answer is None else answer[:2]
        return self.sampled_chain(inputs, draws)

    def sampled_chain(self, inputs: TreeInputs, draws: Tensor) -> tuple[Tensor, Tensor]:
        """Every slot of sampled drafts: the chain of residual targets first (each rejection zeroes x's rank block of
        p_c, then relu(p_c - q_c), renormalised: zeroing the block can leave nothing, and then the next slot sees the
        uniform fallback, as in the slot loop), then p_c(C) / q(C) of every slot at once. Untested slots come after the
        tested ones: the residual is read off the chain after the last tested slot, not kept by a product a slot.
        draws (B, I, K, V) each slot's q_c, 0 on untested slots (q(C) replaces q_c(x)) -> a0 (B, I, K), residual
        (B, I, V)."""
        tokens = inputs.kid_tokens[..., None].unbind(2)  # K x (B, I, 1)
        p = inputs.probs  # (B, I, V) p_0, normalised
        targets, clusters = [p], []
        for c, q_c in enumerate(draws.unbind(2)):
            if c:
                p = normalise_or_uniform(p)
                targets.append(p)
            block = descending_ranks(p)[1] // self.group  # (B, I, V)
            cluster = block == block.gather(2, tokens[c])  # (B, I, V) x's rank block
            clusters.append(cluster)
            p = torch.sub(p.masked_fill(cluster, 0.0), q_c).relu_()
        targets.append(normalise_or_uniform(p))
        chain = torch.stack(targets, 2)  # (B, I, K + 1, V): p_0 .. p_K
        cluster_all = torch.stack(clusters, 2)  # (B, I, K, V)
        mass = (chain[:, :, :-1] * cluster_all).sum(-1)  # (B, I, K)
        proposal = (self._proposal(inputs, draws) * cluster_all).sum(-1)
        last = inputs.usable.sum(-1)[..., None, None].expand(-1, -1, 1, p.shape[-1])  # (B, I, 1, V) tested slots
        return mass / proposal.clamp_min(1e-30), chain.gather(2, last)[:, :, 0]


@dataclass
class Ranking:
    """A distribution's rank chunks of G tokens at every parent node: from one stable descending sort of p, or, for
    the uniform fallback, from the token ids (`by_id`: its order, so no gather through it)."""

    base: Tensor  # (B, I, V) the distribution: p, or the uniform fallback
    order: Tensor  # (B, I, V) tokens, most likely first; zeros by id
    chunk_of: Tensor  # (B, I, V) int64 each token's rank chunk: its place in `order`, // G
    positive: Tensor  # (B, I, 1) int64 how many tokens are positive (P)
    tail: Tensor  # (B, I, 1) int64 the partial chunk, P // G (an empty one where G divides P)
    tail_size: Tensor  # (B, I, 1) int64 its positive tokens, P mod G
    chunk_mass: Tensor  # (B, I, C + 1) the mass of each rank chunk [kG, kG + G); 0 past the vocabulary
    zero_counts: Tensor | None  # (B, I, V) int64 the zeros with an id up to each token's; None for the uniform
    by_id: bool = False  # the order is the token ids

    @classmethod
    def of(cls, p: Tensor, group: int) -> Ranking:
        """p (B, I, V) normalised: one sort."""
        vocab = p.shape[-1]
        ranked, order = p.sort(dim=-1, descending=True, stable=True)  # (B, I, V) each: p, most likely first
        chunk_of = torch.empty_like(order).scatter_(
            2, order, _uniform_tables(vocab, group, p.dtype, p.device)[2].expand_as(order)
        )
        padded = torch.nn.functional.pad(ranked, (0, (vocab // group + 2) * group - vocab))
        chunk_mass = padded.view(*p.shape[:2], -1, group).sum(-1)  # (B, I, C + 1)
        positive = (ranked > 0).sum(-1, keepdim=True)
        tail = positive // group
        return cls(p, order, chunk_of, positive, tail, positive - tail * group, chunk_mass, (p == 0).cumsum(-1))

    @classmethod
    def uniform(cls, like: Tensor, group: int) -> Ranking:
        """The uniform fallback over V, with the shape (B, I, V), dtype and device of `like`: expanded constants."""
        shape = like.shape
        uniform, ids, chunk_of, counts, chunk_mass = _uniform_tables(shape[-1], group, like.dtype, like.device)
        positive, tail, tail_size = (count.expand(*shape[:2], 1) for count in counts.unbind(-1))
        return cls(
            uniform.expand(shape), ids.expand(shape), chunk_of.expand(shape), positive, tail, tail_size,
            chunk_mass.expand(*shape[:2], -1), None, by_id=True,
        )  # fmt: skip


@functools.lru_cache(maxsize=8)
def _uniform_tables(vocab: int, group: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """The uniform distribution's (1, 1, V) values, ids and their rank chunks (id // G, also the chunk of each place of
    any order), its (1, 1, 1, 3) positive count, partial chunk and that chunk's size, and its (1, 1, C + 1) chunk
    masses; shared constants, never written to."""
    uniform = torch.full((1, 1, vocab), 1.0 / vocab, dtype=dtype, device=device)
    ids, chunks = node_range(vocab, device).view(1, 1, -1), vocab // group + 2
    sizes = (vocab - node_range(chunks, device) * group).clamp(0, group)  # (C + 1,) tokens in each chunk
    counts = torch.tensor([vocab, vocab // group, vocab % group], device=device).view(1, 1, 1, 3)
    return uniform, ids, ids // group, counts, (sizes.to(dtype) / vocab).view(1, 1, -1)


@dataclass
class BlockWalk:
    """Every slot's test of deterministic drafts in one phase (`walk_blocks`), under that phase's base distribution."""

    mass: Tensor  # (B, I, K) the base's mass in x's block under p_c, on tested slots (what its rejection removes)
    mass_left: Tensor  # (B, I, K) p_c's normaliser: the base's mass that no earlier tested slot removed
    removed_count: Tensor  # (B, I, K) int64: the base's positive tokens each tested slot's rejection removes
    kept: Tensor  # (B, I, V) the base with every tested slot's block at 0 (the residual after them, unnormalised)
    partial_taken: Tensor  # (B, I, K) bool: x was 0 under p_c and its block held the partial chunk


@functools.lru_cache(maxsize=8)
def _not_before(width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(K, K) [c', c]: 1 where slot c' is slot c or a later one, else 0; a shared constant, never written to."""
    return strictly_lower(width, device).T.logical_not().to(dtype)


def walk_blocks(ranking: Ranking, tokens: Tensor, tested: Tensor, group: int) -> BlockWalk:
    """Every slot of deterministic drafts under GSD-blocks while p_c keeps a positive token: each slot's block mass
    and normaliser, as if the earlier tested slots were rejected (the module docstring says why p's rank chunks
    give them). tokens (B, I, K), tested (B, I, K) bool: the slots tested in this phase."""
    width, offsets = tokens.shape[-1], node_range(group, tokens.device)
    earlier = strictly_lower(width, tokens.device)  # (K, K) [c, c']: c' before c
    tail, tail_size = ranking.tail, ranking.tail_size  # (B, I, 1) each
    own = ranking.chunk_of.gather(2, tokens)  # (B, I, K) x's chunk of the base's order
    at = own[..., None] * group + offsets  # (B, I, K, G) the ranks in each slot's chunk
    # [c, c'] how many positive tokens of slot c''s chunk have a smaller id than x_c
    if ranking.by_id:  # every token is positive; ranks past the vocabulary are ids above every x
        below = (at[:, :, None] < tokens[..., None, None]).sum(-1)  # (B, I, K, K)
        positive_x, removing = None, tested  # every x is positive; a rejection removes its chunk
    else:
        vocab = ranking.order.shape[-1]
        members = ranking.order.gather(2, at.flatten(2).clamp_max(vocab - 1)).view_as(at)  # (B, I, K, G)
        counted = (at < ranking.positive[..., None])[:, :, None]  # (B, I, 1, K, G)
        below = ((members[:, :, None] < tokens[..., None, None]) & counted).sum(-1)
        positive_x = ranking.base.gather(2, tokens) > 0  # (B, I, K) x is positive under the base
        removing = positive_x & tested  # a positive x, whose rejection removes its chunk
    same = (own[..., None] == own[:, :, None, :]) & removing[:, :, None, :] & earlier  # (B, I, K, K) [c, c']
    # the chunk goes with this slot, not with an earlier sibling's (on bools a > b is a and not b); but see the
    # partial chunk below
    first = removing > same.any(-1)
    size = torch.where(own < tail, group, tail_size)  # (B, I, K) positive tokens in x's chunk
    # as if no zero x had taken the partial chunk before slot c: the positive tokens left, and x's rank if it is 0
    removed_by = first[:, :, None, :] & earlier  # (B, I, K, K) [c, c']: c' removed its chunk before c
    left = ranking.positive - (size[:, :, None, :] * removed_by).sum(-1)  # (B, I, K) P_c
    zero_rank = left + (below * removed_by).sum(-1)  # + the removed positive tokens with a smaller id
    # + the base's own zeros with a smaller id (the count at x includes x where x is one of them)
    if ranking.zero_counts is not None and positive_x is not None:  # both None only for the uniform (mypy: both)
        zero_rank = zero_rank + ranking.zero_counts.gather(2, tokens) + positive_x - 1
    # x is 0 under p_c (tested, not first; as if no zero x had taken the partial chunk yet) and its block starts
    # before p_c's positive tokens end
    hit = (tested > first) & (zero_rank // group * group < left)  # (B, I, K)
    # the first such x takes the partial chunk; after it, the partial chunk is gone, and no x can hit it again
    partial_gone = (hit[:, :, None, :] & earlier).any(-1)  # (B, I, K)
    first = first > ((own == tail) & partial_gone)
    hit = hit > partial_gone
    chunk_at = ranking.chunk_mass.gather(2, torch.cat([own, tail], -1))  # (B, I, K + 1): x's chunk, the partial one
    mass = chunk_at[..., :width] * first + chunk_at[..., width:] * hit  # (B, I, K)
    removed_count = size * first + tail_size * hit
    chunks = ranking.chunk_mass.shape[-1]
    gone_ids = torch.where(first, own, torch.where(hit, tail, chunks - 1))  # the last chunk holds nothing
    gone = torch.zeros_like(ranking.chunk_mass, dtype=torch.bool).scatter_(2, gone_ids, True)  # (B, I, C + 1)
    kept = ranking.base.masked_fill(gone.gather(2, ranking.chunk_of), 0.0)  # (B, I, V)
    # what no tested slot removed, plus what the slots from c on remove: no subtraction loses a small remainder
    mass_left = kept.sum(-1, keepdim=True) + mass @ _not_before(width, mass.dtype, tokens.device)
    return BlockWalk(mass, mass_left, removed_count, kept, hit)


def block_slots(inputs: TreeInputs, group: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """GSD-blocks on deterministic drafts, every slot at once: a0 (B, I, K) (any value on untested slots), the residual
    after every tested child (B, I, V), and which slots see the uniform fallback (B, I, K) bool. One sort of p, not
    one per slot. None where the uniform phase could itself run out of tokens ((K - 1) G >= V): the slot loop tests
    those."""
    p, tokens, tested = inputs.probs, inputs.kid_tokens, inputs.usable
    if (tokens.shape[-1] - 1) * group >= p.shape[-1]:
        return None
    ranking = Ranking.of(p, group)
    walk = walk_blocks(ranking, tokens, tested, group)
    # no positive token left before slot c: p_c is the uniform fallback, and a second phase starts from it
    fallback = walk.removed_count.cumsum(-1) - walk.removed_count >= ranking.positive  # (B, I, K)
    fallback_walk = walk_blocks(Ranking.uniform(p, group), tokens, tested & fallback, group)
    mass = torch.where(fallback, fallback_walk.mass, walk.mass)
    # 0 / 0 only on the first phase's slots past its last positive token, which the fallback walk answers
    a0 = (mass / torch.where(fallback, fallback_walk.mass_left, walk.mass_left)).nan_to_num_(0.0)
    kept = torch.where((tested & fallback).any(-1, keepdim=True), fallback_walk.kept, walk.kept)
    return a0, normalise_or_uniform(kept), fallback
