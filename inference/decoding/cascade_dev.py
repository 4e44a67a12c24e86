"""cascade-dev: the CASCADE development code's acceptance rule, as that code runs it (commit 8c40c9c, the Lumina
file with `topK_generate`); `inference.decoding.peer_rules` re-exports it beside the other peers' rules.

Shapes: B rows, I parent nodes, K child slots, V vocabulary, N tree nodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.decoding.rule_inputs import (
    RemovalSlots,
    SlotInputs,
    SlotTest,
    TreeInputs,
    children_mass_above,
    exact_acceptance,
    exact_residual,
    pack_slots,
)
from inference.decoding.similarity import cosine
from inference.decoding.tree import Tree, strictly_lower


@dataclass
class CascadeDevState:
    """Per-slot inputs of the development rule, built once per verification step."""

    convergence: Tensor  # (B, I, K) s of the slot's parent and grandparent where s > sim_threshold, else 0
    partners: Tensor  # (B, I, K, N) float 0/1: the nodes whose tokens' p the slot's second test adds
    tokens: Tensor  # (B, N) every node's token

    @functools.cached_property
    def per_slot(self) -> list[tuple[Tensor, Tensor]]:
        """(convergence (B, I), partners (B, I, N)) of each slot: split once for the slot loop, not per slot."""
        return list(zip(self.convergence.unbind(2), self.partners.unbind(2), strict=True))


def at_node_tokens(p: Tensor, tokens: Tensor) -> Tensor:
    """p (B, ..., V) at every node's token (tokens (B, N)) -> (B, ..., N)."""
    index = tokens.view(tokens.shape[0], *(1,) * (p.dim() - 2), -1).expand(*p.shape[:-1], -1)
    return p.gather(-1, index)


def dev_pairs(tree: Tree, threshold: float, shifted: bool) -> Tensor:
    """(B, N, N) float 0/1 [x, y]: node y's token joins x's second test.

    The dev drafter (`topK_generate`) runs on the nodes with children only (its tree buffers hold those), and after
    each iteration pairs the distinct rows w, v of one depth whose distributions (q_full here; 0 at leaves, which
    have no row there either) have cosine > threshold. Unshifted ("level"), those are the pairs. Shifted ("code"),
    as the dev verifier reads them: testing depth d, it takes the pairs of depth d + 1's rows, numbered 0, 1, ...
    in node order, and adds the index of depth d's first node (`per_level_node_counts`), so row r lands on the node
    at position start(d) + r of the depth-major node order (a static tree's node ids are that order): w landing on
    a depth-d node x pairs x with the node v lands on, a node at depth d or deeper (the code does not check).
    """
    depths = tree.depths  # (B, N)
    drafted = tree.children[..., 0] >= 0  # (B, N) the node has children: the drafter has a row there
    similarity = cosine(tree.q_full, pairwise=True)  # (B, N, N)
    rise = depths[:, :, None] - depths[:, None, :]  # (B, N, N) [n, m]: how much deeper n is than m
    before = (rise == 0) & strictly_lower(tree.num_nodes, depths.device)  # m at n's depth, earlier in node order
    rows = drafted[:, :, None] & drafted[:, None, :] & (before | before.transpose(-1, -2))  # distinct, one depth
    pairs = ((similarity > threshold) & rows).float()  # (B, N, N) [w, v]
    if not shifted:
        return pairs
    position = (rise > 0).sum(-1) + before.sum(-1)  # (B, N) depth-major
    row = (before & drafted[:, None, :]).sum(-1)  # (B, N) rank among its depth's nodes with children
    read = (rise > 1).sum(-1) + row  # (B, N) the position row w is read at: nodes above depth d_w - 1, + its rank
    # (rows at depth 1 land on the root, never tested; a leaf's lands anywhere, but it has no pairs)
    onto = position[:, None, :] == read[:, :, None]  # (B, N, N) [w, n]
    as_x = (onto & (rise == 1)).float()  # x is tested at w's depth - 1 only
    return as_x.transpose(-1, -2) @ pairs @ onto.float()  # 0/1: distinct rows land on distinct nodes


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeDevRule:
    """The CASCADE development code's rule as that code runs it: selinyldrm/Deepseek-JanusPro-EAGLE, commit 8c40c9c
    ("final cascade"), `models/ea_model_lumina_mgpt.py` (`evaluate_posterior`) with the pairs of `topK_generate`
    in `models/drafters/cnets_lumina_mgpt.py` (docs/method.md, section "The baselines, as their authors' code runs
    them"). A comparison rule: not the method, no TV budget. `tests/reference_cascade_dev.py` transcribes the code;
    tests/test_peer_authors_code.py holds the two to the same decisions.

    Child x of node u (depth d) is tested with u plain first, u < p(x)/q(x) (p the current residual at u). If that
    fails and x is in the nucleus of mass `nucleus` of the current p (p(x) at least the p at which the sorted mass
    reaches it), a second test with the same uniform after p(x) += u * S, capped at q(x); together: accept w.p.
    min(1, p(x) / (q(x) - S)) (1 when S >= q(x)). S sums
    1. convergence: s = cosine of the softmaxed last-layer states at u and at u's parent (the states that predict
       x's slot and u's slot), when s > sim_threshold and d >= 2; one value for all of u's children;
    2. pairs ("code", the default): the code reads the pairs of the drafter's next iteration, off by one level.
       Its drafter forms pairs (w, v) among the nodes with children at depth d + 1 whose q have cosine >
       pair_threshold (cousins included), and the verifier adds the index of depth d's first node to their row
       numbers (`dev_pairs`): x takes the pair (w, v) when w's row lands on x, and adds p at the
       token of the node v's row lands on (a node at depth d, or deeper: the code does not check). The drafter
       computes q only at nodes with children (its tree buffers hold those), and our trees have q there: no
       leaf needs a distribution. Pairs exist at d <= max depth - 2 only.
       pairs="level" is the reading we take the code to intend, not its default: pairs among the nodes with
       children at x's own depth by their own q, x with children included (a leaf has no q, so no pairs).
    Pooled tokens stay in the residual, which is relu(p - q_c) (sampled drafts) or p without x (deterministic).
    Left out of the code: image-syntax and non-image tokens (every token here is an image token) and its unused
    KL term.
    """

    sim_threshold: float = 0.9
    pair_threshold: float = 0.5
    nucleus: float = 0.8
    pairs: str = "code"
    """Where the pairs come from: "code" (the next level's drafter rows, shifted: what the code does) or "level"."""
    name: str = "cascade-dev"

    def __post_init__(self) -> None:
        if self.pairs not in ("code", "level"):
            raise ValueError(f"CascadeDevRule.pairs must be 'code' or 'level', got {self.pairs!r}")

    def prepare(self, inputs: TreeInputs) -> CascadeDevState:
        if inputs.features is None:
            raise ValueError("cascade-dev needs TargetView.features (see speculative.build_target_view)")
        tree, tables = inputs.tree, inputs.tables
        rows = tables.rows[:, None]
        states = inputs.features.float().softmax(-1)  # (B, N, D) softmaxed last-layer states
        states = states / states.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        grand = inputs.at_parents(tree.parents).clamp_min(0)  # (B, I) each parent's parent (root: itself)
        s = (inputs.at_parents(states) * states[rows, grand]).sum(-1)  # (B, I) parent vs grandparent
        deep = inputs.at_parents(tree.depths) >= 1  # the children are at depth >= 2
        convergence = torch.where((s > self.sim_threshold) & deep, s, 0.0)[..., None] * inputs.usable  # (B, I, K)
        pairs = dev_pairs(tree, self.pair_threshold, shifted=self.pairs == "code")  # (B, N, N) [x, y]
        kid = tables.child_index.view_as(inputs.children)  # (B, I, K), padding at node 0
        partners = pairs[rows[..., None], kid]  # (B, I, K, N)
        return CascadeDevState(convergence, partners, tree.tokens)

    def test_slot(self, inputs: TreeInputs, state: CascadeDevState, slot: SlotInputs) -> SlotTest:
        return SlotTest(self._acceptance(inputs, state, slot), None, exact_residual(slot.p, slot.x_column, slot.q_draw))

    def acceptance_sampled(self, inputs: TreeInputs, state: CascadeDevState, slots: SlotInputs) -> tuple[Tensor, None]:
        """`test_slot`'s a0 for every slot of sampled drafts at once (`slots` with a K axis; the residual is the exact
        one), (B, I, K), None."""
        return self._acceptance(inputs, state, slots), None

    def _acceptance(self, inputs: TreeInputs, state: CascadeDevState, slot: SlotInputs) -> Tensor:
        """a0 (B, I), or (B, I, K) for `slot` with a K axis, or (B, J) for packed slots."""
        if slot.packed is not None:  # the tested slots only (`SlotInputs.packed`): (B, J), (B, J, N)
            convergence, partners = pack_slots(state.convergence, slot.packed), pack_slots(state.partners, slot.packed)
        elif slot.slot is None:  # every slot at once: (B, I, K), (B, I, K, N)
            convergence, partners = state.convergence, state.partners
        else:
            convergence, partners = state.per_slot[slot.slot]  # (B, I), (B, I, N)
        plain = exact_acceptance(slot)
        total = convergence + (at_node_tokens(slot.p, state.tokens) * partners).sum(-1)  # S
        # min(1, p(x) / (q(x) - S)), and 1 where S >= q(x): there p(x) / 0 is inf, or NaN for p(x) = 0, both -> 1
        second = (slot.p_x / (slot.q_x - total).clamp_min(0.0)).nan_to_num_(1.0).clamp_max(1.0)
        gate = (slot.p * (slot.p > slot.p_x[..., None])).sum(-1) < self.nucleus  # x in p's nucleus: less mass above it
        # with S > 0, q(x) - S < q(x) and the second test accepts at least as often as the plain one (both are
        # monotone in floating point too): the larger of the two is the second
        return torch.where(gate & (total > 0), second, plain)

    def greedy_mass(self, inputs: TreeInputs, state: CascadeDevState, slot: SlotInputs) -> Tensor:
        return slot.p_x

    def acceptance_at_once(
        self, inputs: TreeInputs, state: CascadeDevState, slots: RemovalSlots
    ) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 for every slot of deterministic drafts (q(x) = 1; its residual only removes x). Under
        p_c = p / mass_left[c] without the earlier tested siblings' tokens, a partner node's token y has p_c(y) =
        p(y) / mass_left[c], or 0 where an earlier sibling held y, and x is in p_c's nucleus iff the mass above x,
        less the removed tokens', is < nucleus x mass_left[c].
        -> (B, I, K), None."""
        p_kids = slots.p.gather(2, inputs.kid_tokens)  # (B, I, K) unnormalised p at every sibling's token
        gone = inputs.usable[:, :, None, :] & slots.removed_before  # (B, I, K, K) [c, c']: c' removed before c
        same = inputs.kid_tokens[..., None] == state.tokens[:, None, None, :]  # (B, I, K, N) [c', y]
        removed = (gone.float() @ same.float()) > 0  # (B, I, K, N) [c, y]: y's token was removed before slot c
        p_partners = at_node_tokens(slots.p, state.tokens)[:, :, None, :] * state.partners  # (B, I, K, N)
        left = slots.mass_left
        pooled = ((p_partners * ~removed).sum(-1) / left).nan_to_num_(0.0)  # (B, I, K); 0 / 0 past all mass
        total = state.convergence + pooled
        second = torch.where(total < 1.0, slots.p_x / (1.0 - total).clamp_min(1e-30), 1.0).clamp_max(1.0)
        p_others = p_kids[:, :, None, :]  # (B, I, 1, K) the siblings, for each slot c
        removed_above = (p_others * (gone & (p_others > p_kids[..., None]))).sum(-1)  # (B, I, K)
        gate = children_mass_above(inputs) - removed_above < self.nucleus * left
        plain = slots.p_x.clamp_max(1.0)
        return torch.where(gate & (total > 0), torch.maximum(plain, second), plain), None
