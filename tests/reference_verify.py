"""Textbook tree verification, one row and one node at a time, in plain Python floats (tests only).

Written from the algorithm's description (recursive rejection sampling along the tree; docs/method.md, sections
"Tree verification", "CASCADE as implemented" and "The baselines, as their authors' code runs them"), not from
`inference.decoding.verify`, with which it shares no code: lists instead of tensors, the walk followed literally, the
budget spent test by test. The tests compare it with the vectorised `verify` on the same uniforms and use its exact
acceptance probabilities to enumerate output distributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inference.decoding.rules import CascadeDevRule, CascadeRule, ExactRule, GSDBlocksRule, GSDRule, LanternRule


@dataclass
class RowTree:
    """One drafted tree in plain Python."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q_full: list[list[float]]  # drafter distribution at each node (over its children)
    probs: list[list[float]]  # target distribution at each node
    features: list[list[float]] | None
    sampled: bool

    @classmethod
    def from_batch(cls, tree, view, b: int) -> RowTree:
        feats = None if view.features is None else view.features[b].double().tolist()
        return cls(
            tree.tokens[b].tolist(),
            tree.parents[b].tolist(),
            tree.depths[b].tolist(),
            tree.q_full[b].double().tolist(),
            view.probs[b].double().tolist(),
            feats,
            tree.sampled,
        )

    def children(self, node: int, limit: int | None) -> list[int]:
        return [
            n for n in range(len(self.tokens)) if self.parents[n] == node and (limit is None or self.depths[n] <= limit)
        ]


@dataclass
class Outcome:
    last_node: int
    accepted: int
    final: list[float]  # distribution of the correction / bonus token
    charged: float
    tests: list[tuple[int, int, float]] = field(default_factory=list)  # (depth of parent, slot, acceptance prob)


def _normalise(p: list[float]) -> list[float]:
    total = sum(p)
    return [v / total for v in p] if total > 0 else [1.0 / len(p)] * len(p)


def _cosine(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    a = [v - ma for v in a]
    b = [v - mb for v in b]
    na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / max(na * nb, 1e-16) if na and nb else 0.0


def _cosine_plain(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / max(na, 1e-12) / max(nb, 1e-12)


def _softmax(a: list[float]) -> list[float]:
    top = max(a)
    e = [math.exp(v - top) for v in a]
    return [v / sum(e) for v in e]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * (math.log(a) - math.log(max(b, 1e-30))) for a, b in zip(p, q, strict=True) if a > 0)


def _in_nucleus(p: list[float], x: int, mass: float) -> bool:
    ranked = sorted(p, reverse=True)
    before, smallest = 0.0, math.inf
    for v in ranked:
        if before < mass:
            smallest = min(smallest, v)
        before += v
    return p[x] >= smallest


def _cascade_extra(rule: CascadeRule, row: RowTree, u: int, kids: list[int], n: int, p: list[float], usable) -> float:
    """The mass CASCADE pools into child n of u from the current residual p."""
    f = row.features
    assert f is not None
    x = row.tokens[n]
    if rule.conv_mode == "sibling":
        converged = _cosine(f[n], f[u]) >= rule.tau_seq
    else:
        grand = row.parents[u]
        converged = grand >= 0 and _cosine(f[u], f[grand]) >= rule.tau_seq
    if rule.kl_gate is not None:
        converged = converged and _kl(row.probs[n], row.probs[u]) < rule.kl_gate
    converged = converged and rule.use_convergence
    if converged and rule.pool_beyond_tree:
        return sum(p) - p[x]
    pooled: set[int] = set()
    if rule.use_interchangeability:
        for m in kids:
            if m != n and usable(m) and _cosine(f[n], f[m]) >= rule.tau_pos:
                pooled.add(row.tokens[m])
    if converged:
        pooled.add(row.tokens[u])
        pooled.update(row.tokens[g] for g in range(len(row.tokens)) if row.parents[g] == n)
    pooled.discard(x)
    return sum(p[y] for y in pooled)


def _lantern(rule: LanternRule, p: list[float], x: int) -> tuple[float, list[int]]:
    near = rule.neighbours[x].tolist()
    bound = rule.delta if rule.lam is None else (rule.lam - 1) * p[x]
    total, taken = 0.0, 0
    for j in range(rule.k):
        if total + p[near[j]] <= bound + 1e-12:
            total += p[near[j]]
            taken = j + 1
        else:
            break
    if rule.reject_zeroes == "code":
        zap = near[: rule.k + 1] if taken else []
    else:
        zap = near[:taken]
    return p[x] + total, zap


def _ranked(p: list[float]) -> list[int]:
    return sorted(range(len(p)), key=lambda y: (-p[y], y))


def _gsd_blocks_cluster(rule: GSDBlocksRule, p: list[float], x: int) -> list[int]:
    order = _ranked(p)
    start = order.index(x) // rule.group * rule.group
    return order[start : start + rule.group]


def _gsd_cluster(rule: GSDRule, p: list[float], x: int) -> list[int]:
    """x's cluster: the window of ranks d - (W - 1 - W//2) .. d + W//2 around x's rank d, cut at rank 0; x alone
    where the window runs past the least likely token (the GSD authors' empty slice, a plain test)."""
    order = _ranked(p)
    d = order.index(x)
    if d + rule.window // 2 >= len(order):
        return [x]
    window = order[max(0, d - (rule.window - 1 - rule.window // 2)) : d + rule.window // 2 + 1]
    ids = None if rule.token_ids is None else rule.token_ids.tolist()
    skip_distance = ids is not None and any(ids[y] > rule.id_bound for y in window)
    emb = rule.embeddings.double().tolist()
    cluster = []
    for y in window:
        distance = sum((a - b) ** 2 for a, b in zip(emb[y], emb[x], strict=True))
        near = skip_distance or distance < rule.distance_threshold
        if y == x or (abs(p[y] - p[x]) < rule.p_threshold and near):
            cluster.append(y)
    return cluster


def _dev_partners(rule: CascadeDevRule, row: RowTree, n: int) -> list[int]:
    """The nodes whose tokens' p the dev rule adds for x = node n at depth d. "code": the nodes with children at
    depth d + 1 are the drafter's rows, numbered in node order; x takes the row numbered as x's place among the
    depth-d nodes, and each other row v whose q has cosine > pair_threshold with it gives the node at depth-major
    place start(d) + v. "level": the other nodes with children at depth d whose q has that cosine with x's."""
    depth = row.depths[n]
    order = sorted(range(len(row.tokens)), key=lambda m: (row.depths[m], m))  # depth-major
    drafted = [m for m in order if row.children(m, None)]

    def close(a: int, b: int) -> bool:
        return _cosine_plain(row.q_full[a], row.q_full[b]) > rule.pair_threshold

    if rule.pairs == "level":
        return [m for m in drafted if row.depths[m] == depth and m != n and n in drafted and close(n, m)]
    rows = [m for m in drafted if row.depths[m] == depth + 1]
    level = [m for m in order if row.depths[m] == depth]
    start, place = order.index(level[0]), level.index(n)
    if place >= len(rows):
        return []
    return [order[start + v] for v, m in enumerate(rows) if v != place and close(rows[place], m)]


def reference_verify(row: RowTree, rule, accept_uniforms, bonus_uniform: float | None, limit: int | None = None):
    """Walk one tree. accept_uniforms[d][c] decides child c of the depth-d node; returns an `Outcome`.

    With bonus_uniform None the final distribution is returned without drawing from it.
    """
    budget = rule.delta if isinstance(rule, CascadeRule) else 0.0
    u, charged, tests = 0, 0.0, []
    while True:
        kids = row.children(u, limit)
        p = list(row.probs[u])
        q_left = list(row.q_full[u])

        def usable(m: int, kids: list[int] = kids, u: int = u) -> bool:
            if row.sampled:  # a draw with q = 0 is padding
                return row.q_full[u][row.tokens[m]] > 0
            return row.tokens[m] not in [row.tokens[k] for k in kids[: kids.index(m)]]

        accepted = None
        for slot, n in enumerate(kids):
            if not usable(n):
                continue
            x = row.tokens[n]
            if row.sampled:
                q_draw = _normalise(q_left)  # x was drawn from q without the earlier children
                q_x = q_draw[x]
            else:
                q_draw = [1.0 if y == x else 0.0 for y in range(len(p))]
                q_x = 1.0
            base = min(1.0, p[x] / q_x) if q_x > 0 else 0.0
            zap: list[int] = []
            if isinstance(rule, ExactRule):
                chance = base
            elif isinstance(rule, CascadeRule):
                eligible = rule.conf_gate is None or _in_nucleus(row.probs[u], x, rule.conf_gate)
                extra = _cascade_extra(rule, row, u, kids, n, p, usable) if eligible else 0.0
                want = max(0.0, min(1.0, (p[x] + extra) / q_x) - base)
                grant = min(want, max(0.0, budget))
                budget -= grant
                charged += grant
                chance = min(1.0, base + grant)
            elif isinstance(rule, CascadeDevRule):
                chance = base
                if q_x > 0 and _in_nucleus(p, x, rule.nucleus):
                    total = sum(p[row.tokens[m]] for m in _dev_partners(rule, row, n))
                    if row.depths[n] >= 2:  # x's parent u against u's parent
                        s = _cosine_plain(_softmax(row.features[u]), _softmax(row.features[row.parents[u]]))
                        total += s if s > rule.sim_threshold else 0.0
                    if total > 0:
                        chance = max(base, 1.0 if total >= q_x else min(1.0, p[x] / (q_x - total)))
            elif isinstance(rule, LanternRule):
                mass, zap = _lantern(rule, p, x)
                chance = min(1.0, mass / q_x)
            else:
                if isinstance(rule, GSDBlocksRule):
                    cluster = _gsd_blocks_cluster(rule, p, x)
                    zap = cluster
                else:
                    cluster = _gsd_cluster(rule, p, x)
                mass = sum(p[y] for y in cluster)
                # GSD-blocks' port measures q(C) under the parent's q as drafted, its "draw" option (and GSD) under
                # the distribution x was drawn from
                by_parent = isinstance(rule, GSDBlocksRule) and rule.proposal_mass == "parent"
                proposal = sum((row.q_full[u] if by_parent else q_draw)[y] for y in cluster) if row.sampled else 1.0
                chance = min(1.0, mass / proposal) if proposal > 0 else 0.0
            tests.append((row.depths[u], slot, chance))
            if accept_uniforms[row.depths[u]][slot] < chance:
                accepted = n
                break
            # rejection: the rule's removals, then recursive rejection sampling's residual
            if isinstance(rule, LanternRule) and row.sampled:
                if rule.static_zeroes == "q":
                    q_draw = [0.0 if y in zap else v for y, v in enumerate(q_draw)]
                else:
                    p = [0.0 if y in zap else v for y, v in enumerate(p)]
            else:
                p = [0.0 if y in zap else v for y, v in enumerate(p)]
            p = _normalise([max(0.0, a - b) for a, b in zip(p, q_draw, strict=True)])
            if row.sampled:
                q_left[x] = 0.0
        if accepted is None:
            final = p
            break
        u = accepted
    return Outcome(u, row.depths[u], final, charged, tests), (
        None if bonus_uniform is None else int(sample_from(final, bonus_uniform))
    )


def sample_from(p: list[float], uniform: float) -> int:
    """Inverse CDF, as `inference.decoding.verify.sample_inverse_cdf` (right-continuous)."""
    total = sum(p)
    target, cumulative = uniform * total, 0.0
    for y, v in enumerate(p):
        cumulative += v
        if cumulative > target:
            return y
    return len(p) - 1


def reference_batch(tree, view, rule, uniforms, max_accept=None):
    """`reference_verify` on every row of a batch: (last nodes, accepted, next tokens, charges, finals)."""
    out = []
    for b in range(tree.tokens.shape[0]):
        row = RowTree.from_batch(tree, view, b)
        limit = None if max_accept is None else int(max_accept[b])
        outcome, token = reference_verify(
            row, rule, uniforms.accept[b].double().tolist(), float(uniforms.bonus[b]), limit
        )
        out.append((outcome, token))
    return out
