"""Verification rules: vectorised `verify` against the naive per-node loop, and exact output distributions.

The TV tests enumerate every acceptance trajectory of one verification step (forcing each accept /
reject with uniforms of 0 / 1 and weighting it by the acceptance probabilities `verify` reports), so
the output distribution of a step is computed exactly and compared with the target's own.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from inference.tree import StaticTreeSpec, Tree, gumbel_topk
from inference.verify import (
    CascadeRule,
    ExactRule,
    GSDRule,
    LanternRule,
    TargetView,
    Uniforms,
    build_latent_neighbours,
    verify,
    verify_reference,
)

SMALL_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (1, 1, 0))
FULL_DEPTH_2 = tuple((a,) for a in range(3)) + tuple((a, b) for a in range(3) for b in range(3))


def build_case(paths, batch: int, vocab: int, sampled: bool, seed: int, dim: int = 8) -> tuple[Tree, TargetView]:
    """Random trees of one shape with target distributions and clustered features (so merges happen)."""
    g = torch.Generator().manual_seed(seed)
    spec = StaticTreeSpec(paths)
    n = spec.num_nodes
    parents = torch.tensor(spec.parents).expand(batch, -1)
    q_full = (torch.randn(batch, n, vocab, generator=g) * 1.5).softmax(-1)
    tokens = torch.zeros(batch, n, dtype=torch.long)
    q_cond = torch.ones(batch, n)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for node in range(n):
        kids = [m for m in range(n) if spec.parents[m] == node]
        if not kids:
            continue
        if sampled:
            draws, probs = gumbel_topk(q_full[:, node], len(kids), g)
            q_cond[:, kids] = probs
        else:  # distinct top-ranked tokens, with an occasional duplicate sibling to exercise dedupe
            draws = q_full[:, node].topk(len(kids), dim=-1).indices
            duplicate = torch.rand(batch, generator=g) < 0.2
            draws[:, -1] = torch.where(duplicate, draws[:, 0], draws[:, -1])
        tokens[:, kids] = draws
    logits = torch.randn(batch, n, vocab, generator=g) * 2
    logits[torch.rand(batch, n, vocab, generator=g) < 0.15] = float("-inf")  # top-k style zeros
    probs = logits.softmax(-1)
    centres = torch.randn(3, dim, generator=g)
    features = centres[tokens % 3] + 0.4 * torch.randn(batch, n, dim, generator=g)
    tree = Tree(
        tokens,
        parents,
        torch.tensor(spec.depths).expand(batch, -1),
        q_cond,
        q_full,
        sampled,
        spec.max_depth,
        spec.max_children,
    )
    return tree, TargetView(probs, logits.argmax(-1), features)


def all_rules(vocab: int, seed: int = 0) -> list:
    codebook = torch.randn(vocab, 4, generator=torch.Generator().manual_seed(seed))
    neighbours = build_latent_neighbours(codebook, vocab - 1)
    loose = dict(tau_pos=0.6, tau_seq=0.4)
    return [
        ExactRule(),
        LanternRule(neighbours=neighbours, k=4, delta=0.2),
        LanternRule(neighbours=neighbours, k=4, delta=0.2, reject_zeroes="pooled"),
        LanternRule(neighbours=neighbours, k=3, lam=3.0),
        GSDRule(group=3),
        CascadeRule(delta=0.5, **loose),
        CascadeRule(delta=0.3, use_convergence=False, **loose),
        CascadeRule(delta=0.3, use_interchangeability=False, **loose),
        CascadeRule(delta=0.4, conv_mode="path", **loose),
        CascadeRule(delta=0.5, conf_gate=0.8, kl_gate=4.0, **loose),
        CascadeRule(delta=0.5, pool_beyond_tree=True, **loose),
        CascadeRule(delta=0.3, conv_mode="path", pool_beyond_tree=True, **loose),
        CascadeRule(delta=0.6, conf_gate=0.8, pool_beyond_tree=True, **loose),
    ]


def assert_same_verdict(a, b) -> None:
    assert a.last_node.tolist() == b.last_node.tolist()
    assert a.num_accepted.tolist() == b.num_accepted.tolist()
    assert a.next_token.tolist() == b.next_token.tolist()
    assert torch.allclose(a.tv_charged.float(), b.tv_charged.float(), atol=1e-6)
    assert torch.allclose(a.accept_prob, b.accept_prob, atol=1e-5, equal_nan=True)
    assert torch.allclose(a.final_probs, b.final_probs, atol=1e-5)


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_vectorised_verify_equals_the_naive_per_node_loop(sampled):
    vocab = 10
    for seed in range(2):
        tree, view = build_case(SMALL_TREE, batch=6, vocab=vocab, sampled=sampled, seed=seed)
        for rule in all_rules(vocab, seed):
            uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed))
            max_accept = torch.tensor([3, 3, 2, 1, 0, 3])
            assert_same_verdict(
                verify(tree, view, rule, uniforms, max_accept), verify_reference(tree, view, rule, uniforms, max_accept)
            )


def test_vectorised_greedy_verify_equals_the_naive_loop():
    tree, view = build_case(SMALL_TREE, batch=6, vocab=10, sampled=False, seed=5)
    view.probs = view.probs.clone()
    agree = view.probs.argmax(-1)  # make the greedy target agree with some drafts
    tree.tokens[:, 1] = agree[:, 0]
    tree.tokens[:, 4] = agree[:, 1]
    for rule in all_rules(10):
        uniforms = Uniforms.draw(tree, None)
        a = verify(tree, view, rule, uniforms, greedy=True)
        assert_same_verdict(a, verify_reference(tree, view, rule, uniforms, greedy=True))
        assert (a.next_token == view.greedy_tokens.gather(1, a.last_node[:, None])[:, 0]).all()
    assert (verify(tree, view, ExactRule(), uniforms, greedy=True).num_accepted >= 1).all()


def test_cascade_without_budget_is_the_exact_rule():
    tree, view = build_case(SMALL_TREE, batch=8, vocab=10, sampled=False, seed=7)
    uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(1))
    exact = verify(tree, view, ExactRule(), uniforms)
    relaxed = verify(tree, view, CascadeRule(delta=0.0, tau_pos=-1.0, tau_seq=-1.0), uniforms)
    assert exact.last_node.tolist() == relaxed.last_node.tolist()
    assert exact.next_token.tolist() == relaxed.next_token.tolist()


def step_distributions(tree: Tree, view: TargetView, rule) -> tuple[dict, dict, float]:
    """Exact output distribution of one verification step (batch of one deterministic tree), the
    target's own distribution over the same outcomes (tokens up to the first one off the tree), and
    the total probability of the enumerated trajectories (must be 1)."""
    depth, width, vocab = tree.max_depth, tree.max_children, view.probs.shape[-1]
    count = (width + 1) ** depth  # one row per forced pattern: at each depth accept slot c, or reject all (c = width)
    accept = torch.ones(count, depth, width)
    for pattern in range(count):
        for d in range(depth):
            c = pattern // (width + 1) ** d % (width + 1)
            if c < width:
                accept[pattern, d, c] = 0.0
    rows = Tree(
        tree.tokens.expand(count, -1),
        tree.parents.expand(count, -1),
        tree.depths.expand(count, -1),
        tree.q_cond.expand(count, -1),
        tree.q_full.expand(count, -1, -1),
        tree.sampled,
        depth,
        width,
    )
    many = TargetView(view.probs.expand(count, -1, -1), None, view.features.expand(count, -1, -1))
    v = verify(rows, many, rule, Uniforms(accept, torch.zeros(count)))
    trajectories = {}
    for r in range(count):
        path = [n for n in tree.paths[0, int(v.last_node[r])].tolist() if n >= 0]
        prob, key = 1.0, []
        for d in range(depth):
            chances = v.accept_prob[r, d]
            taken = tree.children[0, path[d]].tolist().index(path[d + 1]) if d + 1 < len(path) else None
            for j in range(width):
                if not torch.isnan(chances[j]):
                    prob *= float(chances[j]) if j == taken else 1 - float(chances[j])
            key.append(taken)
        trajectories[tuple(key)] = (prob, tuple(tree.tokens[0, path[1:]].tolist()), v.final_probs[r])
    spec = defaultdict(float)
    for prob, prefix, final in trajectories.values():
        for y in range(vocab):
            spec[prefix + (y,)] += prob * float(final[y])
    target = defaultdict(float)

    def walk(node: int, prefix: tuple, prob: float) -> None:
        kids: dict[int, int] = {}
        for m in tree.children[0, node].tolist():
            if m >= 0:
                kids.setdefault(int(tree.tokens[0, m]), m)  # a duplicate sibling is never tried
        for y in range(vocab):
            mass = prob * float(view.probs[0, node, y])
            if y in kids:
                walk(kids[y], prefix + (y,), mass)
            else:
                target[prefix + (y,)] += mass

    walk(0, (), 1.0)
    return spec, target, sum(prob for prob, _, _ in trajectories.values())


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_rule_step_distribution_is_the_targets_by_enumeration(seed):
    tree, view = build_case(FULL_DEPTH_2, batch=1, vocab=6, sampled=False, seed=seed)
    tree.tokens[0, 1:4] = torch.tensor([0, 1, 2])  # distinct siblings
    spec, target, covered = step_distributions(tree, view, ExactRule())
    assert covered == pytest.approx(1.0, abs=1e-5)
    assert total_variation(spec, target) < 1e-5


@pytest.mark.parametrize("delta", [0.1, 0.3, 0.5])
def test_cascade_keeps_tv_within_its_budget_on_dynamic_trees_by_enumeration(delta):
    largest = 0.0
    for seed in range(4):
        tree, view = build_case(FULL_DEPTH_2, batch=1, vocab=6, sampled=False, seed=seed)
        view.features = torch.ones_like(view.features) + 0.05 * torch.randn_like(view.features)  # all similar
        view.features[..., 0] += torch.arange(view.features.shape[1]) * 0.01
        for rule in (
            CascadeRule(delta=delta, tau_pos=-1.0, tau_seq=-1.0),
            CascadeRule(delta=delta, tau_pos=0.0, tau_seq=0.0, conv_mode="path"),
            CascadeRule(delta=delta, tau_pos=-1.0, tau_seq=-1.0, pool_beyond_tree=True),
            CascadeRule(delta=delta, tau_pos=0.0, tau_seq=0.0, conv_mode="path", pool_beyond_tree=True),
        ):
            spec, target, covered = step_distributions(tree, view, rule)
            assert covered == pytest.approx(1.0, abs=1e-5)
            tv = total_variation(spec, target)
            assert tv <= delta + 1e-5
            largest = max(largest, tv)
    assert largest > 0.02  # the relaxation did move mass: the test is not vacuous


def test_lantern_accepts_more_than_exact_and_pools_only_within_delta():
    tree, view = build_case(SMALL_TREE, batch=64, vocab=10, sampled=False, seed=3)
    neighbours = build_latent_neighbours(torch.randn(10, 4, generator=torch.Generator().manual_seed(0)), 9)
    uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(2))
    exact = verify(tree, view, ExactRule(), uniforms)
    lantern = verify(tree, view, LanternRule(neighbours=neighbours, k=5, delta=0.3), uniforms)
    first = verify(tree, view, LanternRule(neighbours=neighbours, k=5, delta=0.3), uniforms).accept_prob[:, 0, 0]
    plain = exact.accept_prob[:, 0, 0]
    assert (first >= plain - 1e-6).all() and (first <= plain + 0.3 + 1e-6).all()
    assert lantern.num_accepted.float().mean() >= exact.num_accepted.float().mean()


def test_gsd_accepts_whole_rank_clusters():
    tree, view = build_case(FULL_DEPTH_2, batch=1, vocab=6, sampled=False, seed=0)
    view.probs = torch.full_like(view.probs, 1 / 6)
    tree.q_full = torch.full_like(tree.q_full, 1 / 6)
    verdict = verify(tree, view, GSDRule(group=6), Uniforms.draw(tree, None))
    assert verdict.num_accepted.item() == 2  # p(C) = q(C) = 1: every first child is accepted


def test_cascade_sibling_pooling_cannot_raise_acceptance_on_dynamic_trees_but_beyond_tree_pooling_can():
    """With deterministic drafts, sibling merges only move mass between siblings: the chance that some child
    is accepted stays the siblings' target mass, as for `exact`. `pool_beyond_tree` adds undrafted support
    tokens to a converged sibling, raising that chance by exactly the budget it charges (<= delta)."""
    tree, view = build_case(FULL_DEPTH_2, batch=1, vocab=6, sampled=False, seed=1)
    tree.tokens[0, 1:4] = torch.tensor([0, 1, 2])  # distinct siblings; tokens 3..5 are never drafted at the root
    noise = torch.randn(view.features.shape, generator=torch.Generator().manual_seed(0))
    view.features = 1 + 0.05 * noise  # all nodes alike: every sibling converged
    view.features[..., 0] += torch.arange(view.features.shape[1]) * 0.01
    p_root = view.probs[0, 0]
    sibling_mass = float(p_root[:3].sum())

    def first_level_acceptance(rule) -> float:
        spec, _, covered = step_distributions(tree, view, rule)
        assert covered == pytest.approx(1.0, abs=1e-5)
        return sum(mass for outcome, mass in spec.items() if len(outcome) >= 2 and outcome[0] in (0, 1, 2))

    loose = dict(tau_pos=-1.0, tau_seq=-1.0)
    assert first_level_acceptance(ExactRule()) == pytest.approx(sibling_mass, abs=1e-5)
    assert first_level_acceptance(CascadeRule(delta=0.5, **loose)) == pytest.approx(sibling_mass, abs=1e-5)
    reject_all = Uniforms(torch.ones(1, 2, 3), torch.zeros(1))  # only the root level is planned
    gains = []
    for delta in (0.05, 0.2, 1.0):
        siblings_only = CascadeRule(delta=delta, **loose)
        beyond = CascadeRule(delta=delta, pool_beyond_tree=True, **loose)
        spent = float(verify(tree, view, beyond, reject_all).tv_charged)
        moved = spent - float(verify(tree, view, siblings_only, reject_all).tv_charged)
        assert first_level_acceptance(beyond) == pytest.approx(sibling_mass + moved, abs=1e-5)
        assert spent <= delta + 1e-6
        gains.append(moved)
    assert gains[-1] == pytest.approx(float(p_root[3:].sum()), abs=1e-5)  # delta 1: every undrafted token pooled
    assert min(gains) >= 0 and gains[-1] > 0.01
