"""The CASCADE development code's acceptance test, restated in plain Python floats (tests only).

Source: selinyldrm/Deepseek-JanusPro-EAGLE, commit 8c40c9c ("final cascade"):
- `models/ea_model_lumina_mgpt.py`: `generate_tree_buffers` (the tree index order, `per_level_node_counts`) and
  `evaluate_posterior` (the sampled branch, `eagle_version == 1`; `safe_topk_cosine_similarity` and
  `compute_confidence_gate` of the same file);
- `models/drafters/cnets_lumina_mgpt.py`: `generate_tree_buffers` / `Tree` (the drafter runs on the nodes with
  children only) and `topK_generate` (the static branch: how each iteration's `bias_list` entry is formed).

Each step follows the code in our words (no code is copied). Where the code leaves a choice open, these fix it as
`inference` does, and say so: the code accepts with `r <= acp`, we use `r < acp` (they differ only when r equals
the chance exactly); `random.random()` per test is the shared uniform of the test's depth and slot. Left out:
image-syntax tokens (accepted outright) and non-image tokens (rejected outright), since every token here is an
image token; the all-zero residual's fallback is uniform over the vocabulary here (over the LM vocabulary there);
the unused KL term. The nodes are given in tree index order (root first, then the paths sorted by length, then
lexicographically), which is `inference.decoding.tree.StaticTreeSpec`'s node order.
"""

from __future__ import annotations

import math


def _softmax(v: list[float]) -> list[float]:
    top = max(v)
    e = [math.exp(a - top) for a in v]
    total = sum(e)
    return [a / total for a in e]


def _cosine(a: list[float], b: list[float]) -> float:
    """Row-wise L2 normalisation then a dot product (F.normalize clamps the norm at 1e-12)."""
    na = max(math.sqrt(sum(v * v for v in a)), 1e-12)
    nb = max(math.sqrt(sum(v * v for v in b)), 1e-12)
    return sum(u * v for u, v in zip(a, b, strict=True)) / (na * nb)


def tree_order(paths: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Tree index order: the root (), then the paths sorted by (length, path)."""
    return [()] + sorted(paths, key=lambda path: (len(path), path))


def drafter_rows(paths: list[tuple[int, ...]]) -> list[list[int]]:
    """The drafter's rows per iteration: iteration i runs on the nodes with children at depth i + 1, in tree index
    order (its tree buffers keep only nodes that have children); returned as tree indices."""
    order = tree_order(paths)
    parents = {path[:-1] for path in paths}
    depth = max(len(path) for path in paths)
    return [[n for n, path in enumerate(order) if len(path) == i + 1 and path in parents] for i in range(depth - 1)]


def bias_list(paths: list[tuple[int, ...]], q_full: list[list[float]], threshold: float = 0.5) -> list[list]:
    """`topK_generate`'s pairs: after iteration i's drafter forward, the cosine of every two rows' processed
    distributions (softmax, zeros kept, L2-normalised), and every (r, c), r != c, above the threshold, rows first;
    stored at index i. One entry per iteration plus an empty last one."""
    rows = drafter_rows(paths)
    out: list[list[tuple[int, int]]] = [[] for _ in range(len(rows) + 1)]
    for i, nodes in enumerate(rows):
        out[i] = [
            (r, c)
            for r, a in enumerate(nodes)
            for c, b in enumerate(nodes)
            if r != c and _cosine(q_full[a], q_full[b]) > threshold
        ]
    return out


def confidence_gate(p: list[float], mass: float = 0.8) -> float:
    """The probability at which the descending sorted mass first reaches `mass` (the smallest if it never does)."""
    ordered = sorted(p, reverse=True)
    total = 0.0
    for v in ordered:
        total += v
        if total >= mass:
            return v
    return ordered[-1]


def evaluate_posterior(
    paths: list[tuple[int, ...]],
    tokens: list[int],
    targets: list[list[float]],
    q_full: list[list[float]],
    features: list[list[float]],
    uniforms: list[list[float]],
    sampled: bool,
    sim_threshold: float = 0.9,
    pair_threshold: float = 0.5,
    nucleus: float = 0.8,
) -> tuple[list[tuple[int, int, bool, str]], int, list[float]]:
    """One verification step of the dev code on one drafted tree.

    tokens, targets (the target's distribution at each node), q_full (the drafter's at each node with children),
    features (the target's last-layer state at each node), all in tree index order; uniforms[d][c]: the uniform of
    the test of child c of the depth-d node on the walk. Returns every test (depth of the parent, slot, accepted,
    which terms the second test added: "", "c" convergence, "p" pairs, "cp" both), the last accepted node and the
    distribution the next token is drawn from.
    """
    order = tree_order(paths)
    index = {path: n for n, path in enumerate(order)}
    children = [[index[path + (c,)] for c in range(len(order)) if path + (c,) in index] for path in order]
    level_start = {}  # per_level_node_counts: the first tree index of each depth
    for n, path in enumerate(order):
        level_start.setdefault(len(path), n)
    pairs = bias_list(paths, q_full, pair_threshold)
    tests: list[tuple[int, int, bool, str]] = []
    node, walk = 0, [0]  # the accepted path (tree indices), root first
    i = 1  # the level tested: x at depth i
    while children[node]:
        gtp = list(targets[node])  # the current p at x's parent
        # bias_list[i], built one drafter iteration later (rows at depth i + 1), shifted by depth i's first index
        shifted = [(a + level_start[i], b + level_start[i]) for a, b in pairs[i]] if i < len(pairs) else []
        seen: list[int] = []
        accepted = None
        for slot, n in enumerate(children[node]):
            x = tokens[n]
            if x in seen:  # a token already tested at this level is skipped
                continue
            seen.append(x)
            r = uniforms[i - 1][slot]
            px = gtp[x]
            if sampled:  # the draw's probability without replacement: q(x) over what the earlier draws left
                earlier = sum(q_full[node][tokens[m]] for m in children[node][:slot])
                qx = min(1.0, max(0.0, q_full[node][x] / (1.0 - earlier)))
                if qx <= 0:
                    continue
            else:
                qx = 1.0
            ok, terms = r < px / qx, ""
            if not ok:
                gate = confidence_gate(gtp, nucleus)
                px_orig = px
                if i > 1:  # x's parent against its grandparent: the last two nodes of the accepted path
                    s = _cosine(_softmax(features[walk[i - 2]]), _softmax(features[walk[i - 1]]))
                    if s > sim_threshold and px_orig >= gate:
                        px = min(qx, px + r * s)
                        terms += "c"
                if px < qx and shifted and px_orig >= gate:
                    for a, b in shifted:
                        if a == n:
                            px = min(qx, px + r * gtp[tokens[b]])
                            terms += "" if terms.endswith("p") else "p"
                ok = r < px / qx
            tests.append((i - 1, slot, ok, terms))
            if ok:
                accepted = n
                break
            # rejection: relu(p - q_c), q_c the parent's q without the earlier siblings' tokens, renormalised
            # (sampled); p without x (deterministic); renormalised, uniform if nothing is left
            if sampled:
                q = list(q_full[node])
                for m in children[node][:slot]:
                    q[tokens[m]] = 0.0
                total = sum(q)
                q = [v / total for v in q]
                gtp = [max(0.0, a - b) for a, b in zip(gtp, q, strict=True)]
            else:
                gtp[x] = 0.0
            total = sum(gtp)
            gtp = [v / total for v in gtp] if total > 0 else [1.0 / len(gtp)] * len(gtp)
        if accepted is None:
            return tests, node, gtp
        node = accepted
        walk.append(node)
        i += 1
    return tests, node, list(targets[node])
