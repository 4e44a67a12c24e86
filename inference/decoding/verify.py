"""Tree verification: one pass over every node of B drafted trees, whatever the rule (`inference.decoding.rules`).

`verify(tree, view, rule, uniforms)` decides which drafts are accepted after one target forward over
the tree. Every node's children are tested in order (draw order for sampled drafts, drafter rank for
deterministic ones; docs/method.md, section "Tree verification"): child c of node u is accepted with probability a(u,
c), else the residual target at u is updated and child c + 1 is tried; if every child is rejected, the correction token
is drawn from the residual; a walk that reaches a leaf draws the bonus token from the target there (never relaxed:
docs/method.md, section "q_R and the relaxed test").

What makes this cheap: the residual at u only depends on u and its own children, never on the path
that led to u (it restarts from the target at every depth). So the residuals and acceptance
probabilities of all nodes are computed at once, in a loop over the K child slots only, and the walk
itself is a few gathers along the tree's root-to-node paths. For deterministic drafts under a rule
whose rejection only removes x (`exact`, `cascade`, `cascade-dev`), not even that loop: the c-th test
sees the target with the earlier children's tokens removed, renormalised, which `removal_slots` writes
for every slot at once. For sampled drafts the loop runs only the chain of residuals, kept unnormalised
(three ops a slot, `sampled_slots`), and the rule tests every slot at once after it (`acceptance_sampled`); a
rule that changes the residual runs its own chain (`own_chain`; GSD-blocks' on deterministic drafts sorts p once).
The aten op count per step is independent of tree depth and size, and there is no host-device sync. Only parents
need the target's distribution: on a static tree the view covers its inner nodes (`TargetView.nodes`), every
V-wide table has one row per inner node, and a walk that ends at a leaf reads the target there
through `TargetView.at_leaf`.

- Sampled drafts (static or dynamic sampled trees): recursive rejection sampling without
  replacement. Child c was drawn from q_c = q(u) with the earlier children removed, renormalised; it
  is accepted w.p. min(1, p_c(x)/q_c(x)) and a rejection sets p_{c+1} = norm(relu(p_c - q_c)), for
  every drawn child (EAGLE-1, SpecTr). q_c(x) and q_c's normaliser are read off q(u) and the children
  once per step (`draw_probabilities`), not carried by the tree.
- Deterministic drafts (dynamic EAGLE-2 trees, greedy static trees): q_c is one-hot at x, so the test
  is p_c(x) and a rejection removes x. Duplicate sibling tokens are tested once (a drafted tree has
  none: `Tree.distinct_siblings`).
- Budgeted rules (CASCADE) add a charge on top of the exact acceptance probability while the TV
  budget delta of the step lasts; the charges are granted in test order along the walk: the c-th
  test gets min(want, delta - what earlier tests on the walk took).
- Greedy (temperature 0): every child is tested against the unmodified target at its parent (exact:
  x is the argmax; relaxed rules: x's relaxed mass exceeds every other token's p) and the deepest
  node whose whole path passes is accepted (LANTERN's longest accepted path); the bonus is the argmax.
  LANTERN's p there is the unfiltered softmax, as in its authors' greedy code (`TargetView.probs`, built by
  `inference.decoding.speculative.build_target_view`).

Shapes: B rows, N tree nodes, I nodes the view covers (a static tree's inner nodes, else N), K child
slots, V vocabulary, P path length (max depth + 1), D features.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from inference.decoding.rule_inputs import (
    RemovalSlots,
    SlotInputs,
    TreeInputs,
    chain_step,
    normalise_or_uniform,
    pack_slots,
    packed_slots,
    unpack_slots,
)
from inference.decoding.rules import (
    RULES,
    CascadeRule,
    ExactRule,
    GSDBlocksRule,
    GSDRule,
    LanternRule,
    Rule,
    needs_every_node,
)
from inference.decoding.similarity import cosine, kl_divergence
from inference.decoding.tree import Tree, select, strictly_lower

__all__ = [
    "RULES",
    "CascadeRule",
    "ExactRule",
    "GSDBlocksRule",
    "GSDRule",
    "LanternRule",
    "Rule",
    "TargetView",
    "Uniforms",
    "Verdict",
    "build_latent_neighbours",
    "cosine",
    "draw_probabilities",
    "kl_divergence",
    "normalise_or_uniform",
    "sample_inverse_cdf",
    "verify",
]


@dataclass
class TargetView:
    """What verification sees of the target forward over the tree.

    The distributions may cover only the nodes with children (`nodes`, a static tree's inner nodes):
    verification tests children against their parent's distribution, and needs a leaf's only when
    the walk ends there, for the bonus token, which `at_leaf` computes for that one node per row.
    """

    probs: Tensor  # (B, I, V) processed target distribution at `nodes` (predicts their children)
    greedy_tokens: Tensor | None = None  # (B, I) argmax of the guided logits there (greedy mode)
    features: Tensor | None = None  # (B, N, D) CASCADE similarity features (cond branch), at every node
    nodes: Tensor | None = None  # (I,) int64 nodes `probs` covers, ascending, every node with children;
    # None = every node (I = N)
    node_row: Tensor | None = None  # (N + 1,) int64 each node's row in `probs`, -1 where not covered and at
    # index N, so that a -1 padded path indexes -1 (`Tree.inner_row`)
    at_leaf: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
    """With `nodes`: (B,) node ids -> (processed distribution (B, V), argmax of the guided logits (B,)) there."""


@dataclass
class Uniforms:
    accept: Tensor  # (B, max_depth, K) one uniform per (depth of the parent, child slot)
    bonus: Tensor  # (B,) for the correction/bonus token

    @classmethod
    def draw(cls, tree: Tree, generator: torch.Generator | None) -> Uniforms:
        batch, device = tree.tokens.shape[0], tree.tokens.device
        shape = (batch, tree.max_depth, tree.max_children)
        return cls(
            torch.rand(shape, generator=generator, device=device), torch.rand(batch, generator=generator, device=device)
        )


@dataclass
class Verdict:
    last_node: Tensor  # (B,) deepest accepted node (0 = only the root)
    num_accepted: Tensor  # (B,) accepted draft tokens (= depth of last_node)
    next_token: Tensor  # (B,) bonus/correction token sampled at the end
    tv_charged: Tensor  # (B,) budget the walk's tests took (0 for unbudgeted rules)
    accept_prob: Tensor  # (B, max_depth, K) acceptance probability of every test made, NaN where none was
    final_probs: Tensor  # (B, V) the distribution next_token was drawn from (residual or bonus)


def build_latent_neighbours(codebook: Tensor, k: int) -> Tensor:
    """LANTERN's latent proximity (docs/method.md, section "The baselines, as their authors' code runs them"): (V, e)
    codebook -> (V, k) nearest other codes by L2."""
    distance = torch.cdist(codebook.float(), codebook.float())  # (V, V)
    distance.fill_diagonal_(float("inf"))
    return distance.topk(min(k, codebook.shape[0] - 1), dim=-1, largest=False).indices


def sample_inverse_cdf(probs: Tensor, uniform: Tensor) -> Tensor:
    """Draw from (B, V) probabilities with one given uniform per row (inverse CDF). -> (B,)."""
    cdf = probs.cumsum(-1)
    target = (uniform * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def prepare_tree(tree: Tree, view: TargetView, max_accept: Tensor | None) -> TreeInputs:
    """Children in test order and which slots are tested: (B, I, K) tables over the nodes the view covers."""
    if view.nodes is not None and (view.node_row is None or view.at_leaf is None):
        raise ValueError("a TargetView over some nodes needs node_row (Tree.inner_row) and at_leaf for the leaves")
    tables = tree.walk_tables(view.nodes)  # built once per tree, or once per static shape
    children, at_kids = tables.children, tables.at_children  # (B, I, K); per-node (B, N) -> each child's
    valid = tables.has_child
    if max_accept is not None:  # image end: drafts past it are never tested (not in place: `valid` is shared)
        valid = valid & (at_kids(tree.depths) <= max_accept[:, None, None])
    kid_tokens, kid_q, q_parent, q_mass_left = at_kids(tree.tokens), None, None, None
    if tree.sampled:  # drawn without replacement: no duplicates; a draw with q = 0 is padding, not a draft
        q_parent = select(tree.q_full, view.nodes).float()  # (B, I, V)
        kid_q, q_mass_left = draw_probabilities(q_parent, kid_tokens, tables.has_child)
        usable = valid & (kid_q > 0)
    elif not tree.distinct_siblings:  # deterministic drafts: a repeated sibling token is tested once (§8)
        earlier = strictly_lower(children.shape[-1], children.device)  # (K, K) [c, c']: c' < c
        same = (kid_tokens[..., :, None] == kid_tokens[..., None, :]) & valid[..., None, :] & earlier
        usable = valid & ~same.any(-1)
    else:  # the drafter took them from one top-k: no repeats to look for
        usable = valid
    probs = view.probs.float()
    return TreeInputs(
        tree, probs, view.features, children, kid_tokens, usable, view.nodes, kid_q, view.node_row,
        q_parent=q_parent, q_mass_left=q_mass_left,
    )  # fmt: skip


def draw_probabilities(q: Tensor, tokens: Tensor, drawn: Tensor) -> tuple[Tensor, Tensor]:
    """Sampled drafts: the probability each child was drawn with, and q's mass left before it.

    Child c of a node was drawn from q there with the earlier children's tokens removed: with probability
    q(x_c) / mass_left[c], mass_left[c] = q's mass outside x_0 .. x_{c-1} (`mass_left_by_slot`: no subtraction
    loses a small remainder). A draw with q = 0 (padding) gets 0.

    Args:
        q: (B, I, V) the drafter's q at the parent nodes; tokens: (B, I, K) their children's tokens in draw order;
        drawn: (B, I, K) bool, the slot holds a child.
    Returns:
        (B, I, K) each child's draw probability, and (B, I, K) mass_left, at least 1e-30 (a divisor).
    """
    kid_q, _, mass_left = mass_left_by_slot(q, tokens, drawn)
    mass_left = mass_left.clamp_min(1e-30)
    return kid_q / mass_left, mass_left


def mass_left_by_slot(dist: Tensor, tokens: Tensor, taken: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What is left of a distribution over the vocabulary as a node's children take their tokens in slot order.

    dist (B, I, V) at the parent nodes, tokens (B, I, K) their children's, taken (B, I, K) bool: the slots whose
    token is removed. Returns each taken child's mass (B, I, K) (0 elsewhere), dist with every taken token at
    exactly 0 (B, I, V), and the mass left before each slot (B, I, K): what no slot took plus the taken children's
    from that slot on, summed from the last slot back, so that no subtraction loses a small remainder and a child
    that takes all the mass left holds exactly that mass."""
    kid_mass = dist.gather(2, tokens) * taken  # (B, I, K)
    removed = dist.scatter_add(2, tokens, -kid_mass)  # every taken token at exactly 0; the others add 0
    return kid_mass, removed, removed.sum(-1, keepdim=True) + kid_mass.flip(-1).cumsum(-1).flip(-1)


def slot_tables(rule: Rule, inputs: TreeInputs) -> tuple[Tensor, Tensor | None, Tensor]:
    """Every node's tests, as if all its children were rejected in turn.

    Returns a0 (B, I, K) the rule's acceptance probability of each child, want (B, I, K) the extra a
    budgeted rule asks for (None for the others), and the residual after all children (B, I, V). a0 and want
    are finite but meaningless on untested slots: `verify` reads them only where `usable` (no op to zero them).
    """
    tree, children, usable = inputs.tree, inputs.children, inputs.usable
    p = inputs.probs  # (B, I, V)
    state: Any = rule.prepare(inputs)  # the rule's own per-step tables
    width = children.shape[-1]
    q_draws: tuple[Tensor, ...] | None = None
    draws = q_x = None  # deterministic drafts: one-hot proposals
    if not tree.sampled:
        at_once = getattr(rule, "acceptance_at_once", None)
        if at_once is not None:  # removals only: every slot at once, no loop
            slots, residual = removal_slots(inputs)
            a0, want = at_once(inputs, state, slots)
            return a0, want, residual
    else:
        if inputs.kid_q is None:
            raise ValueError("a sampled tree's TreeInputs need kid_q (prepare_tree)")
        draws = draw_distributions(inputs)  # (B, I, K, V) q_c of every slot, 0 where untested
        q_x = inputs.kid_q.masked_fill(~usable, 1.0)  # (B, I, K); 1 where untested, so rules divide unguarded
        sampled_at_once = getattr(rule, "acceptance_sampled", None)
        if sampled_at_once is not None:  # the exact residual: the chain of residuals first, then every test at once
            reads = getattr(rule, "sampled_reads", None)
            if reads is not None:  # p_c at a few tokens per slot
                all_slots, residual = sampled_slots(inputs, draws, q_x, reads(inputs, state))
                return *sampled_at_once(inputs, state, all_slots), residual  # a0 <= 1 already
            # p_c over the vocabulary: only the tested slots, where most are empty
            all_slots, residual = sampled_slots(inputs, draws, q_x, packed=packed_slots(inputs))
            a0, want = sampled_at_once(inputs, state, all_slots)
            if all_slots.packed is not None:  # the (B, J) answers back in their (B, I, K) places
                a0 = unpack_slots(a0, all_slots.packed, usable)
                want = None if want is None else unpack_slots(want, all_slots.packed, usable)
            return a0, want, residual
    own_chain = getattr(rule, "own_chain", None)  # a rule that changes the residual may run its own chain
    chained = None if own_chain is None else own_chain(inputs, state, draws, q_x)
    if chained is not None:
        return chained[0].clamp_max(1.0), None, chained[1]
    if draws is None or q_x is None:
        q_kids = (torch.ones_like(p[..., 0]),) * width  # (B, I) one-hot proposals
    else:
        q_kids, q_draws = q_x.unbind(-1), draws.unbind(2)
    tested = usable.to(p.dtype)[..., None].unbind(-2)  # K x (B, I, 1): 1 where the slot is tested
    kid_tokens = inputs.kid_tokens[..., None].unbind(-2)  # K x (B, I, 1), to gather with
    kid_x = inputs.kid_tokens.unbind(-1)  # K x (B, I): one op, not a select per slot
    a0s, wants = [], []
    for c in range(width):
        slot = SlotInputs(c, p, kid_x[c], kid_tokens[c], q_kids[c], None if q_draws is None else q_draws[c])
        test = rule.test_slot(inputs, state, slot)
        a0s.append(test.a0)
        if test.want is not None:  # budgeted rules only
            wants.append(test.want)
        # untested slots keep p: lerp by 0 or 1 is exact, and a quarter of the time of a broadcast `where`
        p = torch.lerp(p, normalise_or_uniform(test.residual), tested[c])
    # rules leave a0 above 1 where it means 1: one clamp for every slot
    return torch.stack(a0s, -1).clamp_max(1.0), torch.stack(wants, -1) if wants else None, p


def draw_distributions(inputs: TreeInputs) -> Tensor:
    """Sampled drafts: (B, I, K, V) q_c, the distribution each slot's child was drawn from: q at the parent without
    the earlier children's tokens, over the mass left (`TreeInputs.q_mass_left`); 0 on untested slots.

    One scatter_add of the earlier children's negated mass onto q copied K times: a removed token is exactly 0, and
    a padding slot's token, which may repeat a child's, only lands on untested slots (every slot after an untested
    one is untested), which the final product zeroes."""
    q, tokens = inputs.q_parent, inputs.kid_tokens  # (B, I, V), (B, I, K)
    if q is None or inputs.q_mass_left is None:
        raise ValueError("draw_distributions needs a sampled tree's TreeInputs (q_parent, q_mass_left)")
    width = tokens.shape[-1]
    removed = q.gather(2, tokens)[:, :, None, :] * _minus_earlier(width, q.device)  # (B, I, K, K) [c, c']: c' < c
    copies = q[:, :, None, :].expand(-1, -1, width, -1)  # (B, I, K, V)
    draws = copies.scatter_add(3, tokens[:, :, None, :].expand(-1, -1, width, -1), removed)
    return draws.mul_((inputs.usable / inputs.q_mass_left)[..., None])  # in place: the copy is new


@functools.lru_cache(maxsize=8)
def _minus_earlier(width: int, device: torch.device) -> Tensor:
    """(K, K) float [c, c']: -1 where slot c' comes before slot c, else 0; a shared constant, never written to."""
    return -strictly_lower(width, device).float()


def sampled_slots(
    inputs: TreeInputs, draws: Tensor, q_x: Tensor, reads: Tensor | None = None, packed: Tensor | None = None
) -> tuple[SlotInputs, Tensor]:
    """Sampled drafts under a rule whose rejection leaves the exact residual: every slot's residual target p_c at
    once, as `SlotInputs` with a K axis, and the residual after every child, (B, I, V). p_c is (B, I, K, V), or,
    for a rule that reads it at a few tokens only (`reads` (B, I, K, T), among them x), (B, I, K, T) gathered as
    the chain runs: no (B, I, K, V) stack (on a CPU its copy and division cost more than the chain). With `packed`
    (B, J) (`packed_slots`), only those slots: p_c and q_c (B, J, V), x and q_x (B, J).

    p_{c+1} = norm(relu(p_c - q_c)) is kept unnormalised, r_{c+1} = relu(r_c - sum(r_c) q_c) (then p_c = r_c /
    sum(r_c)): three ops a slot, no per-slot normalising. An untested slot has q_c = 0 and leaves r as it is. A
    residual that is all zero (p_c = q_c up to rounding, where a rejection has probability 0) stays zero: the
    later slots see p_c = 0 and accept nothing, and the correction falls back to uniform (`normalise_or_uniform`).
    """
    residual = inputs.probs  # (B, I, V), normalised
    tokens = inputs.kid_tokens  # (B, I, K)
    at = None if reads is None else reads.unbind(2)  # K x (B, I, T)
    width = tokens.shape[-1]
    kept, totals = [], []
    # where p_c is read over V: every r_c in one (B, I, K, V) table, written by the chain itself (no stack copies it)
    chain: Tensor | None = None
    if at is None:
        chain = residual.new_empty(*tokens.shape, residual.shape[-1])
        kept = list(chain.unbind(2))
        kept[0].copy_(residual)
    for c, q_c in enumerate(draws.unbind(2)):  # (B, I, V) each
        # the first slot sees the target as it is (total 1, as in the slot loop), the later ones r_c / sum(r_c)
        total = _ones(tuple(tokens.shape[:2]), residual.device) if c == 0 else residual.sum(-1, keepdim=True)
        if at is not None:
            kept.append(residual.gather(2, at[c]))
        totals.append(total)
        residual = chain_step(residual, q_c, total, None if at is not None or c + 1 == width else kept[c + 1])
    after = normalise_or_uniform(residual)
    if packed is not None and chain is not None:  # the tested slots' rows of the (B, I K, .) tables, divided alone
        rows = packed[..., None]  # (B, J, 1)
        vocab_rows = rows.expand(-1, -1, residual.shape[-1])  # (B, J, V), one index for p and q_c
        p = chain.flatten(1, 2).gather(1, vocab_rows)  # (B, J, V)
        p = p / torch.stack(totals, 2).flatten(1, 2).gather(1, rows).clamp_min(1e-30)
        x = pack_slots(tokens, packed)  # (B, J)
        q_c = draws.flatten(1, 2).gather(1, vocab_rows)  # (B, J, V)
        return SlotInputs(None, p, x, x[..., None], pack_slots(q_x, packed), q_c, packed), after
    stacked = torch.stack(kept, 2) if chain is None else chain  # (B, I, K, V or T)
    p = stacked / torch.stack(totals, 2).clamp_min(1e-30)  # 0 past an all-zero residual
    # with reads the rule knows where x sits among them: x_column (an index over V) is not for its p
    return SlotInputs(None, p, tokens, tokens[..., None], q_x, draws if reads is None else None), after


@functools.lru_cache(maxsize=8)
def _ones(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """(*shape, 1) float ones; a shared constant, never written to."""
    return torch.ones(*shape, 1, device=device)


def removal_slots(inputs: TreeInputs) -> tuple[RemovalSlots, Tensor]:
    """Deterministic drafts under a rule whose rejection removes x: every slot's p_c(x) and normaliser at once,
    and the residual after every child, (B, I, V). What `slot_tables`' loop computes, in a dozen ops.

    The mass left before slot c is what was never removed plus the tested children's from slot c on, summed
    from the last slot back, so that where a child takes all the mass left its p_c(x) is exactly 1 (as in the
    loop, which divides that child's mass by itself)."""
    p, tokens = inputs.probs, inputs.kid_tokens  # (B, I, V), (B, I, K)
    # p(x) (B, I, K), 0 where untested (duplicates, padding, too deep); p without the tested children's tokens
    p_kids, removed, mass_left = mass_left_by_slot(p, tokens, inputs.usable)
    before = strictly_lower(tokens.shape[-1], p.device)  # (K, K) [c, c']: c' < c
    # 0 / 0 only past a child that took all the mass left (accepted with probability 1: never reached)
    p_x = (p_kids / mass_left).nan_to_num_(0.0)
    return RemovalSlots(p, p_x, mass_left, before), normalise_or_uniform(removed)


def verify(
    tree: Tree, view: TargetView, rule: Rule, uniforms: Uniforms, max_accept: Tensor | None = None, greedy: bool = False
) -> Verdict:
    """Verify B drafted trees after one target forward over their nodes. No host-device sync.

    Args:
        tree: the drafted trees (node 0 = root).
        view: target distributions (and greedy tokens) at every node or at the inner nodes (`TargetView`),
            CASCADE features at every node.
        rule: the verification rule (`inference.decoding.rules`).
        uniforms: pre-drawn randomness: uniforms.accept[b, d, c] decides the test of child c of the
            depth-d node on row b's walk.
        max_accept: (B,) accept at most this many drafts per row (image end); None = no limit.
        greedy: temperature-0 decoding (deterministic drafts).
    """
    if view.nodes is not None and needs_every_node(rule):
        raise ValueError(f"{rule.name} reads the target at every node (needs_every_node): the TargetView covers some")
    inputs = prepare_tree(tree, view, max_accept)
    tables = inputs.tables
    batch, num_nodes = tree.tokens.shape
    device = inputs.probs.device
    rows = tables.rows
    paths = tree.paths  # (B, N, P) root-to-node paths, -1 padded
    charge: Tensor | None = None  # (B, I, K) the budget each test takes, budgeted rules only
    if greedy:
        passed = _greedy_tests(rule, inputs, _greedy_tokens(view))
        tested = inputs.usable
        chance = passed.float()
    else:
        a0, want, residual = slot_tables(rule, inputs)
        # only a budgeted rule asks for more than a0 (<= 1): the others' chance is a0 and they charge nothing
        charge = _budget(rule, tree, inputs, want) if want is not None and isinstance(rule, CascadeRule) else None
        chance = a0 if charge is None else (a0 + charge).clamp_max(1.0)  # (B, I, K)
        draws = uniforms.accept.gather(1, tables.uniform_row)  # (B, I, K)
        ok = inputs.usable & (draws < chance)
        accepted_so_far = ok.long().cumsum(-1)  # (B, I, K) accepted children up to and including each slot
        first = ok & (accepted_so_far == 1)  # the first accepted child of every node
        passed = first
        tested = inputs.usable & ((accepted_so_far == 0) | first)  # tests made: up to the first accept
    # A node is accepted iff it passed its parent's test and so did every ancestor; take the deepest.
    # (B, N + 1): the root passed, each child as its test went (no child is node 0), padding into column N
    node_passed = _only_the_root(batch, num_nodes + 1, device).scatter(1, tables.child_or_dump, passed.flatten(1))
    path_ok = (node_passed[:, :num_nodes].gather(1, tables.path_index).view_as(paths) | tables.off_path).all(-1)
    # (B,) the deepest accepted node, the first in node order: deepest_first is 0 at the root only, so the root
    # wins where nothing else passed
    last_node = (tables.deepest_first * path_ok).argmax(-1)
    walk = paths[rows, last_node]  # (B, P) nodes of the walk: their children were tested
    last_row = last_node
    if view.node_row is not None:  # rows of the view (-1 for padding); the last node may be a leaf, outside it
        walk, last_row = view.node_row[walk], view.node_row[last_node]
    walk_ok, walk_rows = walk >= 0, walk.clamp_min(0)
    made = tested[rows[:, None], walk_rows] & walk_ok[..., None]  # (B, P, K)
    accept_prob = torch.where(made, chance[rows[:, None], walk_rows], float("nan"))[:, : tree.max_depth]
    if charge is None:
        tv_charged = torch.zeros(batch, device=device)
    else:
        tv_charged = (charge[rows[:, None], walk_rows] * made).sum((1, 2))
    ends_at_leaf = None
    if view.node_row is not None:
        ends_at_leaf, last_row = last_row < 0, last_row.clamp_min(0)  # (B,) the view does not cover the last node
    if greedy:
        final = inputs.probs[rows, last_row]
        next_token = _greedy_tokens(view)[rows, last_row]
    else:
        final = residual[rows, last_row]  # all children rejected, or none to test (then it is the target)
    if ends_at_leaf is not None and view.at_leaf is not None:  # a walk that ends at a leaf takes the target there
        leaf_probs, leaf_greedy = view.at_leaf(last_node)  # (B, V), (B,)
        final = torch.where(ends_at_leaf[:, None], leaf_probs.to(final.dtype), final)
        if greedy:
            next_token = torch.where(ends_at_leaf, leaf_greedy, next_token)
    if not greedy:
        next_token = sample_inverse_cdf(final, uniforms.bonus)
    return Verdict(last_node, tree.depths[rows, last_node], next_token, tv_charged, accept_prob, final)


@functools.lru_cache(maxsize=16)
def _only_the_root(batch: int, width: int, device: torch.device) -> Tensor:
    """(batch, width) bool, True in column 0 only; a shared constant, never written to."""
    return torch.arange(width, device=device).expand(batch, -1) == 0


def _budget(rule: CascadeRule, tree: Tree, inputs: TreeInputs, want: Tensor) -> Tensor:
    """Charges (B, I, K) granted in test order along every walk, within the rule's TV budget (CASCADE)."""
    want = want * inputs.usable
    before_here = want.cumsum(-1) - want  # (B, I, K) wants of earlier siblings
    # what the tests that lead to node n took, uncapped: for each ancestor edge, the parent's earlier
    # children and the edge's own want
    batch, num_nodes = tree.tokens.shape
    tables = inputs.tables
    through = torch.zeros(batch, num_nodes + 1, device=want.device)
    through.scatter_(1, tables.child_or_dump, want.cumsum(-1).flatten(1))
    through = through[:, :num_nodes]  # (B, N) uncapped want of the tests up to and including n's own
    on_path = tables.parent_on_path  # (B, I, P) paths to the nodes whose children are tested
    to_node = (through.gather(1, tables.parent_path_index).view_as(on_path) * on_path).sum(-1)  # (B, I)
    spent = to_node[..., None] + before_here  # (B, I, K) uncapped want taken before each test
    delta = rule.delta
    return (spent + want).clamp_max(delta) - spent.clamp_max(delta)


def _greedy_tests(rule: Rule, inputs: TreeInputs, greedy_tokens: Tensor) -> Tensor:
    """(B, I, K) bool: each child passes its parent's greedy test against the unmodified target."""
    is_argmax = inputs.kid_tokens == greedy_tokens[..., None]
    if isinstance(rule, ExactRule):
        return inputs.usable & is_argmax
    state: Any = rule.prepare(inputs)  # the rule's own per-step tables
    p = inputs.probs
    passes = []
    for c in range(inputs.children.shape[-1]):
        x = inputs.kid_tokens[..., c]
        slot = SlotInputs(c, p, x, x[..., None], torch.ones_like(x, dtype=p.dtype), None)
        mass = rule.greedy_mass(inputs, state, slot)
        others = p.scatter(2, x[..., None], 0.0).amax(-1)
        passes.append(mass > others)
    return inputs.usable & (is_argmax | torch.stack(passes, -1))


def _greedy_tokens(view: TargetView) -> Tensor:
    if view.greedy_tokens is None:
        raise ValueError("greedy verification needs TargetView.greedy_tokens, the argmax of the guided logits")
    return view.greedy_tokens
