"""Verification rules: the vectorised `verify` against the textbook loop, greedy mode, and hand-worked peer examples.

The exact output distributions (lossless `exact`, CASCADE's TV budget) are enumerated in
tests/test_decoder_lossless.py; here `verify` must make the same decisions as the independent
reference (`tests/reference_verify.py`) on random trees of every kind, for every rule.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from reference_verify import reference_batch

from inference.decoding.gsd_blocks import Ranking, block_slots, walk_blocks
from inference.decoding.peer_rules import (
    LANTERN_DELTA,
    LANTERN_K,
    LANTERN_PP_K,
    LANTERN_PP_LAM,
    LANTERN_PP_REPO_RUNS,
    lantern_static_zeroes,
)
from inference.decoding.rule_inputs import packed_slots
from inference.decoding.rules import (
    CascadeDevRule,
    CascadeRule,
    ExactRule,
    GSDBlocksRule,
    GSDRule,
    LanternRule,
    children_mass_above,
    needs_every_node,
)
from inference.decoding.sampling import Proposal
from inference.decoding.similarity import mass_above
from inference.decoding.speculative import build_target_view
from inference.decoding.tree import StaticTreeSpec, Tree
from inference.decoding.tree_drafting import gumbel_topk
from inference.decoding.verify import (
    TargetView,
    Uniforms,
    build_latent_neighbours,
    prepare_tree,
    slot_tables,
    verify,
)
from models.target import SamplingDefaults, TargetOutput

SMALL_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (1, 1, 0))
# six children under the root, four under each of the first three: more slots than a static preset has
WIDE_TREE = tuple((c,) for c in range(6)) + tuple((p, c) for p in range(3) for c in range(4)) + ((0, 0, 0), (0, 0, 1))


def build_case(paths, batch: int, vocab: int, sampled: bool, seed: int, dim: int = 8) -> tuple[Tree, TargetView]:
    """Random trees of one shape with target distributions and clustered features (so relaxations happen)."""
    g = torch.Generator().manual_seed(seed)
    spec = StaticTreeSpec(paths)
    n = spec.num_nodes
    parents = torch.tensor(spec.parents).expand(batch, -1)
    q_full = (torch.randn(batch, n, vocab, generator=g) * 1.5).softmax(-1)
    tokens = torch.zeros(batch, n, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for node in range(n):
        kids = [m for m in range(n) if spec.parents[m] == node]
        if not kids:
            continue
        if sampled:
            draws = gumbel_topk(Proposal(q_full[:, node]), len(kids), g)
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
        tokens, parents, torch.tensor(spec.depths).expand(batch, -1), q_full, sampled,
        spec.max_depth, spec.max_children,
    )  # fmt: skip
    return tree, TargetView(probs, logits.argmax(-1), features)


def all_rules(vocab: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    neighbours = build_latent_neighbours(torch.randn(vocab, 4, generator=g), vocab - 1)
    loose = dict(tau_pos=0.6, tau_seq=0.4)
    ids = torch.randperm(vocab, generator=g) * 2  # LM ids, half of them above the bound
    return [
        ExactRule(),
        LanternRule(neighbours=neighbours, k=4, delta=0.2),
        LanternRule(neighbours=neighbours, k=4, delta=0.2, reject_zeroes="pooled"),
        LanternRule(neighbours=neighbours, k=4, delta=0.2, static_zeroes="p"),
        LanternRule(neighbours=neighbours, k=3, lam=3.0),
        GSDBlocksRule(group=3),
        GSDBlocksRule(group=3, proposal_mass="draw"),
        GSDRule(embeddings=torch.randn(vocab, 2, generator=g), window=4, p_threshold=0.3, distance_threshold=2.0),
        GSDRule(
            embeddings=torch.randn(vocab, 2, generator=g), window=6, p_threshold=0.3, token_ids=ids, id_bound=vocab - 1
        ),
        CascadeRule(),
        CascadeRule(delta=0.5, **loose),
        CascadeRule(delta=0.3, use_convergence=False, **loose),
        CascadeRule(delta=0.3, use_interchangeability=False, **loose),
        CascadeRule(delta=0.4, conv_mode="path", **loose),
        CascadeRule(delta=0.5, conf_gate=0.8, kl_gate=4.0, **loose),
        CascadeRule(delta=0.5, pool_beyond_tree=True, **loose),
        CascadeRule(delta=0.3, conv_mode="path", pool_beyond_tree=True, **loose),
        CascadeDevRule(),
        CascadeDevRule(sim_threshold=0.1, pair_threshold=0.2, nucleus=0.95),
        CascadeDevRule(sim_threshold=0.1, pair_threshold=0.2, pairs="level"),
    ]


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_vectorised_verify_equals_the_textbook_loop(sampled):
    vocab = 10
    for seed in range(2):
        tree, view = build_case(SMALL_TREE, batch=6, vocab=vocab, sampled=sampled, seed=seed)
        max_accept = torch.tensor([3, 3, 2, 1, 0, 3])
        for rule in all_rules(vocab, seed):
            uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed))
            verdict = verify(tree, view, rule, uniforms, max_accept)
            reference = reference_batch(tree, view, rule, uniforms, max_accept)
            for b, (outcome, token) in enumerate(reference):
                assert int(verdict.last_node[b]) == outcome.last_node, (rule, b)
                assert int(verdict.num_accepted[b]) == outcome.accepted
                assert int(verdict.next_token[b]) == token
                assert float(verdict.tv_charged[b]) == pytest.approx(outcome.charged, abs=1e-5)
                assert torch.allclose(
                    verdict.final_probs[b].double(), torch.tensor(outcome.final, dtype=torch.float64), atol=1e-5
                )
                made = [(d, c, float(verdict.accept_prob[b, d, c])) for d, c in zip(*torch.where(
                    ~torch.isnan(verdict.accept_prob[b])), strict=True)]  # fmt: skip
                assert [(int(d), int(c)) for d, c, _ in made] == [(d, c) for d, c, _ in outcome.tests]
                for (_, _, got), (_, _, want) in zip(made, outcome.tests, strict=True):
                    assert got == pytest.approx(want, abs=1e-5)


def test_a_deterministic_child_holding_all_the_mass_left_is_accepted_with_probability_exactly_one():
    """Deterministic drafts are verified without a loop over the slots (`removal_slots`): where the earlier
    children are rejected and the last one holds all the target mass left, its test must be certain, as
    in the loop, which divides that mass by itself, even against the largest uniform below 1."""
    vocab, width, batch = 6, 3, 64
    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(batch, width + 1, vocab)
    probs[:, 0, :width] = (torch.randn(batch, width, generator=g) * 2).softmax(-1)  # all mass on the children
    probs[:, 1:] = 1.0 / vocab
    tokens = torch.tensor([vocab - 1, *range(width)]).expand(batch, -1)
    parents = torch.tensor([-1] + [0] * width).expand(batch, -1)
    depths = (parents >= 0).long()
    q_full = torch.zeros(batch, width + 1, vocab)
    tree = Tree(tokens, parents, depths, q_full, sampled=False, max_depth=1, max_children=width)
    below_one = 1.0 - 2.0**-24  # the largest float32 below 1, which torch.rand can draw
    uniforms = Uniforms(torch.full((batch, 1, width), below_one), torch.rand(batch, generator=g))
    for rule in (ExactRule(), CascadeRule(tau_pos=2.0, tau_seq=2.0)):  # cascade without any relaxation
        view = TargetView(probs, features=torch.randn(batch, width + 1, 4, generator=g))
        verdict = verify(tree, view, rule, uniforms)
        assert (verdict.last_node == width).all(), rule
        assert (verdict.accept_prob[:, 0, -1] == 1.0).all(), rule
        assert (verdict.accept_prob[:, 0, :-1] < 1.0).all(), rule


@dataclasses.dataclass
class SlotLoopOnly:
    """A rule seen without its closed form (`acceptance_at_once`): `slot_tables` then tests slot after slot."""

    rule: object

    def prepare(self, inputs):
        return self.rule.prepare(inputs)

    def test_slot(self, inputs, state, slot):
        return self.rule.test_slot(inputs, state, slot)


def keep_top(view: TargetView, top: int) -> None:
    """Make the view's target a top-`top` distribution (zeros elsewhere), in place."""
    kept = view.probs >= view.probs.topk(top, dim=-1).values[..., -1:]
    view.probs = (view.probs * kept) / (view.probs * kept).sum(-1, keepdim=True)


def closed_forms_match_the_slot_loop(rules: list, inputs) -> int:
    """Assert that each rule's acceptances on the tested slots, its want and the residual after all children equal
    the slot loop's (`SlotLoopOnly`); returns how many rules were compared."""
    for rule in rules:
        a0, want, residual = slot_tables(rule, inputs)
        loop_a0, loop_want, loop_residual = slot_tables(SlotLoopOnly(rule), inputs)
        tested = inputs.usable  # `verify` reads a0 and want only there
        torch.testing.assert_close(a0 * tested, loop_a0 * tested, msg=lambda m, r=rule: f"{r}: {m}")
        torch.testing.assert_close(residual, loop_residual)
        if want is not None:
            torch.testing.assert_close(want * tested, loop_want * tested)
    return len(rules)


def test_closed_forms_for_deterministic_drafts_answer_what_the_slot_loop_answers():
    """Exact, CASCADE, the CASCADE dev rule and GSD test every slot of deterministic drafts at once (their residual
    only removes x), and so does GSD-blocks (its rejection removes x's rank block: `block_slots`): each slot's
    acceptance and the residual after all children must be the loop's, on trees whose earlier rejected siblings
    change a later slot's nucleus gate, pooled mass, GSD window and rank blocks (a wide tree, many seeds; its slots
    are sparse enough that GSD measures the tested slots' windows only, `packed_slots`), and on targets with zeros
    (top-6 of 12), where drafts the target gives no mass sort among the zeros."""
    vocab, compared = 12, 0
    loose = dict(sim_threshold=0.1, pair_threshold=0.2)
    embeddings = torch.randn(vocab, 2, generator=torch.Generator().manual_seed(3))
    rules = [r for r in all_rules(vocab) if hasattr(r, "acceptance_at_once")]
    rules += [CascadeDevRule(nucleus=m, **loose) for m in (0.3, 0.5, 0.7)]
    rules += [
        GSDRule(embeddings=embeddings, window=w, p_threshold=t, distance_threshold=d)
        for w, t, d in ((6, 1.0, 100.0), (3, 0.05, 1.0), (20, 1.0, 100.0), (5, 0.1, 2.0))
    ]
    # LM ids above the bound skip the distance filter: the closed form must know which token holds each rank of the
    # window, also among p_c's zeros, where the earlier rejected siblings join p's own zeros by id
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))
    rules += [
        GSDRule(embeddings=embeddings, window=w, p_threshold=1.0, distance_threshold=0.5, token_ids=ids, id_bound=b)
        for w, b in ((8, 9), (20, 9), (14, 10))
    ]
    rules += [GSDBlocksRule(group=g) for g in (1, 2)]  # (K - 1) G < V on both trees: `block_slots` applies
    for paths, seed, top in itertools.product((SMALL_TREE, WIDE_TREE), range(6), (None, 6)):
        tree, view = build_case(paths, batch=8, vocab=vocab, sampled=False, seed=seed)
        if top is not None:  # a top-k target: mass on 6 tokens, the drafts (q's top tokens) often outside them
            keep_top(view, top)
        inputs = prepare_tree(tree, view, None)
        assert (packed_slots(inputs) is not None) == (paths is WIDE_TREE)  # GSD's windows are packed on the wide tree
        assert all(block_slots(inputs, r.group) is not None for r in rules if isinstance(r, GSDBlocksRule))
        compared += closed_forms_match_the_slot_loop(rules, inputs)
    assert compared == 2 * 6 * 2 * len(rules)


def test_gsd_blocks_on_deterministic_drafts_follow_the_slot_loop_through_the_zeros_and_the_uniform_fallback():
    """GSD-blocks' closed form (`block_slots`: one sort of p) against its slot loop (one sort per slot), where its
    two rare branches are taken: a draft that is 0 under p_c whose block holds the partial rank chunk (the last
    one with positive tokens, which shares its block with zeros: a rejection takes it), and a rejection that leaves
    no positive token, after which the next slots see the uniform fallback. Top-k targets over 40 tokens, blocks of
    2 to 7; the test counts that both branches were met."""
    vocab, partial_hits, fallbacks, compared = 40, 0, 0, 0
    for paths, seed, group, top in itertools.product((SMALL_TREE, WIDE_TREE), range(3), (2, 3, 7), (None, 6, 10)):
        tree, view = build_case(paths, batch=8, vocab=vocab, sampled=False, seed=seed)
        if top is not None:
            keep_top(view, top)
        inputs = prepare_tree(tree, view, None)
        answer = block_slots(inputs, group)
        assert answer is not None
        walk = walk_blocks(Ranking.of(inputs.probs, group), inputs.kid_tokens, inputs.usable, group)
        partial_hits += int(walk.partial_taken.sum())
        fallbacks += int((answer[2] & inputs.usable).sum())
        compared += closed_forms_match_the_slot_loop([GSDBlocksRule(group=group)], inputs)
    assert compared == 2 * 3 * 3 * 3
    assert partial_hits > 20 and fallbacks > 20, (partial_hits, fallbacks)


def test_gsd_blocks_leave_to_the_slot_loop_the_blocks_the_uniform_fallback_could_run_out_of():
    """Where (K - 1) G >= V the uniform phase itself could be emptied, which `block_slots` does not model: the rule's
    own chain declines (None) and verification tests slot after slot, with the same answers as the plain loop."""
    tree, view = build_case(SMALL_TREE, batch=8, vocab=12, sampled=False, seed=0)
    inputs = prepare_tree(tree, view, None)
    rule = GSDBlocksRule(group=12)
    assert block_slots(inputs, rule.group) is None and rule.own_chain(inputs, None, None, None) is None
    assert closed_forms_match_the_slot_loop([rule], inputs) == 1


def test_gsd_blocks_test_a_slot_reached_with_less_than_1e_30_of_the_mass_left_as_the_slot_loop_does():
    """The closed form divides a block's mass by the mass left without a floor, as the loop's renormalising does:
    after children holding all but about 1e-37 of the target are rejected, the next child's test is the loop's."""
    vocab, width, batch = 8, 3, 2
    logits = torch.full((batch, width + 1, vocab), -200.0)
    logits[..., :3] = torch.tensor([0.0, -85.0, -90.0])  # p = 1, 1.2e-37, 8e-40 (subnormal), 0 elsewhere
    tokens = torch.tensor([vocab - 1, 0, 1, 2]).expand(batch, -1)
    parents = torch.tensor([-1] + [0] * width).expand(batch, -1)
    tree = Tree(tokens, parents, (parents >= 0).long(), torch.zeros(batch, width + 1, vocab), False, 1, width)
    inputs = prepare_tree(tree, TargetView(logits.softmax(-1)), None)
    assert closed_forms_match_the_slot_loop([GSDBlocksRule(group=1)], inputs) == 1
    assert block_slots(inputs, 1) is not None


def test_closed_forms_for_sampled_drafts_answer_what_the_slot_loop_answers():
    """Exact, CASCADE, the CASCADE dev rule and GSD keep the exact residual, so on sampled drafts the chain of
    residuals is built first and every slot is tested at once (`acceptance_sampled`); LANTERN (the authors'
    LlamaGen setting) and GSD-blocks run their own unnormalised chain (`own_chain`). Each slot's acceptance, the
    budgeted rule's want and the residual after all children must be the slot loop's, on a wide tree (six children
    under the root; its slots are sparse enough that GSD and the dev rule get them packed, `packed_slots`), with
    top-6 targets whose zeros the drafts often hit, and with image-end limits that leave slots untested."""
    vocab, compared = 12, 0
    embeddings = torch.randn(vocab, 2, generator=torch.Generator().manual_seed(3))
    rules = [r for r in all_rules(vocab) if hasattr(r, "acceptance_sampled") or hasattr(r, "own_chain")]
    rules += [CascadeDevRule(nucleus=m, sim_threshold=0.1, pair_threshold=0.2) for m in (0.3, 0.7)]
    rules += [GSDRule(embeddings=embeddings, window=w, p_threshold=1.0, distance_threshold=100.0) for w in (3, 20)]
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))
    rules += [GSDRule(embeddings=embeddings, window=14, distance_threshold=0.5, token_ids=ids, id_bound=9)]
    rules += [GSDBlocksRule(group=g, proposal_mass=m) for g in (1, 5) for m in ("parent", "draw")]
    neighbours = build_latent_neighbours(torch.randn(vocab, 4, generator=torch.Generator().manual_seed(4)), vocab - 1)
    rules += [LanternRule(neighbours=neighbours, k=k, delta=d) for k, d in ((2, 0.05), (6, 0.5))]
    rules += [LanternRule(neighbours=neighbours, k=k, lam=lam) for k, lam in ((2, 1.5), (5, 4.0))]
    assert {type(r) for r in rules} == {ExactRule, CascadeRule, CascadeDevRule, GSDRule, GSDBlocksRule, LanternRule}
    for paths, seed, top in itertools.product((SMALL_TREE, WIDE_TREE), range(4), (None, 6)):
        tree, view = build_case(paths, batch=8, vocab=vocab, sampled=True, seed=seed)
        if top is not None:
            keep_top(view, top)
        inputs = prepare_tree(tree, view, torch.tensor([3, 2, 1, 0, 3, 2, 1, 3]))
        assert (inputs.tables.has_child & ~inputs.usable).any()  # some drafted slots are past the limit
        assert (packed_slots(inputs) is not None) == (
            paths is WIDE_TREE
        )  # the packed path is compared on the wide tree
        compared += closed_forms_match_the_slot_loop(rules, inputs)
    assert compared == 2 * 4 * 2 * len(rules)


def inner_view(view: TargetView, paths=SMALL_TREE) -> TargetView:
    """The view restricted to the tree's nodes with children, with the full view's leaves as `at_leaf`."""
    structure = StaticTreeSpec(paths).structure(torch.device("cpu"))
    nodes, rows = structure.inner_nodes, torch.arange(view.probs.shape[0])

    def at_leaf(node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return view.probs[rows, node], view.probs[rows, node].argmax(-1)

    greedy_at = None if view.greedy_tokens is None else view.greedy_tokens[:, nodes]
    return TargetView(view.probs[:, nodes], greedy_at, view.features, nodes, structure.inner_row, at_leaf)


@pytest.mark.parametrize("mode", ["deterministic", "sampled", "greedy"])
def test_a_view_of_the_inner_nodes_decides_as_the_view_of_every_node(mode):
    """The decoder's target view covers only a static tree's nodes with children (the head and the logits chain
    run on 11 of the default tree's 26 nodes); verification must decide exactly as with every node's target."""
    vocab, ends_at_leaf = 10, 0
    spec = StaticTreeSpec(SMALL_TREE)
    leaves = [n for n in range(spec.num_nodes) if n not in spec.parents]
    for seed in range(3):
        tree, view = build_case(SMALL_TREE, batch=8, vocab=vocab, sampled=mode == "sampled", seed=seed)
        view.greedy_tokens = view.probs.argmax(-1)
        if mode == "greedy":  # rows 0-3 draft the target's argmax as every first child: their walks reach leaves
            for node in range(1, spec.num_nodes):
                if spec.ranks[node] == 0:
                    tree.tokens[:4, node] = view.greedy_tokens[:4, spec.parents[node]]
        partial = inner_view(view)
        max_accept = torch.tensor([3, 3, 2, 1, 0, 3, 3, 3])
        for rule in all_rules(vocab, seed):
            uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(seed))
            if needs_every_node(rule):
                with pytest.raises(ValueError, match="every node"):
                    verify(tree, partial, rule, uniforms, max_accept, greedy=mode == "greedy")
                continue
            full = verify(tree, view, rule, uniforms, max_accept, greedy=mode == "greedy")
            part = verify(tree, partial, rule, uniforms, max_accept, greedy=mode == "greedy")
            assert torch.equal(part.last_node, full.last_node), rule
            assert torch.equal(part.num_accepted, full.num_accepted)
            assert torch.equal(part.next_token, full.next_token)
            torch.testing.assert_close(part.tv_charged, full.tv_charged)
            torch.testing.assert_close(part.accept_prob, full.accept_prob, equal_nan=True)
            torch.testing.assert_close(part.final_probs, full.final_probs)
            ends_at_leaf += sum(int(n) in leaves for n in full.last_node)
    assert ends_at_leaf > 0  # walks that end at a leaf, where only at_leaf knows the target
    with pytest.raises(ValueError, match="node_row"):
        verify(tree, dataclasses.replace(partial, node_row=None), ExactRule(), uniforms)


def test_the_nucleus_gate_reads_the_same_per_node_as_per_slot():
    """CASCADE's confidence gate tests a tree with many empty slots once per node (`children_mass_above`);
    it must answer what the per-slot test answers on every usable slot, over every node or the inner ones."""
    checked = {"per node": 0, "per slot": 0}
    uneven = ((0,), (1,), (2,), (3,), (3, 0), (3, 1), (2, 0), (3, 0, 0))  # inner nodes 0, 3, 4, 5: rows 0-3
    for paths, seed, width in itertools.product((SMALL_TREE, uneven), range(3), (0, 12)):  # 12: mostly empty
        tree, view = build_case(paths, batch=5, vocab=10, sampled=seed == 1, seed=seed)
        tree.max_children = max(width, tree.max_children)
        for target_view in (view, inner_view(view, paths)):
            inputs = prepare_tree(tree, target_view, None)
            form = "per node" if inputs.children.numel() > 4 * tree.tokens.numel() else "per slot"
            for mass in (0.3, 0.8):
                got = children_mass_above(inputs) < mass
                want = mass_above(inputs.probs, inputs.kid_tokens) < mass  # once per slot
                assert torch.equal(got & inputs.usable, want & inputs.usable), (paths, seed, width, form, mass)
                assert 0 < int((want & inputs.usable).sum()) < int(inputs.usable.sum())  # the gate decides
                checked[form] += 1
    assert min(checked.values()) > 0, checked


def test_cascade_charges_stay_within_delta_and_zero_budget_is_exact():
    tree, view = build_case(SMALL_TREE, batch=32, vocab=10, sampled=True, seed=7)
    uniforms = Uniforms.draw(tree, torch.Generator().manual_seed(1))
    exact = verify(tree, view, ExactRule(), uniforms)
    for delta in (0.0, 0.1, 0.5):
        relaxed = verify(tree, view, CascadeRule(delta=delta, tau_pos=-1.0, tau_seq=-1.0), uniforms)
        assert (relaxed.tv_charged <= delta + 1e-6).all()
        assert (relaxed.num_accepted >= 0).all()
        if delta == 0.0:
            assert relaxed.last_node.tolist() == exact.last_node.tolist()
            assert relaxed.next_token.tolist() == exact.next_token.tolist()
    relaxed = verify(tree, view, CascadeRule(delta=0.5, tau_pos=-1.0, tau_seq=-1.0), uniforms)
    assert relaxed.num_accepted.float().mean() > exact.num_accepted.float().mean()


def test_greedy_verify_takes_the_longest_path_of_target_argmaxes():
    tree, view = build_case(SMALL_TREE, batch=6, vocab=10, sampled=False, seed=5)
    argmax = view.probs.argmax(-1)
    view.greedy_tokens = argmax
    tree.tokens[:, 2] = argmax[:, 0]  # the root's second child is the target's choice
    tree.tokens[:, 7] = argmax[:, 2]  # and so is its first child (node 7 = path (1, 0))
    tree.tokens[:, 1] = torch.where(argmax[:, 0] == 0, 1, 0)  # the first child is not
    for rule in all_rules(10):
        verdict = verify(tree, view, rule, Uniforms.draw(tree, None), greedy=True)
        assert (verdict.next_token == argmax.gather(1, verdict.last_node[:, None])[:, 0]).all()
        if isinstance(rule, ExactRule):
            assert (verdict.num_accepted >= 2).all()


# ---- Hand-worked examples of the peer rules: one root, one drafted child x, a rejection forced (u = 1). ----

P_ROOT = [0.4, 0.1, 0.2, 0.25, 0.05]


def one_child(x: int, q: list[float] | None = None) -> tuple[Tree, TargetView]:
    sampled = q is not None
    q_full = torch.tensor([q or [0.2] * 5, [0.2] * 5])
    probs = torch.tensor([P_ROOT, [0.2] * 5])
    tree = Tree(torch.tensor([[0, x]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), q_full[None], sampled, 1, 1)
    return tree, TargetView(probs[None], probs.argmax(-1)[None], torch.randn(1, 2, 4))


def reject(tree: Tree, view: TargetView, rule) -> tuple[float, list[float]]:
    verdict = verify(tree, view, rule, Uniforms(torch.ones(1, 1, 1), torch.zeros(1)))
    return float(verdict.accept_prob[0, 0, 0]), verdict.final_probs[0].tolist()


def test_lantern_follows_evaluate_posterior_by_hand():
    # jadohu/LANTERN models/ea_model_llamagen.py::evaluate_posterior, dynamic tree (q = 1), x = 1.
    # Neighbours of 1, nearest first: 2, 4, 3, 0. k = 2: cumsum p[[2, 4]] = [0.2, 0.25].
    # LANTERN delta 0.25: both prefix sums <= 0.25, p~(1) = 0.1 + 0.25 = 0.35 = the acceptance probability.
    # Rejection ("code"): p[1] = 0 and, since something was pooled, p = 0 at the k + 1 = 3 nearest [2, 4, 3]:
    # only token 0 keeps mass, residual [1, 0, 0, 0, 0].
    neighbours = torch.tensor([[1, 2, 3, 4], [2, 4, 3, 0], [1, 0, 3, 4], [2, 1, 0, 4], [1, 2, 3, 0]])
    chance, final = reject(*one_child(1), LanternRule(neighbours=neighbours, k=2, delta=0.25))
    assert chance == pytest.approx(0.35) and final == pytest.approx([1, 0, 0, 0, 0])
    # LANTERN++ lam 3: bound (3 - 1) * p(1) = 0.2 keeps the prefix [0.2] only: p~(1) = 0.3.
    chance, _ = reject(*one_child(1), LanternRule(neighbours=neighbours, k=2, lam=3.0))
    assert chance == pytest.approx(0.3)
    # Sampled tree, LlamaGen file: q = [0.1, 0.5, 0.1, 0.2, 0.1], x = 1 drawn first: accept min(1, 0.35 / 0.5) = 0.7;
    # on rejection q is zeroed at x's neighbours [2, 4, 3] (not renormalised), then relu(p - q):
    # relu([0.4 - 0.1, 0.1 - 0.5, 0.2, 0.25, 0.05]) = [0.3, 0, 0.2, 0.25, 0.05] / 0.8.
    q = [0.1, 0.5, 0.1, 0.2, 0.1]
    chance, final = reject(*one_child(1, q), LanternRule(neighbours=neighbours, k=2, delta=0.25))
    assert chance == pytest.approx(0.7) and final == pytest.approx([0.375, 0, 0.25, 0.3125, 0.0625])
    # The Lumina file zeroes p there instead: relu([0.4, 0.1, 0, 0, 0] - q) = [0.3, 0, 0, 0, 0] -> [1, 0, 0, 0, 0].
    rule = LanternRule(neighbours=neighbours, k=2, delta=0.25, static_zeroes="p")
    assert reject(*one_child(1, q), rule)[1] == pytest.approx([1, 0, 0, 0, 0])


def test_lantern_defaults_are_the_published_settings():
    # LANTERN: jadohu/LANTERN `evaluate_posterior(..., lantern_k=1000, lantern_delta=0.1)` (docs/method.md, section "The
    # baselines, as their authors' code runs them").
    lantern = LanternRule(neighbours=torch.zeros(3, LANTERN_K + 1, dtype=torch.long))
    assert (lantern.k, lantern.delta, lantern.lam, LANTERN_K, LANTERN_DELTA) == (1000, 0.1, None, 1000, 0.1)
    # LANTERN++: the CASCADE authors' baseline `--lantern_k 10 --lantern_delta 3.0` (docs/method.md, section "The
    # baselines, as their authors' code runs them"): with lam set, k falls back to 10, not to LANTERN's 1000.
    plus = LanternRule(neighbours=torch.zeros(3, 11, dtype=torch.long), lam=LANTERN_PP_LAM)
    assert (plus.k, plus.lam, plus.name, LANTERN_PP_K, LANTERN_PP_LAM) == (10, 3.0, "lantern++", 10, 3.0)
    # jadohu/LANTERN run.sh: --lantern_k 10 --lantern_delta 5, --lantern_k 5 --lantern_delta 10 and 20.
    assert LANTERN_PP_REPO_RUNS == ((10, 5.0), (5, 10.0), (5, 20.0))
    # the Lumina-mGPT file zeroes p at the latents on static trees, the LlamaGen file q (Janus: no file, q)
    assert [lantern_static_zeroes(f) for f in ("lumina", "llamagen", "janus")] == ["p", "q", "q"]
    with pytest.raises(ValueError, match="k=10 needs more"):  # the default k still needs its table
        LanternRule(neighbours=torch.zeros(3, 10, dtype=torch.long), lam=3.0)


def test_greedy_lantern_reads_the_unfiltered_softmax_as_its_authors_code_does():
    """jadohu/LANTERN's greedy path (`evaluate_posterior_v1`, no logits processor) pools neighbours' mass from
    softmax(logits); a top-k-filtered p would hide x's neighbours. p = [0.4, 0.3, 0.2, 0.05, 0.05], top-k 2, x = 1
    with nearest latents 2, 4: unfiltered, p~(1) = 0.3 + 0.25 = 0.55 > p(0) = 0.4 passes; filtered to {0, 1},
    nothing can be pooled and 0.43 < 0.57 fails. `exact` keeps the filtered view (only the argmax matters)."""
    neighbours = torch.tensor([[1, 2, 3, 4], [2, 4, 3, 0], [1, 0, 3, 4], [2, 1, 0, 4], [1, 2, 3, 0]])
    rule = LanternRule(neighbours=neighbours, k=2, delta=0.25)
    p = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    out = TargetOutput(logits=p.log().expand(1, 2, -1), hidden=torch.zeros(1, 2, 4))
    greedy = SamplingDefaults(cfg_scale=1.0, temperature=0.0, top_k=2)
    tree = Tree(
        torch.tensor([[0, 1]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), torch.zeros(1, 2, 5), False, 1, 1
    )
    view = build_target_view(out, rule, greedy, cfg=False, greedy=True)
    assert view.probs[0, 0].tolist() == pytest.approx(p.tolist())
    assert int(verify(tree, view, rule, Uniforms.draw(tree, None), greedy=True).num_accepted[0]) == 1
    filtered = build_target_view(out, ExactRule(), greedy, cfg=False, greedy=True)
    assert filtered.probs[0, 0].tolist() == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0])
    assert int(verify(tree, filtered, rule, Uniforms.draw(tree, None), greedy=True).num_accepted[0]) == 0
    sampled = build_target_view(out, rule, dataclasses.replace(greedy, temperature=1.0), cfg=False, greedy=False)
    assert sampled.probs[0, 0].tolist() == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0])  # sampling filters


def test_gsd_blocks_follow_the_cascade_authors_port_by_hand():
    # Dev commit 8dc3300, ea2_model_llamagen.py: ranks of P_ROOT, most likely first: 0 (0.4), 3 (0.25), 2 (0.2),
    # 1 (0.1), 4 (0.05); blocks of G = 2: {0, 3}, {2, 1}, {4}. x = 1 -> C = {2, 1}, p(C) = 0.3.
    # Deterministic draft: q(C) = 1, accept 0.3; rejection zeroes C: [0.4, 0, 0, 0.25, 0.05] / 0.7.
    chance, final = reject(*one_child(1), GSDBlocksRule(group=2))
    assert chance == pytest.approx(0.3) and final == pytest.approx([0.4 / 0.7, 0, 0, 0.25 / 0.7, 0.05 / 0.7])
    # Sampled, q = [0.1, 0.5, 0.1, 0.2, 0.1]: q(C) = 0.5 + 0.1 = 0.6, accept min(1, 0.3 / 0.6) = 0.5.
    assert reject(*one_child(1, [0.1, 0.5, 0.1, 0.2, 0.1]), GSDBlocksRule(group=2))[0] == pytest.approx(0.5)


def two_sampled_children(probs: list[float], q: list[float], tokens: tuple[int, int]) -> tuple[Tree, TargetView]:
    """A root with two children drawn from q without replacement, in this order."""
    vocab = len(probs)
    q_full = torch.tensor([q, [1.0 / vocab] * vocab, [1.0 / vocab] * vocab])[None]
    view_probs = torch.tensor([probs, [1.0 / vocab] * vocab, [1.0 / vocab] * vocab])[None]
    tree = Tree(torch.tensor([[0, *tokens]]), torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 1]]), q_full, True, 1, 2)
    return tree, TargetView(view_probs, view_probs.argmax(-1), None)


def test_gsd_blocks_measure_a_later_siblings_block_under_the_parents_unmodified_q_as_the_port_does():
    # Dev commit 8dc3300: G = 2, p = [.05, .05, .35, .35, .1, .1], q = [.3, .1, .25, .25, .05, .05], x1 = 0 then
    # x2 = 2. Blocks of p: {2, 3}, {4, 5}, {0, 1}. x1: p(C) = 0.1, q(C) = 0.4, accept 0.25. Its rejection zeroes
    # {0, 1} and takes relu(p - q): [0, 0, .1, .1, .05, .05] / 0.3. x2's block {2, 3} holds 2/3 of that. The port
    # divides by the block's mass under q as drafted, 0.5: accept min(1, 4/3) = 1. Under q_c (x1's token removed,
    # [0, .1, .25, .25, .05, .05] / 0.7) the block holds 0.5 / 0.7: accept (2/3) / (5/7) = 0.9333.
    p, q = [0.05, 0.05, 0.35, 0.35, 0.1, 0.1], [0.3, 0.1, 0.25, 0.25, 0.05, 0.05]
    tree, view = two_sampled_children(p, q, (0, 2))
    uniforms = Uniforms(torch.ones(1, 1, 2), torch.zeros(1))  # both tests rejected: every chance is recorded
    port = verify(tree, view, GSDBlocksRule(group=2), uniforms).accept_prob[0, 0].tolist()
    draw = verify(tree, view, GSDBlocksRule(group=2, proposal_mass="draw"), uniforms).accept_prob[0, 0].tolist()
    assert port == pytest.approx([0.25, 1.0]) and draw == pytest.approx([0.25, 14 / 15])


def test_gsd_window_follows_the_gsd_authors_code_by_hand():
    # junhyukso/GSD jacobi_iteration_lumina_mgpt.py sorts ascending and slices [r - W/2, r + W/2); with window 2
    # that is the places r - 1 and r, in descending ranks x's own and the next less likely one. x = 2 has rank 2
    # (0 0.4, 3 0.25, 2 0.2, 1 0.1, 4 0.05): the window holds tokens 2 (0.2) and 1 (0.1); |0.1 - 0.2| < 0.15 and
    # equal embeddings (distance 0 < 0.5) keep token 1: p(C) = 0.3, q(C) = 1 (deterministic) -> accept 0.3. The
    # residual removes only x: [0.4, 0.1, 0, 0.25, 0.05] / 0.8.
    rule = GSDRule(embeddings=torch.zeros(5, 3), window=2)
    chance, final = reject(*one_child(2), rule)
    assert chance == pytest.approx(0.3) and final == pytest.approx([0.5, 0.125, 0, 0.3125, 0.0625])
    # Embeddings far apart (squared distance 1 >= 0.5): the cluster is x alone, accept p(2) = 0.2.
    far = GSDRule(embeddings=torch.eye(5), window=2)
    assert reject(*one_child(2), far)[0] == pytest.approx(0.2)
    # x = 4, the least likely token: the authors' slice would start at place -1 and is empty, a plain test p(4)
    assert reject(*one_child(4), rule)[0] == pytest.approx(0.05)
    # LM ids above the bound skip the distance filter: token 1 (id 7 > 5) joins x = 2 despite the distance
    ids = torch.tensor([0, 7, 2, 3, 4])
    assert reject(*one_child(2), GSDRule(embeddings=torch.eye(5), window=2, token_ids=ids, id_bound=5))[0] == (
        pytest.approx(0.3)
    )


def test_gsd_window_takes_six_more_and_seven_less_likely_tokens_as_the_authors_code_does():
    # V = 30, p(i) proportional to 1 / (i + 10) (token i at rank i), deterministic x = 7, equal embeddings, every
    # |p(y) - p(x)| < 0.15: the authors' window is ranks 1 .. 14, p(C) = (H(24) - H(10)) / (H(39) - H(9)) = 0.5946
    # (the earlier mirrored window, ranks 0 .. 13, gave 0.6355).
    vocab = 30
    weights = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 10)
    probs = (weights / weights.sum()).float()
    tree = Tree(torch.tensor([[0, 7]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), torch.zeros(1, 2, vocab),
                False, 1, 1)  # fmt: skip
    view = TargetView(torch.stack([probs, probs])[None], torch.zeros(1, 2, dtype=torch.long), None)
    rule, uniforms = GSDRule(embeddings=torch.zeros(vocab, 2)), Uniforms(torch.ones(1, 1, 1), torch.zeros(1))
    verdict = verify(tree, view, rule, uniforms)
    assert float(verdict.accept_prob[0, 0, 0]) == pytest.approx(float(weights[1:15].sum() / weights.sum()), abs=1e-6)
    assert float(verdict.accept_prob[0, 0, 0]) == pytest.approx(0.5946, abs=5e-5)


def test_rules_reject_bad_settings():
    with pytest.raises(ValueError, match="group"):
        GSDBlocksRule(group=0)
    with pytest.raises(ValueError, match="proposal_mass"):
        GSDBlocksRule(proposal_mass="q")
    with pytest.raises(ValueError, match="token_ids"):
        GSDRule(embeddings=torch.zeros(5, 2), token_ids=torch.arange(4))
    with pytest.raises(ValueError, match="delta"):
        CascadeRule(delta=1.5)
    with pytest.raises(ValueError, match="static_zeroes"):
        LanternRule(neighbours=torch.zeros(3, 3, dtype=torch.long), k=1, static_zeroes="x")
    with pytest.raises(ValueError, match="pairs"):
        CascadeDevRule(pairs="siblings")


def test_cascade_dev_follows_the_development_code_by_hand():
    """Dev commit 8c40c9c (ea_model_lumina_mgpt.py with topK_generate's pairs), deterministic drafts (q(x) = 1) on
    the tree (0,) (1,) (0, 0) (1, 0) (0, 0, 0) (1, 0, 0): nodes 1 and 2 at depth 1 (tokens 2 and 3), 3 and 4 at
    depth 2 (tokens 1 and 4), leaves 5 and 6.

    Pairs, off by one level: testing depth 1, the code reads the drafter rows of depth 2 (the nodes with children
    there: 3 and 4, rows 0 and 1), shifted onto depth 1's first node: rows 0 and 1 land on nodes 1 and 2. q at 3
    and 4 is the same (cosine 1 > 0.5), q at 1 and 2 orthogonal: node 1 pairs with node 2 by its children's q,
    not its own. x = 2 (p 0.2) is in the 0.8 nucleus of P_ROOT (mass above it 0.65), so S = p(3) = 0.25 and x is
    accepted w.p. 0.2 / (1 - 0.25) = 0.2667. Node 2 is tested next on p without token 2: p(3) = 0.25 / 0.8, and its
    partner's token 2 is gone: plain 0.3125.

    Convergence of the parent and the grandparent: testing node 3 (token 1, p 0.07 at node 1, in the nucleus:
    mass above 0.75), S = s, the cosine of the softmaxed states at node 1 and the root (0.926 > 0.9), though node
    3's own state is far from node 1's: accepted w.p. 0.07 / (1 - s) = 0.952. Depth 2 has no pairs (no node at
    depth 3 has children)."""
    probs = torch.tensor([P_ROOT, [0.75, 0.07, 0.06, 0.06, 0.06]] + [[0.2] * 5] * 5)
    q_full = torch.zeros(7, 5)
    q_full[0] = 0.2
    q_full[1, 0], q_full[2, 1] = 1.0, 1.0  # orthogonal: the paraphrase's sibling pair would not form
    q_full[3] = q_full[4] = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    features = torch.zeros(7, 4)
    features[1, 0] = 0.8  # the root's state is 0: softmax uniform
    features[3] = torch.tensor([-3.0, 3.0, 0.0, 0.0])

    def softmax_cosine(a: int, b: int) -> float:
        return float(torch.cosine_similarity(features[a].softmax(-1), features[b].softmax(-1), dim=0))

    s = softmax_cosine(1, 0)
    assert s == pytest.approx(0.92647, abs=1e-5) and softmax_cosine(3, 1) < 0.9
    tree = Tree(torch.tensor([[0, 2, 3, 1, 4, 0, 0]]), torch.tensor([[-1, 0, 0, 1, 2, 3, 4]]),
                torch.tensor([[0, 1, 1, 2, 2, 3, 3]]), q_full[None], False, 3, 2)  # fmt: skip
    view = TargetView(probs[None], probs.argmax(-1)[None], features[None])
    rejected = verify(tree, view, CascadeDevRule(), Uniforms(torch.ones(1, 3, 2), torch.zeros(1)))
    assert rejected.accept_prob[0, 0].tolist() == pytest.approx([0.2 / 0.75, 0.25 / 0.8])
    first_accepted = torch.ones(1, 3, 2)
    first_accepted[0, 0, 0] = 0.0
    verdict = verify(tree, view, CascadeDevRule(), Uniforms(first_accepted, torch.zeros(1)))
    assert float(verdict.accept_prob[0, 1, 0]) == pytest.approx(0.07 / (1 - s), rel=1e-5)
    # the reading we take the code to intend (pairs="level"): depth-1 nodes paired by their own q, orthogonal here
    level = verify(tree, view, CascadeDevRule(pairs="level"), Uniforms(torch.ones(1, 3, 2), torch.zeros(1)))
    assert float(level.accept_prob[0, 0, 0]) == pytest.approx(0.2)
