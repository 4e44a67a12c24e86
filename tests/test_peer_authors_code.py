"""GSD, GSD-blocks, cascade-dev, LANTERN and LANTERN++ against transcriptions of their authors' acceptance tests
(`tests/reference_gsd.py`, `tests/reference_cascade_dev.py`, `tests/reference_lantern.py`).

Random verification steps, the uniforms shared: every test's acceptance probability, each decision and the
distribution the next token is drawn from must be the authors' (1e-6; LANTERN's acceptance probabilities to 1e-6 or
1e-5 of their value, see `lantern_disagreements`). A rule one setting away from LANTERN's must disagree. The
hand-worked examples and the closed forms against the slot loop are in tests/test_decoder_verify.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import pytest
import torch
from reference_cascade_dev import evaluate_posterior, tree_order
from reference_gsd import gsd_blocks_walk, gsd_jacobi_step, squared_distances
from reference_lantern import evaluate_posterior as lantern_posterior
from reference_lantern import nearest_codes
from test_decoder_verify import SMALL_TREE, WIDE_TREE, build_case, inner_view

from inference.decoding.rules import CascadeDevRule, GSDBlocksRule, GSDRule, LanternRule
from inference.decoding.sampling import Proposal
from inference.decoding.tree import STATIC_TREES, StaticTreeSpec, Tree
from inference.decoding.tree_drafting import gumbel_topk
from inference.decoding.verify import TargetView, Uniforms, build_latent_neighbours, verify


def draw_tree_tokens(spec: StaticTreeSpec, q_full: torch.Tensor, sampled: bool, g: torch.Generator) -> torch.Tensor:
    """(B, N) node tokens: a random root, then each node's children drawn from its q without replacement (sampled)
    or its top tokens (deterministic), in child order."""
    batch, n, vocab = q_full.shape
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
    return tokens


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
    tokens = draw_tree_tokens(spec, q_full, sampled, g)  # (B, N)
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


def lantern_case(paths, batch: int, vocab: int, sampled: bool, seed: int) -> tuple[Tree, TargetView]:
    """Random drafted trees of one static shape: the drafter's q near the target (so that whole paths are accepted
    too), drafts drawn from q without replacement (sampled) or its top tokens (deterministic, distinct siblings as
    in a dynamic tree), targets with some zeros (a top-k)."""
    g = torch.Generator().manual_seed(seed)
    spec = StaticTreeSpec(paths)
    n = spec.num_nodes
    logits = torch.randn(batch, n, vocab, generator=g) * 2
    q_full = (logits + torch.randn(batch, n, vocab, generator=g)).softmax(-1)
    tokens = draw_tree_tokens(spec, q_full, sampled, g)  # (B, N)
    logits[torch.rand(batch, n, vocab, generator=g) < 0.1] = float("-inf")
    tree = Tree(
        tokens, torch.tensor(spec.parents).expand(batch, -1), torch.tensor(spec.depths).expand(batch, -1), q_full,
        sampled, spec.max_depth, spec.max_children, distinct_siblings=True,
    )  # fmt: skip
    return tree, TargetView(logits.softmax(-1), logits.argmax(-1), None)


LANTERN_SETTINGS = {
    "lantern-k6-delta0.1": (6, 0.1),  # LANTERN's default delta, k within the test vocabulary
    "lantern++-k10-lam3": (10, 3.0),  # the CASCADE authors' LANTERN++ baseline
    "lantern++-k5-lam10": (5, 10.0),  # one of jadohu/LANTERN run.sh's LANTERN++ runs
}
"""(k, the authors' `lantern_delta`: above 1 it is LANTERN++'s lambda)."""

LANTERN_CASES = (("naive_extend_57", STATIC_TREES["naive_extend_57"], 128, 0), ("wide", WIDE_TREE, 96, 1))
"""LANTERN++'s tree and the wide test tree: 224 steps a case, each over the view of every node and the decoder's
view of the inner nodes."""


def lantern_disagreements(
    rule: LanternRule, k: int, delta: float, sampled: bool, zeroes: str, seed: int, counts: collections.Counter
) -> list[str]:
    """`rule` against `reference_lantern.evaluate_posterior` with (k, delta, zeroes) on `LANTERN_CASES`, the uniforms
    shared: each step where a test made, its acceptance probability, its decision, the last accepted node or the
    distribution the next token is drawn from (1e-6) differs, described. The acceptance probabilities agree to 1e-6
    or 1e-5 of their value: a sampled draw's q over what the earlier draws left, 1 - sum(q), is taken in float32 by
    `verify` (as by the authors' code) and in float64 here, and a leftover of a few percent scales its rounding
    (about 2e-6 seen). `counts` gathers what the steps did."""
    vocab, bad = 32, []
    codebook = torch.randn(vocab, 4, generator=torch.Generator().manual_seed(seed))
    nearest = nearest_codes(codebook.double().tolist())
    assert build_latent_neighbours(codebook, vocab - 1).tolist() == nearest  # the authors' table
    for name, paths, batch, case_seed in LANTERN_CASES:
        tree, view = lantern_case(paths, batch, vocab, sampled, seed + case_seed)
        uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed + case_seed + 5))
        used = dataclasses.replace(rule, neighbours=build_latent_neighbours(codebook, rule.neighbours.shape[1]))
        for view_name, target_view in (("all", view), ("inner", inner_view(view, paths))):
            verdict = verify(tree, target_view, used, uniforms)
            for b in range(batch):
                tests, last, final = lantern_posterior(
                    list(paths), tree.tokens[b].tolist(), view.probs[b].double().tolist(),
                    tree.q_full[b].double().tolist(), uniforms.accept[b].double().tolist(), nearest, k, delta,
                    sampled, zeroes,
                )  # fmt: skip
                where = f"{name} view {view_name} row {b}"
                made = torch.nonzero(~verdict.accept_prob[b].isnan()).tolist()  # (depth, slot), test order
                chances = [float(verdict.accept_prob[b, d, c]) for d, c in made]
                decided = [bool(uniforms.accept[b, d, c] < verdict.accept_prob[b, d, c]) for d, c in made]
                final_ours = verdict.final_probs[b].double()
                last_ours, theirs = int(verdict.last_node[b]), [t[2] for t in tests]
                if made != [[d, c] for d, c, *_ in tests]:
                    bad.append(f"{where}: tests {made} vs the authors' {[(d, c) for d, c, *_ in tests]}")
                elif not all(map(functools.partial(math.isclose, rel_tol=1e-5, abs_tol=1e-6), chances, theirs)):
                    bad.append(f"{where}: acceptance {chances} vs the authors' {theirs}")
                elif decided != [t[3] for t in tests] or last_ours != last:
                    bad.append(f"{where}: decisions {decided}, last node {last_ours} vs the authors' {tests}, {last}")
                elif (final_ours - torch.tensor(final).double()).abs().max() > 1e-6:
                    bad.append(f"{where}: next-token distribution {final_ours.tolist()} vs the authors' {final}")
                if view_name == "all":
                    counts["steps"] += 1
                    counts["ends in a residual"] += bool(tests) and not tests[-1][3]  # the last test rejected
                    for d, c, _, ok, pooled, plain in tests:
                        counts[("accepted" if ok else "rejected") + (" after pooling" if pooled else "")] += 1
                        counts["accepted by the pooling"] += ok and float(uniforms.accept[b, d, c]) >= plain
    return bad


@pytest.mark.parametrize("setting", list(LANTERN_SETTINGS))
@pytest.mark.parametrize(
    "mode", ["deterministic", "sampled-lumina", "sampled-llamagen"], ids=["deterministic", "lumina-p", "llamagen-q"]
)
def test_lantern_decides_as_the_lantern_authors_code_on_random_steps(setting, mode):
    """jadohu/LANTERN 3a56e45's acceptance test (`reference_lantern.evaluate_posterior`) on 224 random steps a case,
    LANTERN and LANTERN++ with the published settings: deterministic drafts (the dynamic tree's path, the same in
    every file), and sampled drafts on static trees as the Lumina-mGPT file does them (p zeroed at x's k + 1 nearest
    codes, `static_zeroes="p"`) and as the LlamaGen file does them (q zeroed there, `static_zeroes="q"`). Every
    test made, its acceptance probability, its decision, the last accepted node and the next token's distribution
    must be the authors'; the pooling must decide tests both ways and be followed by rejections (the zeroing)."""
    k, delta = LANTERN_SETTINGS[setting]
    sampled, zeroes = mode != "deterministic", "q" if mode == "sampled-llamagen" else "p"
    lam = delta if delta > 1 else None
    rule = LanternRule(
        neighbours=torch.zeros(32, k + 1, dtype=torch.long), k=k, delta=0.1 if lam else delta, lam=lam,
        static_zeroes=zeroes,
    )  # fmt: skip
    counts: collections.Counter[str] = collections.Counter()
    bad = lantern_disagreements(rule, k, delta, sampled, zeroes, 3, counts)
    assert not bad, f"{len(bad)} disagreements, the first: {bad[:3]}"
    assert counts["steps"] >= 200
    # the pooled mass turns rejections into acceptances, and rejections after pooling zero the k + 1 nearest codes
    assert min(counts["accepted by the pooling"], counts["rejected after pooling"]) >= 20, counts
    assert min(counts["ends in a residual"], counts["steps"] - counts["ends in a residual"]) >= 10, counts


@pytest.mark.parametrize(
    ("ours", "authors"),
    [
        (dict(k=10, lam=3.0, static_zeroes="q"), (10, 3.0, True, "p")),  # the LlamaGen file's zeroing, Lumina's asked
        (dict(k=10, lam=3.0, static_zeroes="p"), (10, 3.0, True, "q")),  # and the other way round
        (dict(k=10, lam=3.0, static_zeroes="p"), (10, 5.0, True, "p")),  # lambda 3 against the authors' 5
        (dict(k=5, lam=10.0), (5, 20.0, False, "p")),  # lambda 10 against 20, deterministic drafts
        (dict(k=6, delta=0.1), (6, 0.2, False, "p")),  # LANTERN's delta 0.1 against 0.2
        (dict(k=6, delta=0.1, reject_zeroes="pooled"), (6, 0.1, False, "p")),  # zeroing only the pooled codes
        (dict(k=5, lam=3.0), (10, 3.0, False, "p")),  # k 5 against 10
    ],
    ids=["zeroes-q-vs-p", "zeroes-p-vs-q", "lam-3-vs-5", "lam-10-vs-20", "delta-0.1-vs-0.2", "pooled-vs-code", "k"],
)
def test_the_lantern_comparison_fails_for_a_wrong_setting(ours, authors):
    """The comparison above can fail: a rule one setting away from the authors' (the other file's zeroing, another
    lambda, delta or k, zeroing only the pooled codes) disagrees with their code on some of the same steps."""
    k, delta, sampled, zeroes = authors
    rule = LanternRule(neighbours=torch.zeros(32, max(k, ours["k"]) + 1, dtype=torch.long), **ours)
    bad = lantern_disagreements(rule, k, delta, sampled, zeroes, 3, collections.Counter())
    assert len(bad) >= 4, bad
