"""What a verification rule sees: the tree's tables at the parent nodes, once per step, and one child slot at a time;
what it answers (`SlotTest`); and the arithmetic every rule shares (the exact test and residual, the mass above a
child at its parent).

`inference.decoding.verify` builds the inputs; the rules (`inference.decoding.rules`,
`inference.decoding.peer_rules`) read them. Shapes: B rows, N tree nodes, I parent nodes (the nodes with children,
or all N), K child slots, V vocabulary, D feature width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.decoding.similarity import mass_above
from inference.decoding.tree import Tree, WalkTables, select


@dataclass
class SlotInputs:
    """What a rule sees when the c-th child of every node is tested (`slot` = c; the shapes below), or, for a rule's
    closed form on sampled drafts (`acceptance_sampled`), every child slot at once (`slot` None: each tensor has a
    K axis after I, e.g. p (B, I, K, V), q_x (B, I, K)). Rules index the vocabulary as dim -1 to serve both. A rule
    that names the tokens it reads (`sampled_reads`) gets p (B, I, K, T) at those tokens only, in its own order
    (it knows where x sits among them: x_column, an index over V, is not for that p), and no q_draw. One that reads
    p_c over the vocabulary gets, on a tree with mostly empty slots, only the tested ones (`packed`): (B, J, V)."""

    slot: int | None
    p: Tensor  # (B, I, V) current residual target at every parent node (normalised)
    x: Tensor  # (B, I) token of each node's c-th child (any value where the slot is empty)
    x_column: Tensor  # (B, I, 1) the same tokens, as a gather/scatter index over V
    q_x: Tensor  # (B, I) probability with which x was proposed (1 for deterministic drafts); > 0 on usable
    # slots, 1 on the others (`verify` zeroes their acceptance), so rules divide by it unguarded
    q_draw: Tensor | None  # (B, I, V) normalised distribution x was drawn from (sampled trees), else None
    packed: Tensor | None = None  # (B, J) with every slot at once on a sparse tree: the tested slots' positions
    # i K + c in (B, I, K), and the tensors above hold those J slots only, (B, J, ...) (`packed_slots`)

    @functools.cached_property
    def p_x(self) -> Tensor:
        """(B, I) p(x); gathered only for a rule that reads it (LANTERN reads it with x's neighbours)."""
        return self.p.gather(-1, self.x_column)[..., 0]


@dataclass
class TreeInputs:
    """The verification problem, prepared once per step by `inference.decoding.verify`.

    Its tables have one row per parent node: the nodes the target view covers (`nodes`, the tree's
    inner nodes), or every node when `nodes` is None. Children, paths and features are node ids and
    per-node values over all N nodes.
    """

    tree: Tree
    probs: Tensor  # (B, I, V) unmodified target distribution at the parent nodes
    features: Tensor | None  # (B, N, D) similarity features (CASCADE), cond branch, at every node
    children: Tensor  # (B, I, K) children in test order, -1 padded
    kid_tokens: Tensor  # (B, I, K)
    usable: Tensor  # (B, I, K) bool: the slot is tested when reached
    nodes: Tensor | None = None  # (I,) the parent nodes; None = every node (I = N)
    kid_q: Tensor | None = None  # (B, I, K) each child's conditional draw probability (sampled trees)
    node_row: Tensor | None = None  # (N + 1,) int64 each node's row when `nodes` is set (-1: none, and at index N)
    q_parent: Tensor | None = None  # (B, I, V) fp32 the drafter's q at the parent nodes (sampled trees)
    q_mass_left: Tensor | None = None  # (B, I, K) q's mass outside the earlier children's tokens (sampled trees)

    @property
    def tables(self) -> WalkTables:
        """The tree's index tables over these parents (built once per tree, or per static shape)."""
        return self.tree.walk_tables(self.nodes)

    def at_parents(self, x: Tensor) -> Tensor:
        """Per-node values (B, N, ...) -> (B, I, ...) at the parent nodes."""
        return select(x, self.nodes)

    def parent_row(self) -> Tensor:
        """(B, N) int64: the row of each node's parent in the (B, I, ...) tables (0 for the root, which has none)."""
        parents = self.tree.parents  # (B, N), -1 at the root
        if self.node_row is not None:  # rows are some nodes only: node_row's trailing -1 takes the root's -1
            parents = self.node_row[parents]
        return parents.clamp_min(0)

    def at_children(self, x: Tensor) -> Tensor:
        """Per-node values (B, N) -> (B, I, K): each child slot's node's value (node 0's on empty slots)."""
        return self.tables.at_children(x)


@dataclass
class RemovalSlots:
    """Every child slot of deterministic drafts at once, for a rule whose rejection removes x (the exact residual).

    The c-th test then sees p_c = p with the tokens of the earlier tested siblings removed, renormalised:
    p_c(y) = p(y) / mass_left[c] for a token y not removed before slot c, 0 for one that was. No loop over
    the slots is needed (`inference.decoding.verify.removal_slots` builds this in a dozen ops).
    """

    p: Tensor  # (B, I, V) unmodified target at the parent nodes
    p_x: Tensor  # (B, I, K) p_c(x_c): each child's probability under the residual its test sees, 0 untested
    mass_left: Tensor  # (B, I, K) p's mass not removed before slot c (p_c's normaliser)
    removed_before: Tensor  # (K, K) bool [c, c']: slot c' is tested before slot c (with `usable`: its token is gone)


@dataclass
class SlotTest:
    """A rule's answer for the c-th child of every parent node."""

    a0: Tensor  # (B, I) acceptance probability of x; a value above 1 means 1 (`verify` clamps all slots at once)
    want: Tensor | None  # (B, I) extra acceptance a budgeted rule asks for on top of a0; None for the others
    residual: Tensor  # (B, I, V) the target after x is rejected, unnormalised


def descending_ranks(p: Tensor) -> tuple[Tensor, Tensor]:
    """Order (..., V) of p, most likely first (stable), and each token's rank in it."""
    order = p.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(p.shape[-1], device=p.device).expand_as(order))
    return order, ranks


def packed_slots(inputs: TreeInputs) -> Tensor | None:
    """(B, J) the positions i K + c of every tested slot in the (B, I, K) tables, padded with untested ones, for a
    tree whose slots are mostly empty; None where they are not. J is the tree's N - 1 children, a bound that needs
    no sync: every non-root node is one parent's child. A dynamic tree gives each of its I parents K = top_k slots
    and fills about one in ten (the sampled dynamic tree 10/5/60: 54 of 550 a row), so a rule that reads p_c over
    the vocabulary works on 54 rows, not 550. Packing costs about 20 ops a step, so it runs where J <= I K / 4 only
    (not on the toy's default tree: 8 children, 9 x 2 slots)."""
    parents, width = inputs.usable.shape[1:]
    most = inputs.tree.num_nodes - 1
    if 4 * most > parents * width:
        return None
    return inputs.usable.flatten(1).float().topk(most, dim=1, sorted=False).indices  # the J tested ones first


def pack_slots(values: Tensor, packed: Tensor) -> Tensor:
    """Per-slot values (B, I, K, ...) at the `packed` slots (`packed_slots`) only: (B, J, ...); `unpack_slots` puts
    answers back."""
    flat = values.flatten(1, 2)  # (B, I K, ...)
    if flat.dim() == 2:
        return flat.gather(1, packed)
    return flat.gather(1, packed.view(*packed.shape, *(1,) * (flat.dim() - 2)).expand(-1, -1, *flat.shape[2:]))


def unpack_slots(values: Tensor, packed: Tensor, usable: Tensor) -> Tensor:
    """A rule's (B, J, ...) answers for `packed` slots back in place, (B, I, K, ...) like `usable`, 0 on the slots not
    packed (untested: `verify` does not read them)."""
    if values.dim() == 2:  # the general form below would add a view and an expand: two ops a step
        return values.new_zeros(usable.shape).flatten(1).scatter_(1, packed, values).view_as(usable)
    trailing = values.shape[2:]
    index = packed.view(*packed.shape, *(1,) * len(trailing)).expand_as(values)
    table = values.new_zeros(usable.shape[0], usable[0].numel(), *trailing)
    return table.scatter_(1, index, values).view(*usable.shape, *trailing)


def exact_acceptance(inputs: SlotInputs) -> Tensor:
    """min(1, p(x) / q(x)) (q(x) > 0 on every slot `verify` tests)."""
    return (inputs.p_x / inputs.q_x).clamp_max(1.0)


def exact_residual(p: Tensor, x_column: Tensor, q_draw: Tensor | None) -> Tensor:
    """relu(p - q_draw) (recursive rejection sampling); deterministic drafts (q one-hot at x, given (B, I, 1)): p with
    x removed."""
    if q_draw is None:
        return p.scatter(-1, x_column, 0.0)
    return torch.relu(p - q_draw)


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


def normalise_or_uniform(p: Tensor) -> Tensor:
    """Renormalise (..., V); an all-zero residual falls back to uniform over the (image) vocabulary (§8)."""
    # 0 / 0 = NaN marks exactly the all-zero rows (p is finite and >= 0); elementwise, a quarter of the
    # time of a `where` that broadcasts a per-row condition over V on this CPU
    return (p / p.sum(-1, keepdim=True)).nan_to_num_(nan=1.0 / p.shape[-1])


def chain_step(residual: Tensor, q_draw: Tensor, total: Tensor, out: Tensor | None = None) -> Tensor:
    """One rejection of a sampled child, on the residual kept unnormalised: r (B, I, V) with total = sum(r) (B, I, 1)
    and the draw's q_c (B, I, V) -> relu(r - total q_c) = total relu(p_c - q_c), p_c = r / total (in place on a new
    tensor, or on `out`, a (B, I, V) view of a table of every slot's: two ops). q_c = 0 (an untested slot) leaves r
    as it is."""
    return torch.addcmul(residual, q_draw, total, value=-1.0, out=out).relu_()
