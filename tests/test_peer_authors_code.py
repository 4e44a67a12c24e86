"""GSD, GSD-blocks and cascade-dev against transcriptions of their authors' acceptance tests
(`tests/reference_gsd.py`, `tests/reference_cascade_dev.py`).

Random verification steps, the uniforms shared: every test's acceptance probability, each decision and the
distribution the next token is drawn from must be the authors' (1e-6). The hand-worked examples and the closed
forms against the slot loop are in tests/test_decoder_verify.py.
"""

from __future__ import annotations

import collections

import pytest
import torch
from reference_cascade_dev import evaluate_posterior, tree_order
from reference_gsd import gsd_blocks_walk, gsd_jacobi_step, squared_distances
from test_decoder_verify import SMALL_TREE, WIDE_TREE, build_case, inner_view

from inference.rules import CascadeDevRule, GSDBlocksRule, GSDRule
from inference.sampling import Proposal
from inference.tree import STATIC_TREES, StaticTreeSpec, Tree
from inference.tree_drafting import gumbel_topk
from inference.verify import TargetView, Uniforms, verify


def jacobi_chains(batch: int, vocab: int, length: int, sampled: bool, seed: int) -> tuple[Tree, TargetView]:
    """Chains of `length` drafts (one child a node, as speculative Jacobi decoding drafts one token a position):
    sampled from the drafter's q, or its top token (deterministic); q is the target's logits plus noise, so that
    whole runs are accepted too, and the targets have some zeros (a top-k)."""
    g = torch.Generator().manual_seed(seed)
    nodes = length + 1
    logits = torch.randn(batch, nodes, vocab, generator=g) * 2
    q_full = (logits + torch.randn(batch, nodes, vocab, generator=g)).softmax(-1)  # a drafter near the target
    logits[torch.rand(batch, nodes, vocab, generator=g) < 0.1] = float("-inf")
    tokens = torch.zeros(batch, nodes, dtype=torch.long)
    for node in range(length):
        draw = gumbel_topk(Proposal(q_full[:, node]), 1, g)[:, 0] if sampled else q_full[:, node].argmax(-1)
        tokens[:, node + 1] = draw
    parents = torch.arange(-1, length).expand(batch, -1)
    depths = torch.arange(nodes).expand(batch, -1)
    tree = Tree(tokens, parents, depths, q_full, sampled, length, 1)
    return tree, TargetView(logits.softmax(-1), logits.argmax(-1), None)


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_gsd_decides_as_the_gsd_authors_code_on_random_steps(sampled):
    """junhyukso/GSD's window (6 more likely, 7 less likely tokens; a plain test where the slice is empty), its p
    and distance filters and its LM-id bound, on 256 random steps of three drafts over 40 tokens. LM ids are odd,
    the bound even (no id equals it: there the authors' code reads one row past its table), and two tokens' ids
    lie above it; embeddings spread so that the distance filter keeps some window tokens and drops others."""
    vocab, length, batch, bound = 40, 3, 128, 76
    g = torch.Generator().manual_seed(7)
    lm_ids = torch.randperm(vocab, generator=g) * 2 + 1  # 1 .. 79: 77 and 79 above the bound
    embeddings = torch.randn(vocab, 2, generator=g) * 0.45
    table = torch.randn(bound, 2, generator=g)  # the authors' table over LM ids 0 .. bound - 1
    below = lm_ids < bound
    table[lm_ids[below]] = embeddings[below]
    distances = squared_distances(table.double().tolist())
    rule = GSDRule(embeddings=embeddings, token_ids=lm_ids, id_bound=bound)
    branches: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[bool] = collections.Counter()
    for seed in range(2):
        tree, view = jacobi_chains(batch, vocab, length, sampled, seed)
        uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed + 10))
        verdict = verify(tree, view, rule, uniforms)
        for b in range(batch):
            targets = view.probs[b, :length].double().tolist()
            tokens = tree.tokens[b, 1:].tolist()
            if sampled:
                drafts = tree.q_full[b, :length].double().tolist()
            else:  # a deterministic draft is proposed with q one-hot at x
                drafts = [[float(y == x) for y in range(vocab)] for x in tokens]
            accepted, residual, chances, why = gsd_jacobi_step(
                targets, drafts, tokens, uniforms.accept[b, :, 0].double().tolist(), lm_ids.tolist(), distances, bound
            )
            made = verdict.accept_prob[b, :, 0]
            assert made[: len(chances)].tolist() == pytest.approx(chances, abs=1e-6)
            assert made[len(chances) :].isnan().all()
            assert int(verdict.num_accepted[b]) == accepted
            final = verdict.final_probs[b].double()
            expected = view.probs[b, length].double() if residual is None else torch.tensor(residual).double()
            torch.testing.assert_close(final, expected, atol=1e-6, rtol=0)
            branches.update(why)
            outcomes[residual is None] += 1
    assert sum(outcomes.values()) >= 200
    assert min(branches[k] for k in ("plain", "skip", "filter")) >= 20, branches  # every branch is compared
    assert min(outcomes.values()) >= 10, outcomes  # steps that end in a rejection and steps accepted throughout


@pytest.mark.parametrize("group", [2, 3, 5])
def test_gsd_blocks_decide_as_the_cascade_authors_port_on_random_steps(group):
    """The port (dev commit 8dc3300) on 256 random steps of sampled static trees, three to six siblings a node over
    24 tokens with some zeros in the target: the block's mass under the parent's q as drafted, the block zeroed
    and relu(p - q_c) on rejection, where q_c lacks the earlier siblings' tokens."""
    vocab, batch, later_siblings = 24, 64, 0
    rule = GSDBlocksRule(group=group)
    for paths, seed in ((SMALL_TREE, 0), (SMALL_TREE, 1), (WIDE_TREE, 2), (WIDE_TREE, 3)):
        tree, view = build_case(paths, batch=batch, vocab=vocab, sampled=True, seed=seed + 10 * group)
        uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed))
        verdict = verify(tree, view, rule, uniforms)
        parents = tree.parents[0].tolist()
        children = [[n for n, u in enumerate(parents) if u == node] for node in range(len(parents))]
        for b in range(batch):
            last, final, chances = gsd_blocks_walk(
                children, tree.tokens[b].tolist(), view.probs[b].double().tolist(), tree.q_full[b].double().tolist(),
                uniforms.accept[b].double().tolist(), tree.depths[b].tolist(), group,
            )  # fmt: skip
            made = verdict.accept_prob[b][~verdict.accept_prob[b].isnan()]  # in test order: depth, then slot
            assert made.tolist() == pytest.approx(chances, abs=1e-6)
            assert int(verdict.last_node[b]) == last
            torch.testing.assert_close(verdict.final_probs[b].double(), torch.tensor(final).double(), atol=1e-6, rtol=0)
            later_siblings += max(0, len(chances) - 1)
    assert later_siblings > 100  # second and later siblings, where q(C) under q as drafted differs from q_c's


def cascade_dev_case(paths, batch: int, vocab: int, sampled: bool, seed: int) -> tuple[Tree, TargetView]:
    """Random drafted trees of one static shape where every part of the dev rule fires: the drafter's q at the nodes
    with children (0 at leaves, as static drafting leaves it) drawn around two centres, so that some rows of a level
    have cosine > 0.5 and others not; targets with a few dominant tokens (the 0.8 nucleus holds a handful) and some
    zeros; last-layer states of random scale, so that the softmaxed cosine of a parent and its parent falls on
    both sides of 0.9."""
    g = torch.Generator().manual_seed(seed)
    spec = StaticTreeSpec(paths)
    n = spec.num_nodes
    parents = torch.tensor(spec.parents).expand(batch, -1)
    centres = torch.randn(2, vocab, generator=g) * 2.5
    side = torch.randint(0, 2, (batch, n), generator=g)
    q_full = (centres[side] + torch.randn(batch, n, vocab, generator=g)).softmax(-1)
    inner = torch.zeros(n, dtype=torch.bool)
    inner[[u for u in spec.parents if u >= 0]] = True
    q_full = q_full * inner[None, :, None]
    tokens = torch.zeros(batch, n, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for node in range(n):
        kids = [m for m in range(n) if spec.parents[m] == node]
        if kids:
            draws = (
                gumbel_topk(Proposal(q_full[:, node]), len(kids), g)
                if sampled
                else q_full[:, node].topk(len(kids)).indices
            )
            tokens[:, kids] = draws
    logits = torch.randn(batch, n, vocab, generator=g) * 2.5 + centres[side]
    logits[torch.rand(batch, n, vocab, generator=g) < 0.1] = float("-inf")
    scale = torch.rand(batch, n, 1, generator=g) * 0.8
    features = torch.randn(batch, n, 8, generator=g) * scale
    tree = Tree(
        tokens, parents, torch.tensor(spec.depths).expand(batch, -1), q_full, sampled, spec.max_depth,
        spec.max_children, distinct_siblings=True,
    )  # fmt: skip
    return tree, TargetView(logits.softmax(-1), logits.argmax(-1), features)


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_cascade_dev_decides_as_the_development_code_on_random_steps(sampled):
    """The dev commit 8c40c9c's Lumina acceptance test (`reference_cascade_dev.evaluate_posterior`) on 288 random
    steps a case: naive_extend_57 (the dev runs' tree) and the wide test tree, over the view of every node and the
    decoder's view of the inner nodes, the uniforms shared. Every test made, its decision, the last accepted node
    and the distribution the next token is drawn from must be the code's (1e-6); the second test (convergence of
    parent and grandparent, and the pairs of the next level's drafter rows shifted onto this level) must turn a
    rejection into an acceptance often."""
    vocab, steps = 32, 0
    relaxed: collections.Counter[str] = collections.Counter()
    rule = CascadeDevRule()
    for name, paths, batch, seed in (
        ("naive_extend_57", STATIC_TREES["naive_extend_57"], 96, 0),
        ("wide", WIDE_TREE, 48, 1),
    ):
        spec = StaticTreeSpec(paths)
        assert tree_order(list(paths)) == spec.order  # our node ids are the code's tree indices
        tree, view = cascade_dev_case(paths, batch, vocab, sampled, seed + 2 * sampled)
        uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed + 5))
        for target_view in (view, inner_view(view, paths)):
            verdict = verify(tree, target_view, rule, uniforms)
            for b in range(batch):
                tests, last, final = evaluate_posterior(
                    list(paths), tree.tokens[b].tolist(), view.probs[b].double().tolist(),
                    tree.q_full[b].double().tolist(), view.features[b].double().tolist(),
                    uniforms.accept[b].double().tolist(), sampled,
                )  # fmt: skip
                made = torch.nonzero(~verdict.accept_prob[b].isnan()).tolist()  # (depth, slot), test order
                assert made == [[d, c] for d, c, _, _ in tests], (name, b)
                decided = [bool(uniforms.accept[b, d, c] < verdict.accept_prob[b, d, c]) for d, c in made]
                assert decided == [ok for _, _, ok, _ in tests], (name, b)
                assert int(verdict.last_node[b]) == last
                torch.testing.assert_close(
                    verdict.final_probs[b].double(), torch.tensor(final).double(), atol=1e-6, rtol=0
                )
                relaxed.update(terms for _, _, ok, terms in tests if ok and terms)
                steps += 1
    assert steps >= 200
    # the second test turns rejections into acceptances, through either term and through both
    assert min(relaxed[k] for k in ("c", "p", "cp")) >= 3, relaxed
