"""Exact output distribution of one verification step, by enumerating every draw and every accept/reject.

A small world (vocabulary 4) gives a target p(. | prefix) and a drafter q(. | prefix) for every prefix
of up to three tokens. For each tree kind (static sampled, dynamic sampled, deterministic) every
possible draft tree is enumerated with its probability; for each tree, `verify` is run once per
forced accept/reject pattern (uniform 0 forces an accept, 1 a reject) and each resulting walk is
weighted by the acceptance probabilities `verify` reports for the tests it made. The tokens a step
outputs (accepted drafts, then the correction or bonus token) are completed to the horizon with the
target's own AR distribution, which never increases TV distance, and compared with AR sampling:

- `exact` is lossless: TV <= 1e-6 on every tree kind;
- `cascade`, every switch included, stays within its budget: TV <= delta;
- LANTERN / LANTERN++ / GSD are measured and reported against their own bounds where they have one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict

import pytest
import torch

from inference.decoding.rules import CascadeRule, ExactRule, GSDBlocksRule, GSDRule, LanternRule
from inference.decoding.tree import StaticTreeSpec, Tree
from inference.decoding.tree_drafting import select_sampled_slots
from inference.decoding.verify import TargetView, Uniforms, build_latent_neighbours, verify

VOCAB = 4
HORIZON = 4  # three draft levels + the bonus token
STATIC_SHAPE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


class World:
    """Target and drafter distributions and CASCADE features for every prefix, seeded."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.centres = torch.randn(2, 6, generator=torch.Generator().manual_seed(seed + 99))

    def at(self, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if prefix not in self._cache:
            g = torch.Generator().manual_seed(hash((self.seed, prefix)) % (2**31))
            p = (torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.2).softmax(-1)
            q = (torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.2).softmax(-1)
            q = 0.5 * q + 0.5 * p  # an informed drafter
            cluster = (prefix[-1] % 2) if prefix else 0
            feature = self.centres[cluster] + 0.3 * torch.randn(6, generator=g)
            self._cache[prefix] = (p, q, feature)
        return self._cache[prefix]

    def ar(self) -> dict[tuple, float]:
        """The target's joint distribution over HORIZON tokens."""
        out = {}
        for seq in itertools.product(range(VOCAB), repeat=HORIZON):
            prob = 1.0
            for i, y in enumerate(seq):
                prob *= float(self.at(seq[:i])[0][y])
            out[seq] = prob
        return out

    def complete(self, prefix: tuple, prob: float, into: dict) -> None:
        """Spread `prob` of an output prefix over its AR completions to HORIZON tokens."""
        if len(prefix) == HORIZON:
            into[prefix] += prob
            return
        p = self.at(prefix)[0]
        for y in range(VOCAB):
            self.complete(prefix + (y,), prob * float(p[y]), into)


def draws_without_replacement(q: torch.Tensor, count: int):
    """Every ordered draw of `count` tokens from q without replacement: (tokens, conditional probs, prob)."""
    for seq in itertools.permutations(range(VOCAB), count):
        conds, left, prob = [], 1.0, 1.0
        for y in seq:
            cond = float(q[y]) / left
            conds.append(cond)
            prob *= cond
            left -= float(q[y])
        yield seq, conds, prob


def static_trees(world: World):
    """(tokens, parents, conditional draw probabilities, probability) of every draw of the static tree STATIC_SHAPE;
    the trees carry q only: verification derives the draw probabilities
    (`inference.decoding.verify.draw_probabilities`)."""
    spec = StaticTreeSpec(STATIC_SHAPE)
    internal = [n for n in range(spec.num_nodes) if n in spec.parents[1:]]

    def expand(i: int, tokens: list, conds: list, prob: float):
        if i == len(internal):
            yield list(tokens), list(conds), prob
            return
        node = internal[i]
        kids = [m for m in range(spec.num_nodes) if spec.parents[m] == node]
        prefix = path_tokens(spec.parents, tokens, node)
        for seq, cs, pr in draws_without_replacement(world.at(prefix)[1], len(kids)):
            for m, y, c in zip(kids, seq, cs, strict=True):
                tokens[m], conds[m] = y, c
            yield from expand(i + 1, tokens, conds, prob * pr)

    for tokens, conds, prob in expand(0, [0] * spec.num_nodes, [1.0] * spec.num_nodes, 1.0):
        yield tokens, list(spec.parents), conds, prob


def path_tokens(parents: list[int], tokens: list[int], node: int) -> tuple[int, ...]:
    out = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return tuple(reversed(out))


def dynamic_sampled_trees(world: World, width: int = 2, top_k: int = 2, depth: int = 3):
    """Every draw of a sampled dynamic tree, slots chosen by `select_sampled_slots` as the drafter does."""

    def grow(level: int, tokens, parents, conds, scores, level_nodes, prob):
        if level > depth:
            yield list(tokens), list(parents), list(conds), prob
            return
        qs = [world.at(path_tokens(parents, tokens, n))[1] for n in level_nodes]
        sorted_q = torch.stack([q.topk(top_k).values for q in qs]).float()[None]
        slots = select_sampled_slots(
            torch.tensor([scores], dtype=torch.float32), sorted_q, min(width, top_k) if level == 1 else width
        )[0]
        counts = torch.bincount(slots // top_k, minlength=len(level_nodes)).tolist()  # children per node
        # each node keeps a prefix of its draw order, listed parents-first: what the enumeration below draws
        assert slots.tolist() == [n * top_k + c for n, count in enumerate(counts) for c in range(count)]
        per_node = [
            list(draws_without_replacement(q, c)) if c else [((), [], 1.0)] for q, c in zip(qs, counts, strict=True)
        ]
        for combo in itertools.product(*per_node):
            t, p_, c_, s_, new, pr = list(tokens), list(parents), list(conds), [], [], prob
            for n, q, (seq, cs, prb), score in zip(level_nodes, qs, combo, scores, strict=True):
                pr *= prb
                for y, c in zip(seq, cs, strict=True):
                    t.append(y)
                    p_.append(n)
                    c_.append(c)
                    new.append(len(t) - 1)
                    s_.append(score + math.log(float(q[y])))
            yield from grow(level + 1, t, p_, c_, s_, new, pr)

    yield from grow(1, [0], [-1], [1.0], [0.0], [0], 1.0)


def deterministic_tree(world: World):
    """One EAGLE-2-like tree: the drafter's top-2 children at the root and its best child, top-1 below."""
    tokens, parents = [0], [-1]
    frontier = [0]
    for fan in (2, 2, 1):
        new = []
        for n in frontier[:2]:
            q = world.at(path_tokens(parents, tokens, n))[1]
            for y in q.topk(fan).indices.tolist():
                tokens.append(y)
                parents.append(n)
                new.append(len(tokens) - 1)
        frontier = new[:1]
    yield tokens, parents, [1.0] * len(tokens), 1.0


def build_batch(world: World, trees: list, sampled: bool) -> tuple[Tree, TargetView, torch.Tensor]:
    """Stack enumerated trees (same node count) into one batch."""
    rows, probs, q_full, feats, depths = [], [], [], [], []
    for tokens, parents, conds, prob in trees:
        node_p, node_q, node_f, node_d = [], [], [], []
        for n in range(len(tokens)):
            prefix = path_tokens(parents, tokens, n)
            p, q, f = world.at(prefix)
            node_p.append(p)
            node_q.append(q)
            node_f.append(f)
            node_d.append(len(prefix))
        probs.append(torch.stack(node_p))
        q_full.append(torch.stack(node_q))
        feats.append(torch.stack(node_f))
        depths.append(node_d)
        rows.append((tokens, parents, conds, prob))
    tokens = torch.tensor([r[0] for r in rows])
    parents = torch.tensor([r[1] for r in rows])
    depth_t = torch.tensor(depths)
    max_children = int(max((parents == n).sum(-1).max() for n in range(tokens.shape[1])))
    tree = Tree(
        tokens,
        parents,
        depth_t,
        torch.stack(q_full).float(),
        sampled,
        int(depth_t.max()),
        max_children,
    )
    view = TargetView(torch.stack(probs).float(), torch.stack(probs).argmax(-1), torch.stack(feats).float())
    return tree, view, torch.tensor([r[3] for r in rows], dtype=torch.float64)


def step_distribution(
    world: World, tree: Tree, view: TargetView, weights: torch.Tensor, rule, device: str = "cpu"
) -> dict:
    """Exact distribution of one verification step's output, completed to HORIZON with AR; `verify` runs on `device`
    (tests/test_gpu.py runs it on CUDA), the enumeration around it on the CPU."""
    batch = tree.tokens.shape[0]
    depth, width = tree.max_depth, tree.max_children
    patterns = list(itertools.product((0.0, 1.0), repeat=depth * width))
    count = len(patterns)

    def tile(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(count, dim=0)

    big = Tree(
        tile(tree.tokens), tile(tree.parents), tile(tree.depths), tile(tree.q_full),
        tree.sampled, depth, width,
    )  # fmt: skip
    big_view = TargetView(tile(view.probs), tile(view.greedy_tokens), tile(view.features))
    forced = torch.tensor(patterns).view(1, count, depth, width).expand(batch, -1, -1, -1).reshape(-1, depth, width)
    verdict = verify_on(device, big, big_view, rule, Uniforms(forced, torch.zeros(batch * count)))
    made = ~torch.isnan(verdict.accept_prob)  # (rows, depth, width)
    chance = verdict.accept_prob.double().nan_to_num(0.0)
    factor = torch.where(forced == 0.0, chance, 1 - chance)
    prob = torch.where(made, factor, 0.5).flatten(1).prod(-1) * tile(
        weights
    )  # patterns differing only off the walk share
    by_prefix: dict = {}  # output prefix (accepted drafts) -> summed mass of each correction/bonus token
    rows = torch.nonzero(prob > 0).flatten()
    walks = big.paths[rows, verdict.last_node[rows]]  # (rows, P)
    walk_tokens = torch.where(walks >= 0, big.tokens[rows].gather(1, walks.clamp_min(0)), -1)[:, 1:].tolist()
    mass = (prob[rows, None] * verdict.final_probs[rows].double()).tolist()
    for tokens, vector in zip(walk_tokens, mass, strict=True):
        key = tuple(t for t in tokens if t >= 0)
        acc = by_prefix.setdefault(key, [0.0] * VOCAB)
        for y in range(VOCAB):
            acc[y] += vector[y]
    out: dict = defaultdict(float)
    for prefix, vector in by_prefix.items():
        for y in range(VOCAB):
            if vector[y] > 0:
                world.complete(prefix + (y,), vector[y], out)
    return out


def verify_on(device: str, tree: Tree, view: TargetView, rule, uniforms: Uniforms):
    """`verify` with its inputs on `device`, its verdict brought back to the CPU."""
    if device == "cpu":
        return verify(tree, view, rule, uniforms)
    moved = Tree(tree.tokens.to(device), tree.parents.to(device), tree.depths.to(device), tree.q_full.to(device),
                 tree.sampled, tree.max_depth, tree.max_children)  # fmt: skip
    parts = (view.probs, view.greedy_tokens, view.features)
    moved_view = TargetView(*(None if t is None else t.to(device) for t in parts))
    verdict = verify(moved, moved_view, rule, Uniforms(uniforms.accept.to(device), uniforms.bonus.to(device)))
    return dataclasses.replace(verdict, **{f.name: getattr(verdict, f.name).cpu() for f in dataclasses.fields(verdict)})


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


TREE_KINDS = {
    "static-sampled": (static_trees, True),
    "dynamic-sampled": (dynamic_sampled_trees, True),
    "deterministic": (deterministic_tree, False),
}


def enumerate_kind(world: World, kind: str):
    builder, sampled = TREE_KINDS[kind]
    trees = list(builder(world))
    assert sum(t[3] for t in trees) == pytest.approx(1.0, abs=1e-9)
    by_size = defaultdict(list)
    for t in trees:
        by_size[len(t[0])].append(t)
    return [build_batch(world, group, sampled) for group in by_size.values()]


def output_tv(world: World, batches, rule, device: str = "cpu") -> float:
    total: dict = defaultdict(float)
    for tree, view, weights in batches:
        for key, value in step_distribution(world, tree, view, weights, rule, device).items():
            total[key] += value
    assert sum(total.values()) == pytest.approx(1.0, abs=1e-6)
    return total_variation(total, world.ar())


@pytest.fixture(scope="module", params=list(TREE_KINDS))
def case(request):
    world = World(seed=3)
    return request.param, world, enumerate_kind(world, request.param)


def test_exact_rule_is_lossless_on_every_tree_kind(case):
    kind, world, batches = case
    assert output_tv(world, batches, ExactRule()) <= 1e-6


def cascade_variants(delta: float) -> list[CascadeRule]:
    loose = dict(tau_pos=0.0, tau_seq=0.0)
    return [
        CascadeRule(delta=delta),
        CascadeRule(delta=delta, **loose),
        CascadeRule(delta=delta, use_convergence=False, **loose),
        CascadeRule(delta=delta, use_interchangeability=False, **loose),
        CascadeRule(delta=delta, conv_mode="path", **loose),
        CascadeRule(delta=delta, conf_gate=0.8, kl_gate=2.0, **loose),
        CascadeRule(delta=delta, pool_beyond_tree=True, **loose),
        CascadeRule(delta=delta, pool_beyond_tree=True, conf_gate=0.6, **loose),
    ]


@pytest.mark.parametrize("delta", [0.0, 0.05, 0.2, 0.5])
def test_cascade_stays_within_its_tv_budget_on_every_tree_kind(case, delta):
    kind, world, batches = case
    largest = 0.0
    for rule in cascade_variants(delta):
        tv = output_tv(world, batches, rule)
        assert tv <= delta + 1e-6, (kind, rule)
        largest = max(largest, tv)
    if delta >= 0.2:
        assert largest > 0.01  # the relaxation did move the output: the bound is not vacuous


PEER_RULE_TV = {
    "static-sampled": {
        "lantern": 0.183152772,
        "lantern-pooled": 0.185617715,
        "gsd-blocks": 0.226109828,
        "gsd": 0.077661306,
    },
    "dynamic-sampled": {
        "lantern": 0.162591993,
        "lantern-pooled": 0.162622079,
        "gsd-blocks": 0.195751980,
        "gsd": 0.066330013,
    },
    "deterministic": {
        "lantern": 0.347665758,
        "lantern-pooled": 0.178466035,
        "gsd-blocks": 0.582313812,
        "gsd": 0.105310693,
    },
}
"""TV(one verification step's output, AR) of each peer rule on each fixed world (World(seed=3), enumerated exactly),
recorded from this test's own run. LANTERN's delta is 0.2 here: it bounds the mass pooled per test, not the step."""

PEER_RULE_TV_TOLERANCE = 1e-6
"""The worlds are fixed seeds and the distributions are enumerated, not sampled: two runs agree to the last bit, so
the tolerance only absorbs float rounding across platforms (float32 tables, < 1e-7 here). Any change to a rule's
acceptance or residual moves these values by far more (LANTERN's two rejection modes differ by 0.17 on the
deterministic tree)."""


def test_peer_rules_are_measured_against_their_bounds(case):
    """LANTERN bounds the mass it pools per test by delta; on sampled trees (acceptance p~/q) and over several levels
    the step's TV is not bounded by delta (0.35 on the deterministic tree at delta 0.2), and GSD's rules carry no
    bound at all. Each rule's measured TV is pinned (`PEER_RULE_TV`), so a change in a rule fails here with the new
    value; the exact/CASCADE guarantees are asserted by the tests above."""
    kind, world, batches = case
    neighbours = build_latent_neighbours(torch.randn(VOCAB, 2, generator=torch.Generator().manual_seed(0)), VOCAB - 1)
    rules = {
        "lantern": LanternRule(neighbours=neighbours, k=2, delta=0.2),
        "lantern-pooled": LanternRule(neighbours=neighbours, k=2, delta=0.2, reject_zeroes="pooled"),
        "gsd-blocks": GSDBlocksRule(group=2),
        "gsd": GSDRule(embeddings=torch.zeros(VOCAB, 1), window=2, p_threshold=0.3),
    }
    measured = {name: output_tv(world, batches, rule) for name, rule in rules.items()}
    changed = {
        name: f"recorded {PEER_RULE_TV[kind][name]:.9f}, measured {tv:.9f}"
        for name, tv in measured.items()
        if abs(tv - PEER_RULE_TV[kind][name]) > PEER_RULE_TV_TOLERANCE
    }
    assert not changed, f"{kind} tree: a peer rule's step TV moved (update PEER_RULE_TV if intended): {changed}"


def first_token_distribution(p: torch.Tensor, q: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
    """Exact distribution of the first token one `exact` step emits when the root's children are its draws `ranks`
    (0-based, without replacement from q; (0, 2) skips the second), enumerated over every draw and accept/reject.

    The tree is built by hand from the draws, as a static list ((0,), (2,)) would draft it: `StaticTreeSpec`
    refuses that list, which is why the tree is not drawn with it here."""
    vocab, width = p.shape[0], len(ranks)
    out = torch.zeros(vocab, dtype=torch.float64)
    for seq in itertools.permutations(range(vocab), max(ranks) + 1):
        left, prob = 1.0, 1.0
        for y in seq:  # the probability of this ordered draw
            prob, left = prob * float(q[y]) / left, left - float(q[y])
        tree = Tree(
            torch.tensor([[0, *(seq[r] for r in ranks)]]), torch.tensor([[-1] + [0] * width]),
            torch.tensor([[0] + [1] * width]), q.float().expand(1, width + 1, -1), True, 1, width,
        )  # fmt: skip
        view = TargetView(p.float().expand(1, width + 1, -1), None, None)
        for pattern in itertools.product((0.0, 1.0), repeat=width):  # 0 forces an accept, 1 a reject
            verdict = verify(tree, view, ExactRule(), Uniforms(torch.tensor(pattern).view(1, 1, width), torch.zeros(1)))
            chance = verdict.accept_prob[0, 0].double()
            made = ~torch.isnan(chance)
            factor = torch.where(torch.tensor(pattern) == 0.0, chance, 1 - chance)
            weight = prob * float(torch.where(made, factor, 0.5).prod())  # patterns differing off the walk share
            node = int(verdict.last_node[0])
            if node:
                out[int(tree.tokens[0, node])] += weight
            else:
                out += weight * verdict.final_probs[0].double()
    return out


def test_a_static_tree_with_a_hole_is_refused_at_build_time_because_exact_would_lose():
    """Issue 41, item 6: ((0,), (2,)) takes the root's first and third draws, but verification tests the second
    child as the second draw. With V = 3, p uniform and q = (0.6, 0.3, 0.1) `exact` then emits (1/3, 0.311,
    0.356), TV 0.022, while the hole-free ((0,), (1,)) is lossless; so the list is refused when it is built."""
    p = torch.full((3,), 1 / 3, dtype=torch.float64)
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    holed = first_token_distribution(p, q, (0, 2))
    assert holed.sum() == pytest.approx(1.0, abs=1e-9)
    assert holed.tolist() == pytest.approx([1 / 3, 0.3111, 0.3556], abs=1e-4)
    assert 0.5 * (holed - p).abs().sum() == pytest.approx(0.0222, abs=1e-4)
    assert first_token_distribution(p, q, (0, 1)).tolist() == pytest.approx(p.tolist(), abs=1e-6)
    with pytest.raises(ValueError, match=r"tree path \(2,\) has a hole: its earlier sibling \(1,\) is missing"):
        StaticTreeSpec(((0,), (2,)))
    with pytest.raises(ValueError, match=r"tree path \(0, 1\) has a hole"):  # the enumeration's shape with a hole
        StaticTreeSpec(tuple(path for path in STATIC_SHAPE if path != (0, 0) and path != (0, 0, 0)))
