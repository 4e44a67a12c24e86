"""Verification rules, one class each: its parameters, the mass a draft is accepted with, and its residual.

`inference.decoding.verify` walks the draft tree and asks the rule about the c-th child of every node at once
(the inputs: `inference.decoding.rule_inputs`; docs/method.md, sections "Tree verification", "CASCADE as implemented",
"The baselines, as their authors' code runs them"): `test_slot(...)` -> `SlotTest`, the acceptance probability a0 of the
drafted token x; for budgeted rules (CASCADE) the extra acceptance probability it would like on top, which `verify`
grants while the TV budget delta of the step lasts; and the residual target after x is rejected (unnormalised). One
method for the three, so that what they share (LANTERN's pooled neighbours, GSD's rank blocks) is computed once per
slot.

Budgeted relaxation (CASCADE) only raises acceptance probabilities and keeps the exact residual,
which makes its guarantee hold on every tree kind: couple the relaxed walk with the exact one through
the same draws and uniforms; they first differ at a test whose uniform falls in [a0, a0 + charge),
so P(outputs differ) <= the sum of charges along any walk <= delta, and the exact walk samples the
target exactly. Hence TV(output of one verification step, target) <= delta, for deterministic and
for sampled trees, static or dynamic (tested by enumeration in tests/test_decoder_lossless.py).

This module holds exact and CASCADE and the registry of every rule. The peer rules (LANTERN, LANTERN++,
the two GSD rules, the CASCADE development code's rule: `inference.decoding.peer_rules` and
`inference.decoding.gsd_blocks`, re-exported here) follow their authors' code (docs/method.md, section "The baselines,
as their authors' code runs them"), residual modifications included, and carry no such guarantee.

Shapes: B rows, N tree nodes, I parent nodes (the nodes with children, or all N), K child slots, V vocabulary,
D feature width, C candidate tokens per slot (2K + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from inference.decoding.cascade_dev import CascadeDevRule
from inference.decoding.gsd_blocks import GSDBlocksRule
from inference.decoding.peer_rules import GSDRule, LanternRule, scatter_mask
from inference.decoding.rule_inputs import (
    RemovalSlots,
    SlotInputs,
    SlotTest,
    TreeInputs,
    children_mass_above,
    exact_acceptance,
    exact_residual,
)
from inference.decoding.similarity import cosine, kl_divergence
from inference.decoding.tree import strictly_lower

__all__ = [
    "RULES",
    "CascadeDevRule",
    "CascadeRule",
    "CascadeSets",
    "ExactRule",
    "GSDBlocksRule",
    "GSDRule",
    "LanternRule",
    "Rule",
    "SlotTest",
    "children_mass_above",
    "exact_acceptance",
    "exact_residual",
    "needs_every_node",
    "scatter_mask",
]


@dataclass(frozen=True, kw_only=True, eq=False)
class ExactRule:
    """Lossless multi-draft speculative sampling (EAGLE; docs/method.md, section "`exact`: lossless multi-draft
    speculative sampling")."""

    name: str = "exact"

    def prepare(self, inputs: TreeInputs) -> Any:
        return None

    def test_slot(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> SlotTest:
        # p(x) / q(x): `verify` clamps it to 1
        return SlotTest(slot.p_x / slot.q_x, None, exact_residual(slot.p, slot.x_column, slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> Tensor:
        return slot.p_x

    def acceptance_at_once(self, inputs: TreeInputs, state: Any, slots: RemovalSlots) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 for every slot of deterministic drafts (q(x) = 1): p_c(x), (B, I, K)."""
        return slots.p_x.clamp_max(1.0), None

    def sampled_reads(self, inputs: TreeInputs, state: Any) -> Tensor:
        """The tokens whose p_c `acceptance_sampled` reads on sampled drafts: x, (B, I, K, 1)."""
        return inputs.kid_tokens[..., None]

    def acceptance_sampled(self, inputs: TreeInputs, state: Any, slots: SlotInputs) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 for every slot of sampled drafts (`slots` with a K axis, p_c read at x):
        min(1, p_c(x) / q_c(x)), (B, I, K)."""
        return (slots.p[..., 0] / slots.q_x).clamp_max(1.0), None


@dataclass
class CascadeSets:
    """CASCADE's pooling candidates of every child slot, built once per verification step."""

    candidates: Tensor  # (B, I, K, C) tokens a slot may pool: its siblings, its own children, its parent's token
    pooled: Tensor  # (B, I, K, C) bool: in I(x) or C(x), distinct, not x
    converged: Tensor  # (B, I, K) bool: the slot's region converged (read under pool_beyond_tree)
    eligible: Tensor  # (B, I, K) bool: the slot may be relaxed at all (confidence gate)

    @cached_property
    def per_slot(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """(candidates (B, I, C), pooled (B, I, C), eligible (B, I)) of each slot: split once (three ops) for the
        slot loop, not selected per slot (four)."""
        return list(zip(self.candidates.unbind(2), self.pooled.unbind(2), self.eligible.unbind(2), strict=True))


AUX_STREAMS = ("aux-low", "aux-mid", "aux-high")
REPRESENTATIONS = ("hidden", *AUX_STREAMS, "latent", "logits", "probs")
"""CASCADE's similarity features (`CascadeRule.representation`)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeRule:
    """CASCADE (docs/method.md, section "CASCADE as implemented"): relaxed acceptance from the target's hidden states.

    For the c-th child x of node u, with F the target's features at the nodes:
    - interchangeability I(x): siblings m of x with sim(F[x], F[m]) >= tau_pos (breadth);
    - convergence C(x), across consecutive tree levels (depth): when x's state resembles its
      parent's, sim(F[x], F[u]) >= tau_seq (and KL(p at x || p at u) < kl_gate if set), the tokens
      drafted on the adjacent levels, u's own token and x's children, are plausible at x's position
      too; conv_mode "path" asks instead that u resembles its own parent;
    - pool_beyond_tree: a converged x may pool any other mass of the residual.
    x is accepted w.p. min(1, a0 + charge) with a0 = min(1, p(x)/q(x)) and charge = the extra
    min(1, (p(x) + p(pooled)) / q(x)) - a0, cut to the TV budget delta left in this verification
    step. Pooled tokens stay in the residual, which is the exact one, so TV(output, target) <= delta
    (module docstring). conf_gate relaxes x only inside the target's nucleus of that mass.
    """

    delta: float = 0.5
    """TV budget per verification step."""
    tau_pos: float = 0.9
    """Interchangeability threshold on sibling similarity (a calibration file next to the drafter overrides it)."""
    tau_seq: float = 0.625
    """Convergence threshold on child-to-parent similarity (likewise)."""
    use_interchangeability: bool = True
    use_convergence: bool = True
    conv_mode: str = "sibling"
    representation: str = "hidden"
    """Similarity features, mean-centred: "hidden" (cond-branch post-norm last hidden state), "aux-low",
    "aux-mid" or "aux-high" (the cond branch's EAGLE-3 streams, `ImageTarget.aux_layer_ids`: the tree forward
    returns them for an EAGLE-3 drafter anyway, and for this rule with any drafter), "latent" (the tokens'
    codes in `ImageTarget.latent_table()`, LANTERN's space: not the target's states), "logits" or "probs".
    `python -m inference.signals` scores each against ground truth; a calibration file next to the drafter
    sets it with its thresholds."""
    conf_gate: float | None = 0.8
    """Relax x only inside the target's 0.8 nucleus (the dev code's gate). The default: on the toy target's tune
    prompts (seed 11, static sampled tree) every ungated setting lost prompt fidelity (0.73-0.94 against exact's
    0.96) for at most 6 % more tau; gated ones kept it."""
    kl_gate: float | None = None
    pool_beyond_tree: bool = False
    name: str = "cascade"

    def __post_init__(self) -> None:
        if not 0 <= self.delta <= 1:
            raise ValueError(f"cascade delta is a TV budget in [0, 1], got {self.delta}")
        if self.conv_mode not in ("sibling", "path"):
            raise ValueError(f"conv_mode must be 'sibling' or 'path', got {self.conv_mode!r}")
        if self.representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {', '.join(REPRESENTATIONS)}, got {self.representation!r}")
        if self.conf_gate is not None and not 0 < self.conf_gate <= 1:
            raise ValueError(f"conf_gate is a nucleus mass in (0, 1], got {self.conf_gate}")

    def prepare(self, inputs: TreeInputs) -> CascadeSets:
        if inputs.features is None:
            raise ValueError("the cascade rule needs TargetView.features (see speculative.build_target_view)")
        tree, children, usable, tables = inputs.tree, inputs.children, inputs.usable, inputs.tables
        width = children.shape[-1]
        cosines = cosine(inputs.features, centred=True, pairwise=True)  # (B, N, N) every pair of nodes, float32
        # each slot against its siblings (itself included), then against its parent: one gather off the table
        sims = cosines.flatten(1).gather(1, tables.similarity_index).view(*children.shape, width + 1)
        sibling_sim, to_parent = sims[..., :width], sims[..., width]  # (B, I, K, K): sim(F[x], F[m]), (B, I, K)
        if self.conv_mode == "sibling":
            converged = to_parent >= self.tau_seq  # sim(F[x], F[u])
        else:
            grand = tree.parents.clamp_min(0)  # (B, N)
            up = cosines.gather(2, grand[..., None]).squeeze(2)  # (B, N): sim(F[u], F[parent(u)])
            converged = inputs.at_parents((tree.parents >= 0) & (up >= self.tau_seq))[..., None].expand(-1, -1, width)
        if self.kl_gate is not None:  # target distributions at every node (`needs_every_node`)
            kid = tables.child_index.view_as(children)  # (B, I, K), padding at node 0
            kid_p = inputs.probs[tables.rows[:, None, None], kid]  # (B, N, K, V)
            converged = converged & (kl_divergence(kid_p, inputs.probs[:, :, None]) < self.kl_gate)
        converged = converged & usable if self.use_convergence else torch.zeros_like(usable)
        interchangeable = (sibling_sim >= self.tau_pos) & usable[:, :, None, :]
        if not self.use_interchangeability:
            interchangeable = torch.zeros_like(interchangeable)
        # the tokens at each slot's siblings, its own children and its parent, (B, I, K, C): one gather
        candidates = tree.tokens.gather(1, tables.pooling_index).view(*children.shape, -1)
        pooled = torch.cat([interchangeable, tables.pooling_adjacent & converged[..., None]], dim=-1)
        pooled &= candidates != inputs.kid_tokens[..., None]  # never x itself
        earlier = strictly_lower(pooled.shape[-1], pooled.device)  # (C, C)
        repeat = ((candidates[..., :, None] == candidates[..., None, :]) & pooled[..., None, :] & earlier).any(-1)
        pooled &= ~repeat  # each token pooled once
        eligible = usable  # relax only tokens inside the target's nucleus at the parent
        if self.conf_gate is not None:
            eligible = usable & (children_mass_above(inputs) < self.conf_gate)  # x in the target's nucleus
        return CascadeSets(candidates, pooled, converged, eligible)

    def test_slot(self, inputs: TreeInputs, state: CascadeSets, slot: SlotInputs) -> SlotTest:
        a0, want = self._relaxed(state, slot)
        return SlotTest(a0, want, exact_residual(slot.p, slot.x_column, slot.q_draw))

    def _relaxed(self, state: CascadeSets, slot: SlotInputs) -> tuple[Tensor, Tensor]:
        """a0 (at most 1) and the charge wanted on top, (B, I) each (every slot's, (B, I, K), for `slot` with a K
        axis)."""
        if slot.slot is None:  # every slot at once, p_c read at the candidates (`sampled_reads`), (B, I, K, C)
            p_candidates, pooled, eligible = slot.p, state.pooled, state.eligible
            # the first K candidates are a slot's siblings in slot order, itself included: slot c's x is column c
            p_x = p_candidates[..., : pooled.shape[-2]].diagonal(dim1=-2, dim2=-1)  # (B, I, K)
        else:
            candidates, pooled, eligible = state.per_slot[slot.slot]  # (B, I, C) twice, (B, I)
            p_candidates, p_x = slot.p.gather(-1, candidates), slot.p_x
        a0 = (p_x / slot.q_x).clamp_max(1.0)
        extra = (p_candidates * pooled).sum(-1)  # (B, I); pooled is never x itself
        if self.pool_beyond_tree:  # beyond the tree: all other mass
            converged = state.converged if slot.slot is None else state.converged[:, :, slot.slot]
            extra = torch.where(converged, 1.0 - p_x, extra)
        relaxed = ((p_x + extra) / slot.q_x).clamp_max(1.0)
        return a0, self._charge_wanted(relaxed, a0, eligible)

    def sampled_reads(self, inputs: TreeInputs, state: CascadeSets) -> Tensor:
        """The tokens whose p_c `acceptance_sampled` reads on sampled drafts: each slot's pooling candidates,
        (B, I, K, C), whose first K are its siblings, itself included (x of slot c is column c)."""
        return state.candidates

    def acceptance_sampled(
        self, inputs: TreeInputs, state: CascadeSets, slots: SlotInputs
    ) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 (at most 1) and want for every slot of sampled drafts at once (`slots` with a K axis,
        p_c read at the candidates), (B, I, K)."""
        return self._relaxed(state, slots)

    def greedy_mass(self, inputs: TreeInputs, state: CascadeSets, slot: SlotInputs) -> Tensor:
        return slot.p_x + self._relaxed(state, slot)[1].clamp_max(self.delta)

    def acceptance_at_once(
        self, inputs: TreeInputs, state: CascadeSets, slots: RemovalSlots
    ) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 and want for every slot of deterministic drafts (q(x) = 1): a candidate's mass under p_c is
        p(y) / mass_left[c], or 0 where y is an earlier tested sibling's token (removed). -> (B, I, K) twice."""
        candidates = state.candidates  # (B, I, K, C)
        p_candidates = slots.p.gather(2, candidates.flatten(2)).view_as(candidates)
        earlier = inputs.usable[:, :, None, :] & slots.removed_before  # (B, I, K, K) [c, c']: c' tested before c
        removed = (candidates[..., None] == inputs.kid_tokens[:, :, None, None, :]) & earlier[:, :, :, None]
        kept = state.pooled & ~removed.any(-1)  # (B, I, K, C)
        extra = ((p_candidates * kept).sum(-1) / slots.mass_left).nan_to_num_(0.0)  # (B, I); 0 / 0 past all mass
        if self.pool_beyond_tree:  # beyond the tree: all other mass
            extra = torch.where(state.converged, 1.0 - slots.p_x, extra)
        a0 = slots.p_x.clamp_max(1.0)
        relaxed = (slots.p_x + extra).clamp_max(1.0)
        return a0, self._charge_wanted(relaxed, a0, state.eligible)

    def _charge_wanted(self, relaxed: Tensor, a0: Tensor, eligible: Tensor) -> Tensor:
        """relaxed - a0 where the slot may be relaxed. The pooled mass is >= 0, so relaxed >= a0 exactly in
        floating point (adding a non-negative number and dividing by the same q(x) are monotone); only
        pool_beyond_tree's 1 - p(x), negative by a rounding where p(x) > 1, needs the clamp."""
        wanted = (relaxed - a0) * eligible
        return wanted.clamp_min(0.0) if self.pool_beyond_tree else wanted


Rule = ExactRule | LanternRule | GSDBlocksRule | GSDRule | CascadeRule | CascadeDevRule


def needs_every_node(rule: Rule) -> bool:
    """Whether the rule reads the target at nodes without children: CASCADE's kl_gate (a child's distribution
    against its parent's) and its "probs"/"logits" similarity features. The others need it only at parents."""
    return isinstance(rule, CascadeRule) and (rule.kl_gate is not None or rule.representation in ("logits", "probs"))


def aux_stream(rule: Rule) -> int | None:
    """Which EAGLE-3 stream (0 low, 1 mid, 2 high) CASCADE's similarity reads, None when it reads no stream."""
    if isinstance(rule, CascadeRule) and rule.representation in AUX_STREAMS:
        return AUX_STREAMS.index(rule.representation)
    return None


RULES: dict[str, type] = {
    "exact": ExactRule,
    "lantern": LanternRule,
    "lantern++": LanternRule,
    "gsd": GSDRule,
    "gsd-blocks": GSDBlocksRule,
    "cascade": CascadeRule,
    "cascade-dev": CascadeDevRule,
}
"""Every rule by its command-line name (LANTERN++ is LanternRule with lam set)."""
