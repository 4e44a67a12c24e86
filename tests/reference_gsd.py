"""The peers' own acceptance tests for GSD and GSD-blocks, restated in plain Python floats (tests only).

Each function follows one file of the authors' code, step by step, in our words (no code is copied):

- `gsd_position` and `gsd_jacobi_step`: junhyukso/GSD, `scheduler/jacobi_iteration_lumina_mgpt.py`,
  `SpeculativeSampler.__call__` (file last changed in e7929253, read at 4216c7c2). One draft per position
  (speculative Jacobi decoding), tested position after position until the first rejection.
- `gsd_blocks_node` and `gsd_blocks_walk`: selinyldrm/Deepseek-JanusPro-EAGLE, `models/ea2_model_llamagen.py` at
  commit 8dc3300f, `evaluate_posterior_v1`, the branch with a logits processor (sampled drafts on a tree).

Where the originals leave a choice open, these fix it as `inference` does, and say so: their sorts are not stable
(ties here go by token id, as in a stable descending sort); they accept with `r < final_p` (GSD) or `r <= acp`
(GSD-blocks), we use `r < chance` for both (they differ only when r equals the chance exactly). Left out:
GSD's residual goes through the sampler's logits processors before it is drawn from (our decoder applies the
sampling settings to the target before verification, not to the residual), and GSD-blocks' all-zero residual
falls back to uniform over the image tokens (every token here is one).
"""

from __future__ import annotations


def _normalised(p: list[float]) -> list[float]:
    total = sum(p)
    return [v / total for v in p]


def squared_distances(rows: list[list[float]]) -> list[list[float]]:
    """The GSD authors' distance table over the LM ids below their bound: |a|^2 + |b|^2 - 2 a.b for every pair."""
    norms = [sum(v * v for v in a) for a in rows]
    return [[norms[i] + norms[j] - 2 * sum(u * v for u, v in zip(a, b, strict=True)) for j, b in enumerate(rows)]
            for i, a in enumerate(rows)]  # fmt: skip


def gsd_position(
    target: list[float],
    draft: list[float],
    x: int,
    lm_ids: list[int],
    distances: list[list[float]],
    id_bound: int = 10_000,
    p_threshold: float = 0.15,
    distance_threshold: float = 0.5,
    half: int = 7,
) -> tuple[float, str]:
    """GSD's acceptance probability of draft token x at one position, and which branch decided it.

    target, draft: the target's and the draft's distributions over the vocabulary; lm_ids: each vocabulary
    index's LM id; distances: the table over LM ids 0 .. len(distances) - 1 (theirs: the first 10,000 rows of the
    LM's input embeddings). Branches: "plain" (the window slice came out empty, or indexing the table failed),
    "skip" (a window id above the bound: no distance filter), "filter".
    """
    # their ascending sort of the logits, by target probability here; ties: the larger id first, so that read
    # backwards it is the descending order with ties by id
    ascending = sorted(range(len(target)), key=lambda y: (target[y], -y))
    place = ascending.index(x)
    window = ascending[place - half : place + half]  # a tensor slice: a negative start wraps, empty for V >= 2 half
    plain = min(1.0, target[x] / draft[x])
    if not window:  # their max() over the empty slice raises, and the except clause takes the plain test
        return plain, "plain"
    ids = [lm_ids[y] for y in window]
    close = [abs(target[y] - target[x]) < p_threshold for y in window]
    if max(ids) <= id_bound:
        if max(ids) >= len(distances) or lm_ids[x] >= len(distances):  # reading past the table raises: plain test
            return plain, "plain"
        near = [distances[lm_ids[x]][i] < distance_threshold for i in ids]
        branch = "filter"
    else:
        near = [True] * len(window)
        branch = "skip"
    kept = [y for y, c, n in zip(window, close, near, strict=True) if c and n]
    return min(1.0, sum(target[y] for y in kept) / sum(draft[y] for y in kept)), branch


def gsd_jacobi_step(
    targets: list[list[float]],
    drafts: list[list[float]],
    tokens: list[int],
    uniforms: list[float],
    lm_ids: list[int],
    distances: list[list[float]],
    id_bound: int = 10_000,
) -> tuple[int, list[float] | None, list[float], list[str]]:
    """One verification of a run of drafted positions: position d holds tokens[d], drafted from drafts[d], under the
    target's targets[d]. Returns how many were accepted, the residual relu(p - q) (normalised) of the first
    rejected position (None if all were accepted), the acceptance probability of every test made and its branch."""
    chances, branches = [], []
    for d, x in enumerate(tokens):
        chance, branch = gsd_position(targets[d], drafts[d], x, lm_ids, distances, id_bound)
        chances.append(chance)
        branches.append(branch)
        if not uniforms[d] < chance:
            residual = [max(0.0, p - q) for p, q in zip(targets[d], drafts[d], strict=True)]
            return d, _normalised(residual), chances, branches
    return len(tokens), None, chances, branches


def gsd_blocks_node(
    target: list[float], q_parent: list[float], siblings: list[int], uniforms: list[float], group: int
) -> tuple[int | None, list[float], list[float]]:
    """GSD-blocks at one tree node: its children's tokens `siblings` in draw order, drawn from q_parent without
    replacement, each tested with its own uniform. Returns the accepted sibling's slot (None if all were rejected),
    the residual target after the rejections, and each test's acceptance probability."""
    residual, chances, tested = list(target), [], []
    for slot, x in enumerate(siblings):
        if x in tested:  # a repeated token is tested once
            continue
        order = sorted(range(len(residual)), key=lambda y: (-residual[y], y))  # descending; ties by id
        start = order.index(x) // group * group
        block = order[start : start + group]
        # the block's mass under the current residual over its mass under the parent's q as drafted
        chance = min(1.0, sum(residual[y] for y in block) / sum(q_parent[y] for y in block))
        chances.append(chance)
        if uniforms[slot] < chance:
            return slot, residual, chances
        # rejection: the proposal loses the earlier siblings' tokens (not x's), renormalised; the block is zeroed
        # in the residual, then relu(residual - proposal), renormalised (uniform if nothing is left)
        proposal = list(q_parent)
        if tested:
            for y in tested:
                proposal[y] = 0.0
            proposal = _normalised(proposal)
        for y in block:
            residual[y] = 0.0
        residual = [max(0.0, a - b) for a, b in zip(residual, proposal, strict=True)]
        residual = _normalised(residual) if sum(residual) > 0 else [1.0 / len(residual)] * len(residual)
        tested.append(x)
    return None, residual, chances


def gsd_blocks_walk(
    children: list[list[int]],
    tokens: list[int],
    targets: list[list[float]],
    q_full: list[list[float]],
    uniforms: list[list[float]],
    depths: list[int],
    group: int,
) -> tuple[int, list[float], list[float]]:
    """The port's walk down a drafted tree from the root: at each node its children are tested (`gsd_blocks_node`,
    with the uniforms of the node's depth); an accepted child is the next node. Returns the last accepted node, the
    distribution the next token is drawn from (the residual after a full rejection, the target at a leaf), and
    every test's acceptance probability in order."""
    node, chances = 0, []
    while children[node]:
        kids = children[node]
        slot, residual, made = gsd_blocks_node(
            targets[node], q_full[node], [tokens[k] for k in kids], uniforms[depths[node]], group
        )
        chances += made
        if slot is None:
            return node, residual, chances
        node = kids[slot]
    return node, targets[node], chances
