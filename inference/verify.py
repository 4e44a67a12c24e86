"""Tree verification rules behind one interface: exact, LANTERN, LANTERN++, GSD and CASCADE.

`verify(tree, view, rule, uniforms)` walks every row's tree from the root, depth by depth; at each
node it tries the children in order (cascade.md §8) and either accepts one and descends, or rejects
all and samples a correction token from the residual; a row that reaches a leaf samples the bonus
token from the target distribution there (never relaxed, cascade.md §4.3). Rules differ only in the
mass a candidate is accepted with and in what a rejection removes from the residual:

- `exact`: lossless multi-draft speculative sampling (cascade.md §2.4, §5.1): accept x w.p.
  min(1, p(x)/q(x)); deterministic drafts (dynamic tree, greedy) have q = 1 and the residual drops
  x; sampled static trees use recursive rejection sampling without replacement, p <- norm(relu(p - q_c))
  with q_c the drafter distribution that sibling c was drawn from.
- `lantern` / `lantern++` (cascade.md §5.2, §5.3): p~(x) = p(x) + the largest prefix mass of x's k
  nearest VQ-codebook latents that stays <= delta (LANTERN) or <= (lambda - 1) p(x) (LANTERN++).
- `gsd` (cascade.md §5.4, tree port): cluster = the rank block of size G holding x in the current
  target ranking; accept w.p. min(1, p(C)/q(C)); a rejection removes the whole cluster.
- `cascade` (cascade.md §4): per depth, plan the sibling merges first: interchangeability set I
  (sibling similarity >= tau_pos) and convergence set C (both siblings' states similar to the
  parent's, >= tau_seq), pooled greedily while the TV budget delta (reset per verification step)
  lasts; then sample with the additive q_R(x) = p(x) + sum of p over the pooled tokens. Optionally
  (`pool_beyond_tree`) a converged sibling also pools support tokens no sibling drafted.

Greedy mode (temperature 0, deterministic drafts): `exact` accepts x iff it is the target argmax;
relaxed rules also accept x when its relaxed mass exceeds every other token's p (LANTERN's greedy
rule, cascade.md §5.2); the bonus token is the argmax at the last node.

Vectorised over B rows with Python loops only over depth and sibling slots (cascade.md §4.4); no
host-device sync. `verify_reference` is the naive per-row, per-node loop the tests compare against.

Shapes: B prompts, N tree nodes, K child slots per node, V vocabulary, D feature width, L table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from inference.tree import Tree

NEG = float("-inf")


@dataclass(frozen=True, kw_only=True, eq=False)
class ExactRule:
    name: str = "exact"


@dataclass(frozen=True, kw_only=True, eq=False)
class LanternRule:
    """LANTERN (lam None) or LANTERN++ (lam set): pool mass of the k nearest codebook latents."""

    neighbours: Tensor
    """(V, L >= k + 1) int64: each code's other codes, nearest first (`build_latent_neighbours`)."""
    k: int = 1000
    """Neighbours considered."""
    delta: float = 0.1
    """LANTERN: absolute bound on the pooled mass (its TV distance)."""
    lam: float | None = None
    """LANTERN++: pooled mass <= (lam - 1) p(x), i.e. p~(x) <= lam p(x)."""
    reject_zeroes: str = "code"
    """On rejection remove x and "code": its k + 1 nearest latents if any were pooled (LANTERN's code),
    or "pooled": only the pooled ones."""

    def __post_init__(self) -> None:
        if self.neighbours.shape[1] < self.k + (self.reject_zeroes == "code"):
            raise ValueError(f"neighbour table has {self.neighbours.shape[1]} columns, k={self.k} needs more")
        if self.reject_zeroes not in ("code", "pooled"):
            raise ValueError(f"reject_zeroes must be 'code' or 'pooled', got {self.reject_zeroes!r}")
        if self.lam is not None and self.lam < 1:
            raise ValueError(f"lantern++ needs lam >= 1, got {self.lam}")

    @property
    def name(self) -> str:
        return "lantern" if self.lam is None else "lantern++"


@dataclass(frozen=True, kw_only=True, eq=False)
class GSDRule:
    group: int = 25
    """G, the rank-block cluster size."""
    name: str = "gsd"


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeRule:
    """CASCADE (cascade.md §4) with its ablation switches (§8)."""

    delta: float = 0.5
    """TV budget per verification step."""
    tau_pos: float = 0.9
    """Interchangeability threshold on sibling similarity."""
    tau_seq: float = 0.625
    """Convergence threshold on child-to-parent similarity."""
    use_interchangeability: bool = True
    use_convergence: bool = True
    conv_mode: str = "sibling"
    """"sibling": C(n) = siblings m with sim(F[n], F[u]) and sim(F[m], F[u]) >= tau_seq; "path": all
    siblings when sim(F[u], F[parent(u)]) >= tau_seq (never at the root, whose parent is not in the tree)."""
    representation: str = "hidden"
    """Similarity features: "hidden" (cond-branch post-norm hidden, mean-centred), "logits" or "probs"."""
    conf_gate: float | None = None
    """Relax x only if it lies in the target's nucleus of this mass (dev code used 0.8)."""
    kl_gate: float | None = None
    """Pool y into x only if KL(p at x's node || p at y's node) < kl_gate (dev code used 4.0)."""
    pool_beyond_tree: bool = False
    """Convergence may also pool tokens no sibling drafted: after the sibling merges, the first usable
    converged sibling (the C(n) condition: sim(F[n], F[u]) >= tau_seq, or the path condition) pools the
    target's other support tokens at this depth, least likely first, while their mass fits the budget.
    Off (cascade.md §4.2): pooling only moves mass between siblings, which on a deterministic (dynamic)
    tree leaves the chance that some child is accepted unchanged. The TV bound of §4.3 holds either way."""
    name: str = "cascade"

    def __post_init__(self) -> None:
        if not 0 <= self.delta <= 1:
            raise ValueError(f"cascade delta is a TV budget in [0, 1], got {self.delta}")
        if self.conv_mode not in ("sibling", "path"):
            raise ValueError(f"conv_mode must be 'sibling' or 'path', got {self.conv_mode!r}")
        if self.representation not in ("hidden", "logits", "probs"):
            raise ValueError(f"representation must be hidden, logits or probs, got {self.representation!r}")


Rule = ExactRule | LanternRule | GSDRule | CascadeRule


@dataclass
class TargetView:
    """What verification sees of the target forward over the tree."""

    probs: Tensor  # (B, N, V) processed target distribution at each node (predicts its children)
    greedy_tokens: Tensor | None = None  # (B, N) argmax of the guided logits (greedy mode)
    features: Tensor | None = None  # (B, N, D) CASCADE similarity features (cond branch)


@dataclass
class Uniforms:
    accept: Tensor  # (B, max_depth, K) one uniform per (depth, sibling slot)
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
    tv_charged: Tensor  # (B,) CASCADE: budget spent on the realised path (0 for other rules)
    accept_prob: Tensor  # (B, max_depth, K) min(1, mass / proposal) of every test made, NaN where none was
    final_probs: Tensor  # (B, V) the distribution next_token was drawn from (residual or bonus)


def _features(view: TargetView) -> Tensor:
    if view.features is None:
        raise ValueError("the cascade rule needs TargetView.features (see speculative.build_target_view)")
    return view.features


def _greedy_tokens(view: TargetView) -> Tensor:
    if view.greedy_tokens is None:
        raise ValueError("greedy verification needs TargetView.greedy_tokens, the argmax of the guided logits")
    return view.greedy_tokens


def build_latent_neighbours(codebook: Tensor, k: int) -> Tensor:
    """LANTERN's latent proximity (cascade.md §5.2): (V, e) codebook -> (V, k) nearest other codes by L2."""
    distance = torch.cdist(codebook.float(), codebook.float())  # (V, V)
    distance.fill_diagonal_(float("inf"))
    return distance.topk(min(k, codebook.shape[0] - 1), dim=-1, largest=False).indices


def sample_inverse_cdf(probs: Tensor, uniform: Tensor) -> Tensor:
    """Draw from (B, V) probabilities with one given uniform per row (inverse CDF). -> (B,)."""
    cdf = probs.cumsum(-1)
    target = (uniform * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def normalise_or_uniform(p: Tensor) -> Tensor:
    """Renormalise (..., V); an all-zero residual falls back to uniform over the (image) vocabulary (§8)."""
    total = p.sum(-1, keepdim=True)
    return torch.where(total > 0, p / total.clamp_min(1e-30), torch.full_like(p, 1.0 / p.shape[-1]))


def centred_cosine(a: Tensor, b: Tensor) -> Tensor:
    """Mean-centred cosine similarity in fp32 (cascade.md §4.1) of (..., D) against (..., D) -> (...)."""
    a = a.float() - a.float().mean(-1, keepdim=True)
    b = b.float() - b.float().mean(-1, keepdim=True)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-8)


def kl_divergence(p: Tensor, q: Tensor) -> Tensor:
    """KL(p || q) over the last dim, zero where p = 0."""
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log()), 0.0).sum(-1)


def nucleus_member(p: Tensor, x: Tensor, mass: float) -> Tensor:
    """Whether token x (B,) lies in the smallest top set of p (B, V) holding `mass`."""
    sorted_p = p.sort(-1, descending=True).values
    before = sorted_p.cumsum(-1) - sorted_p
    threshold = torch.where(before < mass, sorted_p, float("inf")).amin(-1)
    return p.gather(1, x[:, None]).squeeze(1) >= threshold


def cascade_plan(
    rule: CascadeRule,
    view: TargetView,
    tree: Tree,
    cur: Tensor,
    kids: Tensor,
    kid_tokens: Tensor,
    usable: Tensor,
    p0: Tensor,
    budget: Tensor,
) -> tuple[Tensor, Tensor]:
    """CASCADE step 1 at one depth (cascade.md §4.2-4.3): which sibling tokens each sibling pools.

    Args:
        cur (B,) current node; kids, kid_tokens (B, K); usable (B, K) valid non-duplicate slots;
        p0 (B, V) unmodified target distribution at cur; budget (B,) TV budget left.
    Returns:
        pool (B, K, K) bool (slot a pools slot b's token) and the budget left (B,).
    """
    batch, width = kids.shape
    rows = torch.arange(batch, device=kids.device)
    feats = _features(view)[rows[:, None], kids.clamp_min(0)]  # (B, K, D)
    parent_feat = _features(view)[rows, cur]  # (B, D)
    s_pos = centred_cosine(feats[:, :, None], feats[:, None, :])  # (B, K, K)
    s_conv = centred_cosine(feats, parent_feat[:, None])  # (B, K)
    pair_ok = usable[:, :, None] & usable[:, None, :] & ~torch.eye(width, dtype=torch.bool, device=kids.device)
    score = torch.full_like(s_pos, NEG)
    if rule.use_interchangeability:  # 1a. I(n): siblings with sim >= tau_pos
        score = torch.where(s_pos >= rule.tau_pos, s_pos, score)
    if rule.use_convergence:  # 1b. C(n): converged siblings, ordered by their own similarity
        if rule.conv_mode == "sibling":
            conv = (s_conv[:, :, None] >= rule.tau_seq) & (s_conv[:, None, :] >= rule.tau_seq)
        else:
            grand = tree.parents[rows, cur]
            path_conv = (grand >= 0) & (
                centred_cosine(parent_feat, _features(view)[rows, grand.clamp_min(0)]) >= rule.tau_seq
            )
            conv = path_conv[:, None, None].expand(-1, width, width)
        score = torch.where(conv, torch.maximum(score, s_conv[:, None, :].expand(-1, width, -1)), score)
    if rule.kl_gate is not None:  # optional gate: the two nodes' target distributions must be close
        node_p = view.probs[rows[:, None], kids.clamp_min(0)]  # (B, K, V)
        kl = kl_divergence(node_p[:, :, None], node_p[:, None, :])  # (B, K, K)
        score = torch.where(kl < rule.kl_gate, score, NEG)
    eligible = usable.clone()
    if rule.conf_gate is not None:  # optional gate: relax only nucleus tokens
        for a in range(width):
            eligible[:, a] &= nucleus_member(p0, kid_tokens[:, a], rule.conf_gate)
    score = torch.where(pair_ok & eligible[:, :, None], score, NEG)
    order = score.argsort(dim=-1, descending=True, stable=True)  # (B, K, K) most similar first
    mass = p0.gather(1, kid_tokens)  # (B, K) charge of pooling each slot's token
    ranked_mass = mass.gather(1, order.flatten(1)).view(batch, width, width)  # (B, K, K) in each slot's order
    ranked_ok = score.gather(2, order) > NEG  # (B, K, K) a candidate at all
    used = torch.zeros(batch, width, dtype=torch.bool, device=kids.device)
    pool = torch.zeros(batch, width, width, dtype=torch.bool, device=kids.device)
    for a in range(width):  # 1c. greedy: pool while the budget lasts, in sibling order
        # order[:, a] visits each candidate slot once, so only the budget changes along slot a's candidates:
        # which of them are still free is fixed before its loop.
        free = ranked_ok[:, a] & ~used.gather(1, order[:, a]) & (usable[:, a] & ~used[:, a])[:, None]  # (B, K)
        takes = torch.zeros_like(free)
        for j in range(width - 1):  # the last rank is never a candidate: at least a itself scores NEG
            take = free[:, j] & (ranked_mass[:, a, j] <= budget)
            takes[:, j] = take
            budget = budget - ranked_mass[:, a, j] * take
        pool[:, a].scatter_(1, order[:, a], takes)
        used |= pool[:, a]
        used[:, a] |= usable[:, a]
    return pool, budget


def cascade_beyond_tree(
    rule: CascadeRule,
    view: TargetView,
    tree: Tree,
    cur: Tensor,
    kids: Tensor,
    kid_tokens: Tensor,
    usable: Tensor,
    pool_tokens: Tensor,
    p0: Tensor,
    budget: Tensor,
) -> tuple[Tensor, Tensor]:
    """`CascadeRule.pool_beyond_tree` at one depth, after `cascade_plan`: converged siblings pool undrafted tokens.

    Args:
        cur (B,); kids, kid_tokens, usable (B, K) as in `cascade_plan`; pool_tokens (B, K, V) bool, the
        sibling merges; p0 (B, V); budget (B,) left after the sibling merges.
    Returns:
        pool_tokens with the undrafted tokens added (B, K, V) and the budget left (B,).
    """
    batch, width = kids.shape
    rows = torch.arange(batch, device=kids.device)
    feats = _features(view)
    parent_feat = feats[rows, cur]  # (B, D)
    if rule.conv_mode == "sibling":
        converged = centred_cosine(feats[rows[:, None], kids.clamp_min(0)], parent_feat[:, None]) >= rule.tau_seq
    else:
        grand = tree.parents[rows, cur]
        path_conv = (grand >= 0) & (centred_cosine(parent_feat, feats[rows, grand.clamp_min(0)]) >= rule.tau_seq)
        converged = path_conv[:, None].expand(-1, width)
    merged_away = pool_tokens.any(1).gather(1, kid_tokens)  # (B, K) a sibling already pooled this slot's token
    open_slot = usable & converged & ~merged_away & rule.use_convergence  # (B, K)
    if rule.conf_gate is not None:
        for a in range(width):
            open_slot[:, a] &= nucleus_member(p0, kid_tokens[:, a], rule.conf_gate)
    vocab = p0.shape[-1]
    drafted = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=kids.device)  # last column: dump for -1 slots
    drafted.scatter_(1, torch.where(kids >= 0, kid_tokens, vocab), True)
    free = (p0 > 0) & ~drafted[:, :vocab] & ~pool_tokens.any(1)  # (B, V) support tokens no sibling drafted
    order = torch.where(free, p0, float("inf")).argsort(dim=-1, stable=True)  # least likely first, once per depth
    sorted_p = p0.gather(1, order)  # (B, V)
    free_sorted = free.gather(1, order)  # (B, V); each slot takes a prefix of what is still free
    for a in range(width):
        cumulative = (sorted_p * free_sorted).cumsum(-1)  # (B, V)
        take_sorted = free_sorted & (cumulative <= budget[:, None]) & open_slot[:, a : a + 1]
        take = torch.zeros_like(free).scatter_(1, order, take_sorted)
        pool_tokens[:, a] |= take
        budget = budget - (p0 * take).sum(-1)  # summed in vocabulary order, as the reference does
        free_sorted &= ~take_sorted
    return pool_tokens, budget


def candidate_mass(
    rule: Rule, p: Tensor, x: Tensor, pooled: Tensor | None, q_draw: Tensor, q_x: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Step 2a: (accept numerator, denominator, tokens a rejection removes (B, V) bool) for candidate x (B,)."""
    rows = torch.arange(p.shape[0], device=p.device)
    p_x = p[rows, x]
    remove = torch.nn.functional.one_hot(x, p.shape[-1]).bool()
    if isinstance(rule, LanternRule):
        neighbours = rule.neighbours.to(p.device)[x]  # (B, L)
        cumulative = p.gather(1, neighbours[:, : rule.k]).cumsum(-1)  # (B, k)
        bound = rule.delta if rule.lam is None else (rule.lam - 1) * p_x[:, None]
        allowed = cumulative <= bound  # a prefix, the cumulative mass never decreases
        p_x = p_x + (cumulative * allowed).amax(-1)
        if rule.reject_zeroes == "code":
            zap = neighbours[:, : rule.k + 1]
            remove.scatter_(1, zap, allowed.any(-1, keepdim=True).expand_as(zap))
        else:
            remove.scatter_(1, neighbours[:, : rule.k], allowed)
        remove[rows, x] = True
    elif isinstance(rule, GSDRule):
        order = p.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[-1], device=p.device).expand_as(order))
        block = rank // rule.group
        remove = block == block[rows, x][:, None]  # (B, V) x's cluster
        return (p * remove).sum(-1), (q_draw * remove).sum(-1), remove
    elif isinstance(rule, CascadeRule) and pooled is not None:
        p_x = p_x + (p * pooled).sum(-1)  # q_R(x) = p(x) + sum_{y in N(x)} p(y)
        remove = remove | pooled
    return p_x, q_x, remove


def verify(
    tree: Tree, view: TargetView, rule: Rule, uniforms: Uniforms, max_accept: Tensor | None = None, greedy: bool = False
) -> Verdict:
    """Verify B drafted trees after one target forward over all their nodes. No host-device sync.

    Args:
        tree: the drafted trees (node 0 = root).
        view: target distributions (and greedy tokens / CASCADE features) at every node.
        rule: the verification rule.
        uniforms: pre-drawn randomness (shared with `verify_reference` in tests).
        max_accept: (B,) accept at most this many drafts per row (image end); None = no limit.
        greedy: temperature-0 decoding (deterministic drafts).
    """
    probs = view.probs.float()
    batch, _, vocab = probs.shape
    rows = torch.arange(batch, device=probs.device)
    children = tree.children  # (B, N, K)
    if max_accept is not None:
        too_deep = tree.depths.gather(1, children.clamp_min(0).flatten(1)).view_as(children) > max_accept[:, None, None]
        children = children.masked_fill(too_deep, -1)
    cur = torch.zeros(batch, dtype=torch.long, device=probs.device)
    alive = torch.ones(batch, dtype=torch.bool, device=probs.device)
    rejected = torch.zeros_like(alive)
    residual = torch.zeros(batch, vocab, device=probs.device)
    delta = rule.delta if isinstance(rule, CascadeRule) else 0.0
    budget = torch.full((batch,), delta, device=probs.device)  # TV budget, reset every verification step
    accept_prob = torch.full((batch, tree.max_depth, tree.max_children), float("nan"), device=probs.device)
    for depth in range(tree.max_depth):  # walk down one level per iteration, all rows at once
        kids = children[rows, cur]  # (B, K)
        alive &= (kids >= 0).any(-1)  # rows at a leaf stop here and take the bonus token
        accepted, p, budget = _verify_level(
            rule, view, tree, cur, kids, alive, budget, uniforms.accept[:, depth], greedy, accept_prob[:, depth]
        )
        stop = alive & (accepted < 0)  # every sibling rejected: the correction comes from the residual
        residual = torch.where(stop[:, None], p, residual)
        rejected |= stop
        alive &= ~stop
        cur = torch.where(alive, accepted, cur)
    final = torch.where(rejected[:, None], residual, probs[rows, cur])  # never relaxed (§4.3)
    next_token = _greedy_tokens(view)[rows, cur] if greedy else sample_inverse_cdf(final, uniforms.bonus)
    return Verdict(cur, tree.depths[rows, cur], next_token, delta - budget, accept_prob, final)


def _verify_level(
    rule: Rule, view: TargetView, tree: Tree, cur: Tensor, kids: Tensor, alive: Tensor, budget: Tensor,
    uniforms: Tensor, greedy: bool, accept_prob: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One level of the walk: plan (CASCADE), then try the children of `cur` in order.

    Args:
        cur (B,) current nodes; kids (B, K) their children (-1 padded); alive (B,) rows still walking;
        budget (B,) TV budget left; uniforms (B, K); accept_prob (B, K) filled in place.
    Returns:
        accepted child (B,) or -1, the residual target distribution (B, V), the budget left (B,).
    """
    batch, vocab = kids.shape[0], view.probs.shape[-1]
    rows = torch.arange(batch, device=kids.device)
    kid_tokens = tree.tokens.gather(1, kids.clamp_min(0))
    earlier = torch.ones(kids.shape[1], kids.shape[1], dtype=torch.bool, device=kids.device).tril(-1)
    same = (kid_tokens[:, :, None] == kid_tokens[:, None, :]) & (kids[:, None, :] >= 0) & earlier
    usable = (kids >= 0) & ~same.any(-1)  # duplicate sibling tokens are tested once (§8)
    p0 = view.probs[rows, cur].float()
    p = p0.clone()
    pool_tokens = None
    if isinstance(rule, CascadeRule):  # 1. plan all merges at this depth first (§4.3)
        pool, budget = cascade_plan(rule, view, tree, cur, kids, kid_tokens, usable & alive[:, None], p0, budget)
        pool_tokens = torch.zeros(batch, kids.shape[1], vocab + 1, dtype=torch.bool, device=kids.device)
        column = torch.where(usable, kid_tokens, vocab)  # unusable slots write to a dump column
        pool_tokens = pool_tokens.scatter_(2, column[:, None, :].expand_as(pool), pool)[..., :vocab]  # (B, K, V)
        if rule.pool_beyond_tree:
            pool_tokens, budget = cascade_beyond_tree(
                rule, view, tree, cur, kids, kid_tokens, usable & alive[:, None], pool_tokens, p0, budget
            )
    q_parent = tree.q_full[rows, cur].float()
    drawn = torch.zeros(batch, vocab, dtype=torch.bool, device=kids.device)  # siblings drawn before this one
    accepted = torch.full_like(cur, -1)
    for slot in range(kids.shape[1]):  # 2. try the siblings in draw / rank order
        node, x = kids[:, slot], kid_tokens[:, slot]
        q_draw = normalise_or_uniform(q_parent.masked_fill(drawn, 0)) if tree.sampled else q_parent
        q_x = tree.q_cond[rows, node.clamp_min(0)] if tree.sampled else torch.ones_like(p0[:, 0])
        pooled = pool_tokens[:, slot] if pool_tokens is not None else None
        test = alive & (accepted < 0) & usable[:, slot] & (q_x > 0)
        if pooled is not None:  # merged-away siblings have p = 0 and nothing pooled: skip them
            test &= (p[rows, x] > 0) | pooled.any(-1)
        mass, proposal, remove = candidate_mass(rule, p, x, pooled, q_draw, q_x)
        if greedy:  # argmax, or (relaxed rules) a relaxed mass above every other token's
            ok = x == _greedy_tokens(view)[rows, cur]
            if not isinstance(rule, ExactRule):
                ok |= mass > p.scatter(1, x[:, None], 0.0).amax(-1)
        else:
            ok = uniforms[:, slot] * proposal < mass  # u < min(1, mass / q)
        chance = ok.float() if greedy else (mass / proposal.clamp_min(1e-30)).clamp_max(1.0)
        accept_prob[:, slot] = torch.where(test, chance, float("nan"))
        accepted = torch.where(test & ok, node, accepted)
        new_p = p.masked_fill(remove, 0.0)  # 3. the residual after a rejection
        if tree.sampled:  # recursive rejection sampling without replacement (EAGLE-1, §2.4)
            new_p = torch.relu(new_p - q_draw)
        p = torch.where((test & ~ok)[:, None], normalise_or_uniform(new_p), p)
        drawn[rows, x] |= node >= 0
    return accepted, p, budget


# ----------------------------------------------------------------------------------------------
# Naive reference: one row, one node at a time, following the pseudo-code of cascade.md §2.4 and
# §4.3 literally. Used only by tests, to check `verify`.
# ----------------------------------------------------------------------------------------------


def verify_reference(
    tree: Tree, view: TargetView, rule: Rule, uniforms: Uniforms, max_accept: Tensor | None = None, greedy: bool = False
) -> Verdict:
    """Per-row, per-node loop with the same semantics and randomness as `verify` (tests only)."""
    verdicts = [
        _reference_row(tree, view, rule, uniforms, b, None if max_accept is None else int(max_accept[b]), greedy)
        for b in range(tree.tokens.shape[0])
    ]
    last, num, token, charged, chance, final = zip(*verdicts, strict=True)
    device = tree.tokens.device
    return Verdict(
        torch.tensor(last, device=device),
        torch.tensor(num, device=device),
        torch.tensor(token, device=device),
        torch.tensor(charged, device=device),
        torch.stack(chance),
        torch.stack(final),
    )


def _reference_row(
    tree: Tree, view: TargetView, rule: Rule, uniforms: Uniforms, b: int, limit: int | None, greedy: bool
) -> tuple[int, int, int, float, Tensor, Tensor]:
    parents, depths, tokens = tree.parents[b].tolist(), tree.depths[b].tolist(), tree.tokens[b].tolist()
    probs = view.probs[b].float()
    delta = rule.delta if isinstance(rule, CascadeRule) else 0.0
    budget = torch.tensor(delta)
    cur, rejected, p = 0, False, probs[0]
    chance = torch.full((tree.max_depth, tree.max_children), float("nan"))
    for depth in range(tree.max_depth):
        kids = [n for n in range(len(tokens)) if parents[n] == cur and (limit is None or depths[n] <= limit)]
        if not kids:
            break
        p0 = probs[cur]
        p = p0.clone()
        plan: dict[int, list[int]] = {}
        if isinstance(rule, CascadeRule):
            plan, budget = _reference_plan(rule, view, tree, b, cur, kids, p0, budget)
        accepted: int | None = None
        seen: list[int] = []
        drawn: list[int] = []
        for slot, n in enumerate(kids):
            x = tokens[n]
            if x in seen:
                continue
            seen.append(x)
            q_draw = tree.q_full[b, cur].float().clone()
            if tree.sampled:
                q_draw[drawn] = 0
                q_draw = normalise_or_uniform(q_draw)
            drawn.append(x)
            q_x = float(tree.q_cond[b, n]) if tree.sampled else 1.0
            if q_x <= 0 or (isinstance(rule, CascadeRule) and p[x] == 0 and not plan.get(slot)):
                continue
            mass, proposal, remove = _reference_mass(rule, p, x, plan.get(slot, []), q_draw, q_x)
            if greedy:
                others = max((float(p[y]) for y in range(len(p)) if y != x), default=0.0)
                ok = x == int(_greedy_tokens(view)[b, cur]) or (not isinstance(rule, ExactRule) and mass > others)
            else:
                ok = float(uniforms.accept[b, depth, slot]) * proposal < mass
            chance[depth, slot] = float(ok) if greedy else min(1.0, mass / max(proposal, 1e-30))
            if ok:
                accepted = n
                break
            p[remove] = 0
            if tree.sampled:
                p = torch.relu(p - q_draw)
            p = normalise_or_uniform(p)
        if accepted is None:
            rejected = True
            break
        cur = accepted
    final = p if rejected else probs[cur]
    if greedy:
        token = int(_greedy_tokens(view)[b, cur])
    else:
        token = int(sample_inverse_cdf(final[None], uniforms.bonus[b : b + 1])[0])
    return cur, depths[cur], token, float(delta - budget), chance, final


def _reference_mass(
    rule: Rule, p: Tensor, x: int, pooled: list[int], q_draw: Tensor, q_x: float
) -> tuple[float, float, list[int]]:
    if isinstance(rule, LanternRule):
        neighbours = rule.neighbours[x].tolist()
        bound = rule.delta if rule.lam is None else (rule.lam - 1) * p[x]  # compared in fp32, as in `verify`
        cumulative = p[neighbours[: rule.k]].cumsum(0)
        kept = [j for j in range(rule.k) if bool(cumulative[j] <= bound)]
        extra = float(cumulative[kept[-1]]) if kept else 0.0
        if rule.reject_zeroes == "code":
            zap = neighbours[: rule.k + 1] if kept else []
        else:
            zap = neighbours[: len(kept)]
        return float(p[x]) + extra, q_x, [x, *zap]
    if isinstance(rule, GSDRule):
        order = p.argsort(descending=True, stable=True).tolist()
        start = order.index(x) // rule.group * rule.group
        cluster = order[start : start + rule.group]
        return float(p[cluster].sum()), float(q_draw[cluster].sum()), cluster
    if isinstance(rule, CascadeRule):
        return float(p[x]) + float(p[pooled].sum()) if pooled else float(p[x]), q_x, [x, *pooled]
    return float(p[x]), q_x, [x]


def _reference_plan(
    rule: CascadeRule, view: TargetView, tree: Tree, b: int, cur: int, kids: list[int], p0: Tensor, budget: Tensor
) -> tuple[dict[int, list[int]], Tensor]:
    feats, tokens = _features(view)[b], tree.tokens[b].tolist()
    grand = int(tree.parents[b, cur])
    path_conv = grand >= 0 and float(centred_cosine(feats[cur], feats[grand])) >= rule.tau_seq
    plan: dict[int, list[int]] = {}
    used: set[int] = set()
    unique: dict[int, tuple[int, int]] = {}
    for slot, n in enumerate(kids):
        unique.setdefault(tokens[n], (slot, n))
    for slot, n in unique.values():
        x = tokens[n]
        if x in used:
            continue
        used_x = rule.conf_gate is None or bool(nucleus_member(p0[None], torch.tensor([x]), rule.conf_gate)[0])
        candidates = []
        for _, m in unique.values():
            if m == n or not used_x:
                continue
            score = NEG
            s_pos = float(centred_cosine(feats[n], feats[m]))
            s_m, s_n = float(centred_cosine(feats[m], feats[cur])), float(centred_cosine(feats[n], feats[cur]))
            if rule.use_interchangeability and s_pos >= rule.tau_pos:
                score = s_pos
            conv = (s_n >= rule.tau_seq and s_m >= rule.tau_seq) if rule.conv_mode == "sibling" else path_conv
            if rule.use_convergence and conv:
                score = max(score, s_m)
            if rule.kl_gate is not None and float(kl_divergence(view.probs[b, n], view.probs[b, m])) >= rule.kl_gate:
                score = NEG
            if score > NEG:
                candidates.append((score, tokens[m]))
        pooled = []
        for _, y in sorted(candidates, key=lambda c: -c[0]):
            if y not in used and p0[y] <= budget:
                pooled.append(y)
                budget = budget - p0[y]
                used.add(y)
        used.add(x)
        plan[slot] = pooled
    if rule.pool_beyond_tree and rule.use_convergence:
        drafted = {tokens[n] for n in kids}
        merged = {y for ys in plan.values() for y in ys}
        free = [y for y in range(len(p0)) if p0[y] > 0 and y not in drafted and y not in used]
        for slot, n in unique.values():
            if tokens[n] in merged:
                continue
            if rule.conv_mode == "sibling":
                converged = float(centred_cosine(feats[n], feats[cur])) >= rule.tau_seq
            else:
                converged = path_conv
            if rule.conf_gate is not None:
                converged &= bool(nucleus_member(p0[None], torch.tensor([tokens[n]]), rule.conf_gate)[0])
            if not converged:
                continue
            order = sorted(free, key=lambda y: (float(p0[y]), y))  # least likely first
            cumulative = p0[order].cumsum(0) if order else torch.zeros(0)
            taken = [y for y, ok in zip(order, (cumulative <= budget).tolist(), strict=True) if ok]
            plan[slot] = plan[slot] + taken
            budget = budget - (p0[taken].sum() if taken else 0.0)
            free = [y for y in free if y not in taken]
    return plan, budget
