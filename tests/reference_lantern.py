"""LANTERN's and LANTERN++'s acceptance test, restated in plain Python floats (tests only).

Source: jadohu/LANTERN at commit 3a56e45 ("Initial Release"):
- `models/ea_model_lumina_mgpt.py`, `evaluate_posterior` (sampling branch): `eagle_version == 1` is the static tree
  with sampled drafts, `eagle_version == 2` the dynamic tree with deterministic drafts;
- `models/ea_model_llamagen.py`, `evaluate_posterior_v1` (static tree, the branch with a logits processor) and
  `evaluate_posterior` (dynamic tree, the same branch); `models/ea_model_anole.py` holds the same two functions;
- `models/drafters/cnets_{llamagen,lumina_mgpt}.py`, `sample` (each drawn token's probability without
  replacement) and `models/drafters/utils.py`, `generate_tree_buffers` (`p_indices`, `b_indices`: the parent's
  row of the drafter's distributions and the earlier siblings);
- `entrypoints/generate_codebook.py` (the table of nearest latents).

Each step follows the code in our words (no code is copied). The files differ in one place only, the static tree's
rejection when something was pooled: the Lumina-mGPT file sets the *target* to 0 at x's k + 1 nearest codes, the
LlamaGen (and Anole) file sets the *proposal* to 0 there, before relu(p - q) (`zeroes` "p" or "q"). On the dynamic
tree both set p to 0 at x and, if something was pooled, at its k + 1 nearest codes.

Where the code leaves a choice open these fix it as `inference` does, and say so: the code accepts with
`r <= acp`, we use `r < acp` (they differ only when r equals the chance exactly); `random.random()` per test made is
the shared uniform of the test's depth and slot. The code walks the rows of root-to-leaf paths whose tokens match
the accepted prefix; with distinct siblings (the drafters' trees: draws without replacement, or a top-k) those are
the rows through the accepted node, and they meet its children in tree index order, which is how this walks the
tree. Left out: the Lumina file's image-syntax tokens (accepted outright) and non-image tokens (rejected outright),
since every token here is an image token, and the `image_token_offset` of its ids; greedy decoding (no logits
processor), a separate function.
"""

from __future__ import annotations

import math


def nearest_codes(codebook: list[list[float]]) -> list[list[int]]:
    """`generate_codebook.py`'s table: for each code, every other code by increasing Euclidean distance (a code is
    at infinite distance from itself, so it comes last and is dropped here)."""
    rows = []
    for i, a in enumerate(codebook):
        distance = [math.dist(a, b) if j != i else math.inf for j, b in enumerate(codebook)]
        rows.append(sorted(range(len(codebook)), key=lambda j: distance[j])[: len(codebook) - 1])
    return rows


def relaxed_mass(gtp: list[float], x: int, nearest: list[int], k: int, delta: float) -> tuple[float, bool]:
    """p~(x) and whether anything was pooled (the code's `indices != -1`). The running sums of p over x's k nearest
    codes, nearest first; the last one not above delta (LANTERN, delta <= 1) or (delta - 1) p(x) (LANTERN++, where
    `lantern_delta` is lambda) is added to p(x). "Pooled" means the nearest code's own p passed the bound, even when
    that p is 0."""
    px = gtp[x]
    bound = (delta - 1) * px if delta > 1.0 else delta
    running, last = 0.0, None
    for code in nearest[:k]:
        running += gtp[code]
        if running <= bound:
            last = running
    return (px, False) if last is None else (px + last, True)


def evaluate_posterior(
    paths: list[tuple[int, ...]],
    tokens: list[int],
    targets: list[list[float]],
    q_full: list[list[float]],
    uniforms: list[list[float]],
    nearest: list[list[int]],
    k: int,
    delta: float,
    sampled: bool,
    zeroes: str = "p",
) -> tuple[list[tuple[int, int, float, bool, bool, float]], int, list[float]]:
    """One verification step on one drafted tree.

    tokens, targets (the target's distribution at each node) and q_full (the drafter's processed distribution at
    each node) in tree index order: the root (), then the paths sorted by (length, path); uniforms[d][c]: the uniform
    of the test of child c of the depth-d node on the walk; nearest: `nearest_codes`; delta: `lantern_delta` (above
    1 it is LANTERN++'s lambda); sampled: the static tree's drawn drafts (else the dynamic tree's, proposed with
    q = 1); zeroes: "p" (Lumina-mGPT file) or "q" (LlamaGen file). Returns every test made (depth of the parent,
    slot, acceptance probability min(1, p~/q), accepted, pooled, the plain test's min(1, p/q)), the last accepted node
    and the distribution the next token is drawn from.
    """
    order = [()] + sorted(paths, key=lambda path: (len(path), path))
    index = {path: n for n, path in enumerate(order)}
    children = [[index[path + (c,)] for c in range(len(order)) if path + (c,) in index] for path in order]
    tests: list[tuple[int, int, float, bool, bool, float]] = []
    node, depth = 0, 0
    while children[node]:
        gtp = list(targets[node])  # a fresh target at each level
        seen: list[int] = []
        rejected_any, accepted = False, None
        for slot, n in enumerate(children[node]):
            x = tokens[n]
            if x in seen:  # a token met twice at one level is tested once
                continue
            seen.append(x)
            r = uniforms[depth][slot]
            px, pooled = relaxed_mass(gtp, x, nearest[x], k, delta)
            if sampled:
                # `sample`: the draw's q over what the earlier draws at this node left, clamped to [0, 1]; a draw
                # whose ratio is not finite reads -1, clamped to 0, and is passed over
                earlier = sum(q_full[node][tokens[m]] for m in children[node][:slot])
                left = 1.0 - earlier
                ratio = q_full[node][x] / left if left != 0 else -1.0
                qx = min(1.0, max(0.0, ratio))
                if qx <= 0:
                    continue
            else:
                qx = 1.0
            chance = px / qx
            ok = r < chance
            tests.append((depth, slot, min(1.0, chance), ok, pooled, min(1.0, gtp[x] / qx)))
            if ok:
                accepted = n
                break
            rejected_any = True
            zapped = nearest[x][: k + 1] if pooled else []
            if sampled:
                # the parent's q without the earlier siblings' tokens, renormalised (when there are any)
                q = list(q_full[node])
                if slot > 0:
                    for m in children[node][:slot]:
                        q[tokens[m]] = 0.0
                    total = sum(q)
                    q = [v / total for v in q]
                for code in zapped:  # LlamaGen: q loses x's k + 1 nearest (not renormalised); Lumina: p does
                    if zeroes == "q":
                        q[code] = 0.0
                    else:
                        gtp[code] = 0.0
                gtp = [max(0.0, a - b) for a, b in zip(gtp, q, strict=True)]
            else:
                gtp[x] = 0.0
                for code in zapped:
                    gtp[code] = 0.0
            total = sum(gtp)
            gtp = [v / total for v in gtp] if total > 0 else [1.0 / len(gtp)] * len(gtp)
        if accepted is None:
            # every child rejected (or passed over): the residual if a test rejected, else the node's target
            return tests, node, gtp if rejected_any else list(targets[node])
        node, depth = accepted, depth + 1
    return tests, node, list(targets[node])
