"""Verification rules, one class each: its parameters, the mass a draft is accepted with, and its residual.

`inference.verify` walks the draft tree and asks the rule about the c-th child of every node at once
(the inputs: `inference.rule_inputs`; cascade.md §2.4, §4, §5): `test_slot(...)` -> `SlotTest`, the
acceptance probability a0 of the drafted token x; for budgeted rules (CASCADE) the extra acceptance
probability it would like on top, which `verify` grants while the TV budget delta of the step lasts;
and the residual target after x is rejected (unnormalised). One method for the three, so that what
they share (LANTERN's pooled neighbours, GSD's rank blocks) is computed once per slot.

Budgeted relaxation (CASCADE) only raises acceptance probabilities and keeps the exact residual,
which makes its guarantee hold on every tree kind: couple the relaxed walk with the exact one through
the same draws and uniforms; they first differ at a test whose uniform falls in [a0, a0 + charge),
so P(outputs differ) <= the sum of charges along any walk <= delta, and the exact walk samples the
target exactly. Hence TV(output of one verification step, target) <= delta, for deterministic and
for sampled trees, static or dynamic (tested by enumeration in tests/test_decoder_lossless.py).

Peer rules (LANTERN, LANTERN++, the two GSD rules) follow their authors' code (cascade.md Round 2,
item 9), residual modifications included, and carry no such guarantee.

Shapes: B rows, N tree nodes, I parent nodes (the nodes with children, or all N), K child slots, V vocabulary,
D feature width, L neighbour-table width, C candidate tokens per slot (2K + 1), W GSD window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from inference.rule_inputs import RemovalSlots, SlotInputs, TreeInputs
from inference.similarity import centred_unit, in_nucleus, kl_divergence, mass_above
from inference.tree import strictly_lower


def scatter_mask(shape: tuple[int, ...], index: Tensor, keep: Tensor) -> Tensor:
    """(..., V) bool mask that is True at `index` (..., M) where `keep` (..., M); no host sync (unlike one_hot)."""
    mask = torch.zeros(*shape[:-1], shape[-1] + 1, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, torch.where(keep, index, shape[-1]), True)[..., : shape[-1]]


@dataclass
class SlotTest:
    """A rule's answer for the c-th child of every parent node."""

    a0: Tensor  # (B, I) acceptance probability of x
    want: Tensor | None  # (B, I) extra acceptance a budgeted rule asks for on top of a0; None for the others
    residual: Tensor  # (B, I, V) the target after x is rejected, unnormalised


def exact_acceptance(inputs: SlotInputs) -> Tensor:
    """min(1, p(x) / q(x)) (q(x) > 0 on every slot `verify` tests)."""
    return (inputs.p_x / inputs.q_x).clamp_max(1.0)


def exact_residual(p: Tensor, x: Tensor, q_draw: Tensor | None) -> Tensor:
    """relu(p - q_draw) (recursive rejection sampling); deterministic drafts (q one-hot at x): p with x removed."""
    if q_draw is None:
        return p.scatter(-1, x[..., None], 0.0)
    return torch.relu(p - q_draw)


@dataclass(frozen=True, kw_only=True, eq=False)
class ExactRule:
    """Lossless multi-draft speculative sampling (EAGLE; cascade.md §2.4)."""

    name: str = "exact"

    def prepare(self, inputs: TreeInputs) -> Any:
        return None

    def test_slot(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> SlotTest:
        return SlotTest(exact_acceptance(slot), None, exact_residual(slot.p, slot.x, slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> Tensor:
        return slot.p_x

    def acceptance_at_once(self, inputs: TreeInputs, state: Any, slots: RemovalSlots) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 for every slot of deterministic drafts (q(x) = 1): p_c(x), (B, I, K)."""
        return slots.p_x.clamp_max(1.0), None


@dataclass(frozen=True, kw_only=True, eq=False)
class LanternRule:
    """LANTERN (lam None) or LANTERN++ (lam set), as jadohu/LANTERN `evaluate_posterior` does it.

    p~(x) = p(x) + the largest prefix sum of p over x's k nearest codebook latents that stays <= delta
    (LANTERN) or <= (lam - 1) p(x) (LANTERN++); accept w.p. min(1, p~(x) / q(x)). On rejection x is
    removed and, if anything was pooled, its k + 1 nearest latents too ("code", the authors' code) or
    only the pooled ones ("pooled"). On sampled (static) trees the LlamaGen/Anole file zeroes the
    proposal q at those latents before relu(p - q), so they keep their p (`static_zeroes="q"`); the
    Lumina file zeroes p (`static_zeroes="p"`).
    """

    neighbours: Tensor
    """(V, L >= k + 1) int64: each code's other codes, nearest first (`build_latent_neighbours`)."""
    k: int = 1000
    delta: float = 0.1
    lam: float | None = None
    reject_zeroes: str = "code"
    static_zeroes: str = "q"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"lantern k must be >= 1, got {self.k}")
        if self.neighbours.shape[1] < self.k + (self.reject_zeroes == "code"):
            raise ValueError(f"neighbour table has {self.neighbours.shape[1]} columns, k={self.k} needs more")
        if self.reject_zeroes not in ("code", "pooled"):
            raise ValueError(f"reject_zeroes must be 'code' or 'pooled', got {self.reject_zeroes!r}")
        if self.static_zeroes not in ("q", "p"):
            raise ValueError(
                f"static_zeroes must be 'q' (LlamaGen file) or 'p' (Lumina file), got {self.static_zeroes!r}"
            )
        if self.lam is not None and self.lam < 1:
            raise ValueError(f"lantern++ needs lam >= 1, got {self.lam}")
        if not 0 <= self.delta <= 1:
            raise ValueError(f"lantern delta is a TV bound in [0, 1], got {self.delta}")

    @property
    def name(self) -> str:
        return "lantern" if self.lam is None else "lantern++"

    def prepare(self, inputs: TreeInputs) -> Any:
        return self.neighbours.to(inputs.probs.device)

    def _pooled(self, table: Tensor, slot: SlotInputs) -> tuple[Tensor, Tensor, Tensor]:
        """Neighbours (B, I, L), which of the first k are pooled (B, I, k), and the pooled mass (B, I)."""
        near = table[slot.x]  # (B, I, L)
        cumulative = slot.p.gather(2, near[..., : self.k]).cumsum(-1)  # (B, I, k)
        bound = self.delta if self.lam is None else (self.lam - 1) * slot.p_x[..., None]
        allowed = cumulative <= bound  # a prefix: the cumulative mass never decreases
        return near, allowed, (cumulative * allowed).amax(-1)

    def test_slot(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> SlotTest:
        near, allowed, extra = self._pooled(state, slot)
        a0 = ((slot.p_x + extra) / slot.q_x).clamp_max(1.0)
        if self.reject_zeroes == "code":  # x's k + 1 nearest, if anything was pooled
            zap, zap_keep = near[..., : self.k + 1], allowed[..., :1]  # (B, I, k + 1), (B, I, 1): a prefix
        else:
            zap, zap_keep = near[..., : self.k], allowed
        if slot.q_draw is None:  # x and the zapped latents to 0 in one scatter (x again where nothing is zapped)
            x = slot.x[..., None]
            return SlotTest(a0, None, slot.p.scatter(-1, torch.cat([x, torch.where(zap_keep, zap, x)], -1), 0.0))
        zero = scatter_mask(tuple(slot.p.shape), zap, zap_keep.expand_as(zap))  # (B, I, V)
        if self.static_zeroes == "q":
            return SlotTest(a0, None, torch.relu(slot.p - slot.q_draw.masked_fill(zero, 0.0)))
        return SlotTest(a0, None, torch.relu(slot.p.masked_fill(zero, 0.0) - slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> Tensor:
        return slot.p_x + self._pooled(state, slot)[2]


def _descending_ranks(p: Tensor) -> tuple[Tensor, Tensor]:
    """Order (..., V) of p, most likely first (stable), and each token's rank in it."""
    order = p.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(p.shape[-1], device=p.device).expand_as(order))
    return order, ranks


@dataclass(frozen=True, kw_only=True, eq=False)
class GSDBlocksRule:
    """The CASCADE authors' tree port of GSD (dev commit 8dc3300, cascade.md §5.4): rank-block clusters.

    The cluster of x is the block of G consecutive ranks of the current target distribution holding x;
    accept w.p. min(1, p(C) / q(C)) with q(C) the proposal mass of the block (1 for deterministic
    drafts, whose proposal is one-hot at x); on rejection the block is zeroed, then relu(p - q).
    """

    group: int = 25
    name: str = "gsd-blocks"

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"gsd-blocks group (cluster size G) must be >= 1, got {self.group}")

    def prepare(self, inputs: TreeInputs) -> Any:
        return None

    def _cluster(self, slot: SlotInputs) -> Tensor:
        _, ranks = _descending_ranks(slot.p)
        block = ranks // self.group
        return block == block.gather(2, slot.x[..., None])  # (B, I, V)

    def test_slot(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> SlotTest:
        cluster = self._cluster(slot)
        mass = (slot.p * cluster).sum(-1)
        residual = exact_residual(slot.p.masked_fill(cluster, 0.0), slot.x, slot.q_draw)
        if slot.q_draw is None:  # q(C) = 1
            return SlotTest(mass.clamp_max(1.0), None, residual)
        proposal = (slot.q_draw * cluster).sum(-1)
        return SlotTest((mass / proposal.clamp_min(1e-30)).clamp_max(1.0), None, residual)

    def greedy_mass(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> Tensor:
        return (slot.p * self._cluster(slot)).sum(-1)


@dataclass(frozen=True, kw_only=True, eq=False)
class GSDRule:
    """Grouped speculative decoding as its authors' code does it (junhyukso/GSD,
    `scheduler/jacobi_iteration_lumina_mgpt.py`; cascade.md Round 2, item 9).

    The cluster of x: the tokens whose rank in the current target distribution lies in the window
    [r - window/2, r + window/2) around x's rank r, kept where |p(y) - p(x)| < p_threshold and the
    squared L2 distance of their embeddings to x's is < distance_threshold (x itself always). Accept
    w.p. min(1, p(C) / q(C)) (q(C) = 1 for deterministic drafts); the residual is relu(p - q), the
    cluster is not removed.
    """

    embeddings: Tensor
    """(V, E) token embeddings the distance is measured on (the authors used the target's input embeddings)."""
    window: int = 14
    p_threshold: float = 0.15
    distance_threshold: float = 0.5
    name: str = "gsd"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"gsd window must be >= 1, got {self.window}")

    def prepare(self, inputs: TreeInputs) -> Any:
        return self.embeddings.to(inputs.probs.device).float()

    def _cluster_mass(self, embeddings: Tensor, slot: SlotInputs) -> tuple[Tensor, Tensor | None]:
        order, ranks = _descending_ranks(slot.p)
        vocab = slot.p.shape[-1]
        rank_x = ranks.gather(2, slot.x[..., None])  # (B, I, 1)
        offsets = torch.arange(-(self.window // 2), self.window - self.window // 2, device=slot.p.device)
        at = rank_x + offsets  # (B, I, W)
        inside = (at >= 0) & (at < vocab)
        members = order.gather(2, at.clamp(0, vocab - 1))  # (B, I, W)
        p_members = slot.p.gather(2, members)
        distance = (embeddings[members] - embeddings[slot.x][..., None, :]).pow(2).sum(-1)  # (B, I, W)
        keep = inside & ((p_members - slot.p_x[..., None]).abs() < self.p_threshold)
        keep &= distance < self.distance_threshold
        keep |= inside & (members == slot.x[..., None])
        mass = (p_members * keep).sum(-1)
        if slot.q_draw is None:  # q(C) = 1
            return mass, None
        return mass, (slot.q_draw.gather(2, members) * keep).sum(-1)

    def test_slot(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> SlotTest:
        mass, proposal = self._cluster_mass(state, slot)
        a0 = mass.clamp_max(1.0) if proposal is None else (mass / proposal.clamp_min(1e-30)).clamp_max(1.0)
        return SlotTest(a0, None, exact_residual(slot.p, slot.x, slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: Any, slot: SlotInputs) -> Tensor:
        return self._cluster_mass(state, slot)[0]


def children_mass_above(inputs: TreeInputs) -> Tensor:
    """(B, I, K): the mass of the tokens more likely than each child slot's token at its parent (`mass_above`).

    A tree with far more slots than nodes (the dynamic tree: 60 nodes, 60 x 10 slots) is measured once per
    node, against its parent's row, and the answers read back per slot: 10x fewer comparisons over the
    vocabulary (0.6 against 4.2 ms a step on this CPU) for 10 more ops. A tree with at most 4 slots a node
    (every static tree preset) is measured once per slot, where those ops would save little."""
    if inputs.children.numel() <= 4 * inputs.tree.tokens.numel():
        return mass_above(inputs.probs, inputs.kid_tokens)
    rows = inputs.tables.rows[:, None]
    at_parent = inputs.probs[rows, inputs.parent_row()]  # (B, N, V); the root reads row 0, a don't-care
    return inputs.at_children(mass_above(at_parent, inputs.tree.tokens[..., None])[..., 0])


@dataclass
class CascadeSets:
    """CASCADE's pooling candidates of every child slot, built once per verification step."""

    candidates: Tensor  # (B, I, K, C) tokens a slot may pool: its siblings, its own children, its parent's token
    pooled: Tensor  # (B, I, K, C) bool: in I(x) or C(x), distinct, not x
    converged: Tensor  # (B, I, K) bool: the slot's region converged (read under pool_beyond_tree)
    eligible: Tensor  # (B, I, K) bool: the slot may be relaxed at all (confidence gate)


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeRule:
    """CASCADE (cascade.md §4, Round 2 items 7-8): relaxed acceptance from the target's hidden states.

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
    """Similarity features: "hidden" (cond-branch post-norm hidden, mean-centred), "logits" or "probs"."""
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
        if self.representation not in ("hidden", "logits", "probs"):
            raise ValueError(f"representation must be hidden, logits or probs, got {self.representation!r}")
        if self.conf_gate is not None and not 0 < self.conf_gate <= 1:
            raise ValueError(f"conf_gate is a nucleus mass in (0, 1], got {self.conf_gate}")

    def prepare(self, inputs: TreeInputs) -> CascadeSets:
        if inputs.features is None:
            raise ValueError("the cascade rule needs TargetView.features (see speculative.build_target_view)")
        tree, children, usable, tables = inputs.tree, inputs.children, inputs.usable, inputs.tables
        width = children.shape[-1]
        rows = tables.rows[:, None]
        feats = centred_unit(inputs.features)  # (B, N, D): cosines become dot products
        kid = tables.child_index.view_as(children)  # (B, I, K), padding at node 0
        kid_feats = feats[rows[..., None], kid]  # (B, I, K, D)
        to_parent = (kid_feats * inputs.at_parents(feats)[:, :, None]).sum(-1)  # (B, I, K): sim(F[x], F[u])
        if self.conv_mode == "sibling":
            converged = to_parent >= self.tau_seq
        else:
            grand = tree.parents.clamp_min(0)  # (B, N)
            up = (feats * feats[rows, grand]).sum(-1)  # (B, N): sim(F[u], F[parent(u)])
            converged = inputs.at_parents((tree.parents >= 0) & (up >= self.tau_seq))[..., None].expand(-1, -1, width)
        if self.kl_gate is not None:  # target distributions at every node (`needs_every_node`)
            kid_p = inputs.probs[rows[..., None], kid]  # (B, N, K, V)
            converged = converged & (kl_divergence(kid_p, inputs.probs[:, :, None]) < self.kl_gate)
        converged = converged & usable if self.use_convergence else torch.zeros_like(usable)
        siblings = inputs.kid_tokens[:, :, None, :].expand(-1, -1, width, -1)  # (B, I, K, K)
        sibling_sim = kid_feats @ kid_feats.transpose(-1, -2)  # (B, I, K, K)
        interchangeable = (sibling_sim >= self.tau_pos) & usable[:, :, None, :]
        if not self.use_interchangeability:
            interchangeable = torch.zeros_like(interchangeable)
        grand_kids = tables.grandchildren  # (B, I, K, K) children of each child
        grand_tokens = tree.tokens.gather(1, grand_kids.clamp_min(0).flatten(1)).view_as(grand_kids)
        own = inputs.at_parents(tree.tokens)[:, :, None, None].expand(-1, -1, width, 1)  # (B, I, K, 1) parent's token
        candidates = torch.cat([siblings, grand_tokens, own], dim=-1)  # (B, I, K, C)
        adjacent = torch.cat([(grand_kids >= 0), torch.ones_like(own, dtype=torch.bool)], dim=-1)
        pooled = torch.cat([interchangeable, adjacent & converged[..., None]], dim=-1)
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
        return SlotTest(a0, want, exact_residual(slot.p, slot.x, slot.q_draw))

    def _relaxed(self, state: CascadeSets, slot: SlotInputs) -> tuple[Tensor, Tensor]:
        """a0 and the charge wanted on top, (B, I) each."""
        a0 = exact_acceptance(slot)
        c = slot.slot
        extra = (slot.p.gather(2, state.candidates[:, :, c]) * state.pooled[:, :, c]).sum(-1)  # (B, I)
        if self.pool_beyond_tree:  # beyond the tree: all other mass
            extra = torch.where(state.converged[:, :, c], 1.0 - slot.p_x, extra)
        relaxed = ((slot.p_x + extra) / slot.q_x).clamp_max(1.0)
        return a0, self._charge_wanted(relaxed, a0, state.eligible[:, :, c])

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


@dataclass
class CascadeDevState:
    """Per-slot inputs of the development rule, built once per verification step."""

    convergence: Tensor  # (B, I, K) s where s > sim_threshold and the child is at depth >= 2, else 0
    pairs: Tensor  # (B, I, K, K) bool: siblings whose drafter distributions have cosine > pair_threshold


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeDevRule:
    """The CASCADE development code's rule ("final cascade", commit 8c40c9c, `models/ea_model_lumina_mgpt.py`;
    cascade.md Round 2, item 9), as a comparison: not the method, and with no TV budget.

    A plain test u < p(x)/q(x) first; if it fails and p(x) lies in the nucleus of mass `nucleus` of the
    current p, a second test with the same u after p(x) += u * S, where S = s (the cosine of the softmaxed
    last-layer states of x's node and its parent, when s > sim_threshold and x is at depth >= 2) plus
    p(y) for each sibling y whose drafter distribution has cosine > pair_threshold with x's. Together:
    accept w.p. min(1, p(x) / (q(x) - S)) (1 when S >= q(x)). Pooled tokens stay in the residual, which
    is relu(p - q).
    """

    sim_threshold: float = 0.9
    pair_threshold: float = 0.5
    nucleus: float = 0.8
    name: str = "cascade-dev"

    def prepare(self, inputs: TreeInputs) -> CascadeDevState:
        if inputs.features is None:
            raise ValueError("cascade-dev needs TargetView.features (see speculative.build_target_view)")
        tree, children, tables = inputs.tree, inputs.children, inputs.tables
        rows = tables.rows[:, None, None]
        kid = tables.child_index.view_as(children)  # (B, I, K), padding at node 0
        states = inputs.features.float().softmax(-1)  # (B, N, D) softmaxed last-layer states
        states = states / states.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        s = (states[rows, kid] * inputs.at_parents(states)[:, :, None]).sum(-1)  # (B, I, K) node vs parent
        deep = inputs.at_children(tree.depths) >= 2
        convergence = torch.where((s > self.sim_threshold) & deep & inputs.usable, s, 0.0)
        q = tree.q_full.float()[rows, kid]  # (B, I, K, V) drafter distribution at each child
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cosine = q @ q.transpose(-1, -2)  # (B, I, K, K)
        width = children.shape[-1]
        other = ~torch.eye(width, dtype=torch.bool, device=children.device)
        pairs = (cosine > self.pair_threshold) & other & inputs.usable[:, :, None, :] & inputs.usable[..., None]
        return CascadeDevState(convergence, pairs)

    def test_slot(self, inputs: TreeInputs, state: CascadeDevState, slot: SlotInputs) -> SlotTest:
        c = slot.slot
        plain = exact_acceptance(slot)
        pooled = (slot.p.gather(2, inputs.kid_tokens) * state.pairs[:, :, c]).sum(-1)  # (B, I)
        total = state.convergence[:, :, c] + pooled
        second = torch.where(slot.q_x > total, slot.p_x / (slot.q_x - total).clamp_min(1e-30), 1.0).clamp_max(1.0)
        gate = in_nucleus(slot.p, slot.x[..., None], self.nucleus)[..., 0]
        a0 = torch.where(gate & (total > 0), torch.maximum(plain, second), plain)
        return SlotTest(a0, None, exact_residual(slot.p, slot.x, slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: CascadeDevState, slot: SlotInputs) -> Tensor:
        return slot.p_x

    def acceptance_at_once(
        self, inputs: TreeInputs, state: CascadeDevState, slots: RemovalSlots
    ) -> tuple[Tensor, Tensor | None]:
        """`test_slot`'s a0 for every slot of deterministic drafts (q(x) = 1; its residual only removes x). Under
        p_c = p / mass_left[c] without the earlier tested siblings' tokens, a sibling's mass is p(y) / mass_left[c]
        or 0, and x is in p_c's nucleus iff the mass above x, less the removed tokens', is < nucleus x mass_left[c].
        -> (B, I, K), None."""
        p_kids = slots.p.gather(2, inputs.kid_tokens)  # (B, I, K) unnormalised p at every sibling's token
        gone = inputs.usable[:, :, None, :] & slots.removed_before  # (B, I, K, K) [c, c']: c' removed before c
        p_others = p_kids[:, :, None, :]  # (B, I, 1, K) the siblings, for each slot c
        left = slots.mass_left
        pooled = ((p_others * (state.pairs & ~gone)).sum(-1) / left).nan_to_num_(0.0)  # (B, I, K); 0 / 0 past all
        total = state.convergence + pooled
        second = torch.where(total < 1.0, slots.p_x / (1.0 - total).clamp_min(1e-30), 1.0).clamp_max(1.0)
        removed_above = (p_others * (gone & (p_others > p_kids[..., None]))).sum(-1)  # (B, I, K)
        gate = children_mass_above(inputs) - removed_above < self.nucleus * left
        plain = slots.p_x.clamp_max(1.0)
        return torch.where(gate & (total > 0), torch.maximum(plain, second), plain), None


Rule = ExactRule | LanternRule | GSDBlocksRule | GSDRule | CascadeRule | CascadeDevRule


def needs_every_node(rule: Rule) -> bool:
    """Whether the rule reads the target at nodes without children: CASCADE's kl_gate (a child's distribution
    against its parent's) and its "probs"/"logits" similarity features. The others need it only at parents."""
    return isinstance(rule, CascadeRule) and (rule.kl_gate is not None or rule.representation != "hidden")


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
