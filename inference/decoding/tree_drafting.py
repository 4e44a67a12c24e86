"""Drafting a tree with a drafter (`inference.decoding.drafter.Drafter`) for one verification step (docs/method.md,
section "Drafting a tree").

Three tree kinds, each one drafter call per level with children:

- `draft_static_tree`: EAGLE-1's fixed shape (`StaticTreeSpec`), children drawn without replacement from
  q (or q's top ranks, greedy); everything that depends only on the shape (level plans, the drafter's
  whole-tree attention bias, the race draws of every level) is built once per tree or once per shape;
- `draft_dynamic_tree`: EAGLE-2's expansion by cumulative log q, deterministic drafts;
- `draft_sampled_dynamic_tree`: the same expansion with children drawn from q.

q over the vocabulary is written once per tree for the nodes the drafter ran on (`q_over_nodes`). The
samplers they share: `gumbel_topk` (draws without replacement, with its `exponential_race`) and the
dynamic trees' selections (`select_dynamic_tree`, `select_sampled_slots`).

Shapes: B prompts, R rows (2B with CFG), W nodes of a level, M drafted nodes, N tree nodes, V vocabulary,
K children per node, S the support of a `Proposal` (top-k).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.decoding.drafter import DraftContext, attention_bias, to_rows
from inference.decoding.sampling import Proposal
from inference.decoding.tree import StaticTreeSpec, Tree, node_range, select


def draft_static_tree(
    ctx: DraftContext,
    spec: StaticTreeSpec,
    root_token: Tensor,
    root_q: Proposal,
    root_hidden: Tensor,
    greedy: bool,
    generator: torch.Generator | None,
) -> Tree:
    """Draft an EAGLE-1 static tree (docs/method.md, section "Drafting a tree"): node "child c" of a parent takes the
    parent's c-th draw.

    Sampling mode draws without replacement from q (Gumbel-top-k); greedy mode takes q's top-k in
    rank order (deterministic drafts). One drafter call per level with children; each level's nodes are
    contiguous, so its tokens are gathered once and concatenated at the end, and q over the vocabulary is
    written once for every inner node.

    Args:
        root_token: (B,); root_q: (B, V) processed drafter distribution at the root (`Proposal`);
        root_hidden: (R, D) the drafter's hidden at the root.
    """
    batch, device = root_token.shape[0], root_token.device
    vocab = root_q.size
    if spec.max_children > vocab:
        raise ValueError(f"the static tree draws {spec.max_children} children per node from {vocab} tokens")
    token_levels = [root_token[:, None]]  # per level (B, L)
    inner_q = [root_q[:, None]]  # q of every node the drafter ran on, in node order: (B, W, k) per level
    level_q, level_hidden = root_q[:, None], root_hidden[:, None]  # level d-1 state
    tree_start = ctx.cache.length
    # the drafter's whole mask for this tree, built once: the committed columns' validity, then the inner
    # nodes' ancestor-or-self mask; each level passes its rows' slice (views, no mask built per level)
    run_mask = spec.run_mask(device)  # (M, M)
    rows, drafted = ctx.cache.rows, run_mask.shape[0]
    attention = torch.cat(
        [ctx.cache.column_valid[:, None, :tree_start].expand(rows, drafted, -1), run_mask.expand(rows, -1, -1)], dim=-1
    )  # (R, M, tree_start + M)
    # and as the additive bias attention adds, so that no drafter call converts its slice again
    bias = attention_bias(attention, ctx.cache.entries.dtype)  # (R, M, tree_start + M)
    # every level's race at once: level 1 draws from the root's q, level d from level d - 1's drafted rows
    race = None
    if not greedy and level_q.probs.shape[-1] >= spec.max_children:  # else the race runs over the vocabulary
        race = exponential_race((batch, 1 + drafted, level_q.probs.shape[-1]), device, generator)  # (B, 1 + M, S)
    race_rows = slice(0, 1)
    for depth, level in enumerate(spec.plan(device), start=1):
        if greedy:
            draws = level_q.ranked(level.width)  # (B, W_prev, width)
        else:  # (B, W_prev, width)
            draws = gumbel_topk(level_q, level.width, generator, None if race is None else race[:, race_rows])
        level_tokens = select(draws.flatten(1), level.draw)  # (B, L)
        token_levels.append(level_tokens)
        if depth == spec.max_depth:
            break
        columns = tree_start + level.run_rows.stop
        level_q, level_hidden = ctx.run_level(
            select(level_hidden, level.hidden_slot),
            select(level_tokens, level.expanded_slot),
            depth,
            tree_start,
            attention[:, level.run_rows, tree_start:columns],  # the draft columns: `tree_mask` of `Drafter.forward`
            bias[:, level.run_rows, :columns],  # (R, W, tree_start + J + W)
        )
        inner_q.append(level_q)
        race_rows = slice(1 + level.run_rows.start, 1 + level.run_rows.stop)
    structure = spec.structure(device)
    return Tree(
        torch.cat(token_levels, dim=1),
        structure.parents.expand(batch, -1),
        structure.depths.expand(batch, -1),
        q_over_nodes(inner_q, structure.inner_nodes, spec.num_nodes, vocab),
        sampled=not greedy,
        max_depth=spec.max_depth,
        max_children=spec.max_children,
        distinct_siblings=True,  # top-k or Gumbel-top-k of one q per parent
    ).with_structure(structure, spec.walk_memo(device, batch))


def q_over_nodes(inner_q: list[Proposal], inner_nodes: Tensor, num_nodes: int, vocab: int) -> Tensor:
    """q over the vocabulary at every node, (B, N, V): each drafted node's (`inner_q`, per level (B, W, .),
    in the order of `inner_nodes`), zero elsewhere. `inner_nodes` is (I,), ascending (a static tree's inner
    nodes), or (B, I) per row (a dynamic tree's), where N may stand for a dump row past the tree. Under
    top-k one scatter writes them all."""
    probs = torch.cat([q.probs for q in inner_q], dim=1)  # (B, I, k) or (B, I, V)
    batch = probs.shape[0]
    if probs.shape[1] != inner_nodes.shape[-1]:
        raise ValueError(f"{probs.shape[1]} drafted nodes for a tree of {inner_nodes.shape[-1]} inner nodes")
    if all(q.support is not None for q in inner_q):
        support = torch.cat([q.support for q in inner_q if q.support is not None], dim=1)  # (B, I, k)
        flat = (inner_nodes[..., None] * vocab + support).flatten(1)  # (B, I k) positions in the (N V) rows
        return probs.new_zeros(batch, num_nodes * vocab).scatter_(1, flat, probs.flatten(1)).view(batch, num_nodes, -1)
    dense = torch.cat([q.dense() for q in inner_q], dim=1)  # (B, I, V)
    if inner_nodes.dim() == 1:
        return dense.new_zeros(batch, num_nodes, vocab).index_copy_(1, inner_nodes, dense)
    rows = inner_nodes[..., None].expand(-1, -1, vocab)  # (B, I, V)
    return dense.new_zeros(batch, num_nodes, vocab).scatter_(1, rows, dense)


@functools.lru_cache(maxsize=16)
def _candidate_depths(top_k: int, depth: int, device: torch.device) -> Tensor:
    """(M,) depth of every dynamic-tree candidate: top_k at depth 1, then top_k ** 2 per level, built once."""
    counts = [top_k] + [top_k * top_k] * (depth - 1)
    levels = [torch.full((count,), level, dtype=torch.long) for level, count in enumerate(counts, start=1)]
    return torch.cat(levels).to(device)


def draft_dynamic_tree(
    ctx: DraftContext,
    root_token: Tensor,
    root: Proposal,
    root_hidden: Tensor,
    top_k: int,
    depth: int,
    total_tokens: int,
) -> Tree:
    """Draft an EAGLE-2 dynamic tree (docs/method.md, section "Drafting a tree"). Drafts are deterministic (q = 1).

    Level 1 is the top-k of q at the root; each further level expands the top-k frontier nodes by
    their top-k children, scored by cumulative log q, and keeps the top-k as the next frontier;
    finally the `total_tokens` best nodes (root included) form the tree. depth - 1 drafter calls.
    Each level only ranks q's own support (under top-k) and notes which candidates it ran on; the
    candidates' parents and depths and q over the vocabulary at the kept nodes are written once, at the end.

    Args:
        root_token: (B,); root: (B, V) processed drafter distribution at the root (`Proposal`);
        root_hidden: (R, D) the drafter's hidden at the root.
    """
    batch, vocab, device = root_token.shape[0], root.size, root_token.device
    k = top_k
    if k > vocab:
        raise ValueError(f"top_k={k} exceeds the vocabulary of {vocab} tokens; lower DecoderConfig.top_k")
    scores, toks = _log_top(root, k)  # (B, K)
    cand_tokens, cand_scores = [toks], [scores]
    frontiers: list[Tensor] = []  # per level (B, K): the candidates the drafter ran on
    ran_q = [root[:, None]]  # q of every node the drafter ran on: the root, then K per level
    frontier = torch.arange(k, device=device).expand(batch, -1)  # (B, K) candidate ids
    hidden_slot = torch.zeros(batch, k, dtype=torch.long, device=device)  # parent's slot in prev_hidden
    prev_hidden = root_hidden[:, None]  # (R, 1, D)
    masks = FrontierMasks.at_root(ctx)
    base = k  # candidates listed before this level's children
    for level in range(1, depth):
        parent_rows = to_rows(hidden_slot, ctx.cfg)  # (R, K) each node's parent among the previous frontier
        masks = masks.children(parent_rows)
        proposal, prev_hidden = ctx.run_level(
            prev_hidden[masks.row_index, parent_rows],
            toks,
            level,
            masks.tree_start,
            masks.tree_mask_for(ctx),
            masks.bias,
        )
        ran_q.append(proposal)
        frontiers.append(frontier)
        child_scores, child_tokens = _log_top(proposal, k)  # (B, K, K)
        child_scores = scores[..., None] + child_scores
        cand_tokens.append(child_tokens.flatten(1))  # (B, K*K)
        cand_scores.append(child_scores.flatten(1))
        scores, best = child_scores.flatten(1).topk(k, dim=-1)  # (B, K) next frontier, best first
        toks = child_tokens.flatten(1).gather(1, best)
        frontier, hidden_slot = base + best, best // k
        base += k * k
    ran = torch.cat(frontiers, dim=1) if frontiers else hidden_slot[:, :0]  # (B, (depth - 1) K) candidates run on
    # a level's K*K children are listed by (frontier slot, rank): child i*K + j has parent frontier[i]
    cand_parents = torch.cat(
        [torch.full((batch, k), -1, dtype=torch.long, device=device), ran[..., None].expand(-1, -1, k).flatten(1)],
        dim=1,
    )  # fmt: skip
    tokens, parents, depths, node_of = select_dynamic_tree(
        root_token,
        torch.cat(cand_tokens, 1),
        torch.cat(cand_scores, 1),
        cand_parents,
        _candidate_depths(k, depth, device).expand(batch, -1),
        total_tokens,
    )
    num_nodes = tokens.shape[1]
    # q at the root (node 0) and at each candidate the drafter ran on that the tree kept; the others to a dump row
    ran_nodes = node_of.gather(1, ran)  # (B, (depth - 1) K), -1 where not kept
    nodes = torch.cat([torch.zeros_like(ran_nodes[:, :1]), torch.where(ran_nodes >= 0, ran_nodes, num_nodes)], 1)
    q_full = q_over_nodes(ran_q, nodes, num_nodes + 1, vocab)[:, :num_nodes]
    return Tree(
        tokens,
        parents,
        depths,
        q_full,
        sampled=False,
        max_depth=depth,
        max_children=k,
        distinct_siblings=True,  # one top-k per parent
    )


def _log_top(q: Proposal, k: int) -> tuple[Tensor, Tensor]:
    """log q of q's k likeliest tokens (-1e30 for zeros, which keeps sums finite) and their ids, (..., k) each."""
    probs, tokens = q.top(k)
    return probs.log().clamp_min(-1e30), tokens  # log 0 = -inf; the least positive fp32 gives -103


def draft_sampled_dynamic_tree(
    ctx: DraftContext,
    root_token: Tensor,
    root: Proposal,
    root_hidden: Tensor,
    top_k: int,
    depth: int,
    total_tokens: int,
    greedy: bool,
    generator: torch.Generator | None,
) -> Tree:
    """Draft a sampled dynamic tree: EAGLE-2's expansion by cumulative log q, children drawn from q.

    Every level holds W = (total_tokens - 1) // depth nodes (level 1 at most top_k). Which child slots a
    level gets is decided before they are drawn (`select_sampled_slots`: parent's
    cumulative log q plus the log of q's c-th largest probability), so each node's children are a
    prefix of its draws without replacement and recursive rejection sampling verifies the tree
    losslessly. Greedy settings take q's top ranks instead (deterministic drafts). depth - 1 drafter calls.

    Args:
        root_token: (B,); root: (B, V) processed drafter distribution at the root (`Proposal`);
        root_hidden: (R, D) the drafter's hidden at the root.
    """
    batch, vocab, device = root.probs.shape[0], root.size, root.probs.device
    k = top_k
    if k > vocab:
        raise ValueError(f"top_k={k} exceeds the vocabulary of {vocab} tokens; lower DecoderConfig.top_k")
    width = (total_tokens - 1) // depth
    if width < 1:
        raise ValueError(f"total_tokens={total_tokens} gives no node per level for depth {depth}")
    tokens, parents = [root_token[:, None]], [torch.full_like(root_token[:, None], -1)]
    level_proposal, level_hidden = root[:, None], root_hidden[:, None]  # (B, M, .) q, (R, M, D) of this level
    inner_q = [level_proposal]  # q of every node the drafter ran on, in node order: (B, M, S) per level
    level_scores = torch.zeros(batch, 1, device=device)  # (B, M) cumulative log q
    masks = FrontierMasks.at_root(ctx)
    # the levels' widths are known without a sync: level 1 at most k, each level at most its parents' k draws
    widths = [min(width, k)]
    for _ in range(depth - 1):
        widths.append(min(width, widths[-1] * k))
    rows_drawn_from = [1, *widths[:-1]]  # M: the nodes each level draws its children from
    race = None
    if not greedy and level_proposal.probs.shape[-1] >= k:  # every level's race at once, as the static tree does
        race = exponential_race((batch, sum(rows_drawn_from), level_proposal.probs.shape[-1]), device, generator)
    offset = 0
    for level, (level_width, drawn_from) in enumerate(zip(widths, rows_drawn_from, strict=True), start=1):
        if greedy:  # (B, M, K) q's k largest, likeliest first, and their tokens
            sorted_q, draws = level_proposal.top(k)
            drawn_q = sorted_q
        else:  # (B, M, K) in draw order, and q of each
            sorted_q = level_proposal.largest(k)
            level_race = None if race is None else race[:, offset : offset + drawn_from]
            draws, drawn_q = gumbel_topk_with_q(level_proposal, k, generator, level_race)
        picked = select_sampled_slots(level_scores, sorted_q, level_width)  # (B, W) slots n * K + c, a prefix per node
        parent_slot = picked // k  # (B, W) nodes ordered by (parent, rank): parents-first, draw order
        new_tokens = draws.flatten(1).gather(1, picked)
        tokens.append(new_tokens)
        parents.append(offset + parent_slot)
        child_q = drawn_q.flatten(1).gather(1, picked)  # (B, W) q(x) under the parent
        level_scores = level_scores.gather(1, parent_slot) + child_q.log()  # log 0 = -inf: a q = 0 draw sorts last
        offset += drawn_from
        if level == depth:
            break
        parent_rows = to_rows(parent_slot, ctx.cfg)  # (R, W)
        masks = masks.children(parent_rows)
        level_proposal, level_hidden = ctx.run_level(
            level_hidden[masks.row_index, parent_rows],
            new_tokens,
            level,
            masks.tree_start,
            masks.tree_mask_for(ctx),
            masks.bias,
        )
        inner_q.append(level_proposal)
    all_tokens = torch.cat(tokens, 1)
    num_nodes = all_tokens.shape[1]
    # the drafter ran on every node but the last level's: nodes 0 .. offset - 1, in node order
    q_full = q_over_nodes(inner_q, node_range(offset, device), num_nodes, vocab)
    depths = _level_depths(tuple(widths), device).expand(batch, -1)  # (B, N): the levels' widths fix it
    return Tree(
        all_tokens,
        torch.cat(parents, 1),
        depths,
        q_full,
        sampled=not greedy,
        max_depth=depth,
        max_children=k,
        distinct_siblings=True,  # one top-k (greedy) or one draw without replacement per parent
    )


@dataclass(frozen=True)
class FrontierMasks:
    """What the drafter attends to from each node of a dynamic tree's frontier, level by level.

    `bias` (R, W, start + J) is the additive attention bias (0 or -inf) over the committed columns and the
    J draft columns before the frontier's own W: the committed columns' validity, then the node's ancestors
    and itself. A level's mask is its parents' rows plus an identity block, one index and one concatenation,
    and the drafter gets it whole (`Drafter.forward`'s `attention_mask`: no per-level context concatenation,
    no bool-to-bias conversion inside attention, no validity marks for draft columns).
    """

    bias: Tensor  # (R, W, start + J) additive bias
    tree_start: int  # the first draft column
    row_index: Tensor  # (R, 1) arange: pairs with a (R, W) slot index to pick each row's parents

    @classmethod
    def at_root(cls, ctx: DraftContext) -> FrontierMasks:
        """The root's row (R, 1, start): it sees the committed columns that are valid."""
        cache = ctx.cache
        bias = attention_bias(cache.column_valid[:, None, : cache.length], cache.entries.dtype)
        return cls(bias, cache.length, _row_index(cache.rows, bias.device))

    def children(self, parent_rows: Tensor) -> FrontierMasks:
        """The next frontier, whose node w has parent `parent_rows[:, w]` (R, W') among this one's W."""
        own = _identity_bias(parent_rows.shape[1], self.bias.dtype, self.bias.device)  # (W', W')
        parents = self.bias[self.row_index, parent_rows]  # (R, W', start + J)
        return FrontierMasks(torch.cat([parents, own.expand(parents.shape[0], -1, -1)], dim=2), self.tree_start,
                             self.row_index)  # fmt: skip

    @property
    def tree_mask(self) -> Tensor:
        """(R, W, J + W) bool over the draft columns: `Drafter.forward`'s `tree_mask`."""
        return self.bias[:, :, self.tree_start :] == 0

    def tree_mask_for(self, ctx: DraftContext) -> Tensor | None:
        """`tree_mask`, or None for a drafter that reads the bias instead (`DraftContext.wants_tree_mask`)."""
        return self.tree_mask if ctx.wants_tree_mask else None


@functools.lru_cache(maxsize=16)
def _identity_bias(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(size, size) additive bias letting each node see only itself; a shared constant, never written to."""
    return attention_bias(torch.eye(size, dtype=torch.bool, device=device), dtype)


@functools.lru_cache(maxsize=16)
def _level_depths(widths: tuple[int, ...], device: torch.device) -> Tensor:
    """(1 + sum(widths),) int64 each node's depth: the root, then `widths[d - 1]` nodes at depth d; a shared
    constant, never written to."""
    counts = torch.tensor([1, *widths], device=device)
    return torch.repeat_interleave(torch.arange(len(counts), device=device), counts)


@functools.lru_cache(maxsize=16)
def _row_index(rows: int, device: torch.device) -> Tensor:
    """(rows, 1) arange; a shared constant, never written to."""
    return torch.arange(rows, device=device)[:, None]


def exponential_race(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> Tensor:
    """Exp(1) draws of shape `shape` for `gumbel_topk`'s race (fp32). A zero draw (if a device's sampler ever
    returned one) is clamped to the smallest normal number, so that q / draw never makes 0 / 0 = NaN."""
    race = torch.empty(shape, device=device, dtype=torch.float32).exponential_(generator=generator)
    return race.clamp_min_(torch.finfo(torch.float32).tiny)


def gumbel_topk(q: Proposal, k: int, generator: torch.Generator | None, race: Tensor | None = None) -> Tensor:
    """Draw k tokens from q without replacement, in draw order (Gumbel-top-k = sequential sampling).

    Child c is drawn with probability q(x_c) / (1 - sum_{c' < c} q(x_c')) (docs/method.md, section "Drafting a tree");
    verification reads that off q at the parent and the earlier siblings
    (`inference.decoding.verify.draw_probabilities`), so the drafter does not compute it.

    Args:
        q: probabilities (..., V), or under top-k those of its support's S tokens (`Proposal`): the race
            then runs over S tokens instead of V, with the same distribution (q is 0 elsewhere).
        race: `exponential_race` draws of q's shape, drawn before (a static tree draws every level's at
            once); None = draw them here.
    Returns:
        tokens (..., k) int64; tokens with q = 0 come last.
    """
    return _race(q, k, generator, race)[0]


def gumbel_topk_with_q(
    q: Proposal, k: int, generator: torch.Generator | None, race: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`gumbel_topk`'s tokens (..., k) and q of each (..., k), unconditional (the sampled dynamic tree scores them)."""
    tokens, ranked, weights = _race(q, k, generator, race)
    return tokens, weights.gather(-1, ranked)


def _race(q: Proposal, k: int, generator: torch.Generator | None, race: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The race's winners: tokens (..., k), their positions in the raced weights (..., k), the weights (..., S or V)."""
    weights, support = q.probs, q.support  # (..., S) or (..., V)
    if support is not None and support.shape[-1] < k:
        weights, support = q.dense(), None  # fewer candidates than draws: race over the whole vocabulary
    weights = weights.float()
    # log q + Gumbel ranks as q / Exp(1) does (the exponential race): no logs. q = 0 keys 0, last
    if race is None:
        race = exponential_race(weights.shape, weights.device, generator)
    elif race.shape != weights.shape:
        raise ValueError(f"race draws of shape {tuple(race.shape)} for probabilities of shape {tuple(weights.shape)}")
    ranked = (weights / race).topk(k, dim=-1).indices  # (..., k)
    return (ranked if support is None else support.gather(-1, ranked)), ranked, weights


def select_dynamic_tree(
    root_token: Tensor,
    cand_tokens: Tensor,
    cand_scores: Tensor,
    cand_parents: Tensor,
    cand_depths: Tensor,
    num_nodes: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """EAGLE-2's final step: keep the root and the num_nodes - 1 best-scoring candidates (docs/method.md, section
    "Drafting a tree").

    Candidates are listed level by level, each level ordered by (parent, rank), so a parent always
    precedes its children. Scores are cumulative log q and never increase along a path; a stable
    descending sort therefore keeps every kept node's parent (ties go to the earlier, shallower
    candidate), and sorting the kept ids restores the parents-first order.

    Args:
        root_token: (B,). cand_tokens, cand_scores, cand_parents, cand_depths: (B, M); cand_parents
            index candidates, -1 for children of the root.
    Returns:
        tokens, parents, depths (B, N) and node_of_candidate (B, M) int64 (-1 where not kept).
    """
    batch, num_candidates = cand_tokens.shape
    if not 1 <= num_nodes - 1 <= num_candidates:
        raise ValueError(f"total_tokens={num_nodes} needs 2..{num_candidates + 1} nodes (root included)")
    scores = cand_scores.float().nan_to_num(neginf=-1e30)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, : num_nodes - 1]  # (B, N-1)
    kept = order.sort(dim=-1).values  # (B, N-1) parents-first
    device = cand_tokens.device
    node_of = torch.full((batch, num_candidates + 1), -1, dtype=torch.long, device=device)
    node_of[:, :num_candidates].scatter_(1, kept, torch.arange(1, num_nodes, device=device).expand(batch, -1))
    parent_cand = cand_parents.gather(1, kept)  # (B, N-1)
    parent_node = torch.where(parent_cand >= 0, node_of.gather(1, parent_cand.clamp_min(0)), 0)
    tokens = torch.cat([root_token[:, None], cand_tokens.gather(1, kept)], dim=1)
    parents = torch.cat([torch.full_like(root_token[:, None], -1), parent_node], dim=1)
    depths = torch.cat([torch.zeros_like(root_token[:, None]), cand_depths.gather(1, kept)], dim=1)
    return tokens, parents, depths, node_of[:, :num_candidates]


def select_sampled_slots(parent_scores: Tensor, sorted_q: Tensor, width: int) -> Tensor:
    """Which child slots a sampled dynamic tree draws at the next level (EAGLE-2 expansion, sampled).

    Candidate slot (n, c) = the c-th draw of node n; its score is n's cumulative log q plus the log of
    q(n)'s c-th largest probability, known before anything is drawn. The `width` best slots are kept
    (stable: ties go to the earlier node, then the lower rank), so every node keeps a prefix of its
    draw order, decided from what was drawn before: recursive rejection sampling stays lossless.

    Args:
        parent_scores: (B, M) cumulative log q of the M nodes of the current level (-inf: absent).
        sorted_q: (B, M, K) each node's K largest drafter probabilities, descending.
    Returns:
        (B, width) int64: the kept slots n * K + c, ascending: ordered by (node, rank), so parents come
        first and each node's kept slots are a prefix of its draw order (c = 0, 1, ...). Slots past a
        node's support (q = 0) sort last; if taken they are drawn with probability 0 and never tested.
    """
    scores = (parent_scores[..., None] + sorted_q.log()).flatten(1)  # (B, M K); log 0 = -inf: past q's support
    best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :width]  # (B, width) best first
    return best.sort(dim=-1).values
