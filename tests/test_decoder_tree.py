"""Draft-tree structure: static lists, masks, children, paths, dynamic selection, sampling without replacement."""

from __future__ import annotations

import json
import re

import pytest
import torch

from inference.decoding.sampling import Proposal
from inference.decoding.speculative import DecoderConfig
from inference.decoding.tree import (
    MC_SIM_7B_63,
    NAIVE_EXTEND_57,
    STATIC_TREES,
    StaticTreeSpec,
    Tree,
    ancestor_mask,
    ancestor_paths,
    children_table,
    leaf_paths,
    load_static_tree,
    node_paths,
    select,
    selection,
)
from inference.decoding.tree_drafting import exponential_race, gumbel_topk, gumbel_topk_with_q, select_dynamic_tree
from inference.decoding.verify import draw_probabilities


def random_parents(batch: int, num_nodes: int, seed: int) -> torch.Tensor:
    """Random trees stored parents-first: parent[n] < n (not depth-sorted, which the helpers must not need)."""
    g = torch.Generator().manual_seed(seed)
    parents = [
        torch.tensor([-1] + [int(torch.randint(0, n, (1,), generator=g)) for n in range(1, num_nodes)])
        for _ in range(batch)
    ]
    return torch.stack(parents)


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    depths = torch.zeros_like(parents)
    for b in range(parents.shape[0]):
        for n in range(1, parents.shape[1]):
            depths[b, n] = depths[b, parents[b, n]] + 1
    return depths


def test_naive_extend_57_has_lanterns_level_sizes():
    spec = StaticTreeSpec(NAIVE_EXTEND_57)
    assert spec.num_nodes == 58 and spec.max_depth == 5 and spec.max_children == 5
    assert [len(spec.level(d)) for d in range(6)] == [1, 5, 13, 16, 14, 9]
    assert StaticTreeSpec(MC_SIM_7B_63).num_nodes == 26
    assert all(spec.parents[n] < n for n in range(1, spec.num_nodes))


def test_static_spec_rejects_paths_without_parents():
    with pytest.raises(ValueError, match=r"static tree: tree path \(1, 0\) lacks its parent path \(1,\): add \(1,\)"):
        StaticTreeSpec(((0,), (1, 0)))
    with pytest.raises(ValueError, match=r"tree path \(0, 0\) lacks its parent path \(0,\)"):  # (0, 1) too
        StaticTreeSpec(((0, 0), (0, 1)))


@pytest.mark.parametrize(
    ("paths", "missing", "parent"),
    [
        (((0,), (2,)), "(1,)", "the root"),  # the instance: (2,) takes the root's third draw
        (((1,),), "(0,)", "the root"),
        (((0,), (1,), (0, 1)), "(0, 0)", "(0,)"),
        (((0,), (1,), (2,), (0, 0), (0, 1), (0, 3)), "(0, 2)", "(0,)"),
    ],
)
def test_static_spec_rejects_a_child_without_its_earlier_sibling(paths, missing, parent):
    hole = re.escape(f"its earlier sibling {missing} is missing")
    fix = re.escape(f"Add {missing}, or renumber the children of {parent} 0, 1, 2")
    with pytest.raises(ValueError, match=f"{hole}.*{fix}"):
        StaticTreeSpec(paths)
    with pytest.raises(ValueError, match=f"DecoderConfig.static_tree: .*{hole}"):
        DecoderConfig(static_tree=paths)


def test_a_tree_file_with_a_hole_is_refused_naming_the_file_and_the_path(tmp_path):
    holed = tmp_path / "holed.json"
    holed.write_text(json.dumps({"paths": [[0], [1], [0, 0], [0, 2]]}))
    message = re.escape(f"static tree file {holed}, field 'paths': tree path (0, 2) has a hole") + ".*Add \\(0, 1\\)"
    with pytest.raises(ValueError, match=message):
        load_static_tree(str(holed))
    with pytest.raises(ValueError, match=message):  # at construction, not mid-decode
        DecoderConfig(static_tree=str(holed))


def test_every_shipped_static_tree_builds():
    """The named lists (and so the targets' defaults) have no holes and no orphans."""
    for name, paths in STATIC_TREES.items():
        spec = DecoderConfig(static_tree=name).spec
        assert spec.paths == paths and spec.num_nodes == len(paths) + 1, name
        for path in paths:  # closed under parents and earlier siblings, the property check_static_paths enforces
            assert path[:-1] in set(paths) | {()} and (path[-1] == 0 or path[:-1] + (path[-1] - 1,) in paths), name


def test_ancestor_mask_children_and_paths_match_a_per_node_walk():
    parents = random_parents(3, 12, seed=0)
    depths = depths_of(parents)
    max_depth = int(depths.max())
    mask = ancestor_mask(parents, max_depth)
    children = children_table(parents, max_children=12)
    paths = node_paths(parents, depths, max_depth)
    assert torch.equal(ancestor_paths(mask, depths, max_depth), paths)  # what `Tree.paths` reads, loop-free
    # a Tree whose max_depth is above every row's depth pads the paths with -1 alike
    assert torch.equal(ancestor_paths(mask, depths, max_depth + 2), node_paths(parents, depths, max_depth + 2))
    for b in range(3):
        for n in range(12):
            chain, m = [], n
            while m >= 0:
                chain.append(m)
                m = int(parents[b, m])
            assert set(torch.nonzero(mask[b, n]).flatten().tolist()) == set(chain)
            assert paths[b, n, : len(chain)].tolist() == chain[::-1]
            assert (paths[b, n, len(chain) :] == -1).all()
            kids = [m for m in range(12) if parents[b, m] == n]
            assert children[b, n, : len(kids)].tolist() == kids and (children[b, n, len(kids) :] == -1).all()


def test_leaf_paths_are_eagles_retrieve_indices():
    spec = StaticTreeSpec(NAIVE_EXTEND_57)
    parents = torch.tensor(spec.parents)[None]
    depths = torch.tensor(spec.depths)[None]
    tree = Tree(parents.clamp_min(0), parents, depths, torch.zeros(1, 58, 2), False, 5, 5)
    paths, is_leaf = leaf_paths(tree)
    assert int(is_leaf.sum()) == 58 - len(set(spec.parents[1:]))
    assert (paths[is_leaf][:, 0] == 0).all()  # every root-to-leaf path starts at the root


def test_dynamic_selection_keeps_ancestors_and_orders_parents_first():
    g = torch.Generator().manual_seed(1)
    batch, k = 4, 3
    # Candidates of a 3-level expansion: level 1 (k), level 2 (k*k children of level 1), level 3 (k*k of 3 level-2).
    level1 = torch.rand(batch, k, generator=g).log()
    level2 = level1.repeat_interleave(k, 1) + torch.rand(batch, k * k, generator=g).log()
    frontier = level2.topk(k, dim=1).indices  # ids within level 2
    level3 = level2.gather(1, frontier).repeat_interleave(k, 1) + torch.rand(batch, k * k, generator=g).log()
    scores = torch.cat([level1, level2, level3], 1)
    parents = torch.cat(
        [
            torch.full((batch, k), -1),
            torch.arange(k).repeat_interleave(k).expand(batch, -1),
            (k + frontier).repeat_interleave(k, 1),
        ],
        1,
    )
    depths = torch.cat([torch.ones(batch, k), 2 * torch.ones(batch, k * k), 3 * torch.ones(batch, k * k)], 1).long()
    tokens = torch.randint(0, 50, scores.shape, generator=g)
    tok, par, dep, node_of = select_dynamic_tree(
        torch.zeros(batch, dtype=torch.long), tokens, scores, parents, depths, num_nodes=9
    )
    assert tok.shape == (batch, 9) and (par[:, 0] == -1).all()
    assert (par[:, 1:] < torch.arange(1, 9)).all() and (par[:, 1:] >= 0).all()  # parents first, none lost
    assert (dep[:, 1:] == dep.gather(1, par[:, 1:]) + 1).all()
    best = scores.topk(8, dim=1).values.min(1).values  # the kept candidates are the 8 best
    kept_scores = torch.where(node_of >= 0, scores, float("inf")).min(1).values
    assert torch.allclose(kept_scores, best)


def test_gumbel_topk_draws_distinct_tokens_whose_draw_probabilities_verification_derives():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0]).expand(4000, -1)
    tokens = gumbel_topk(Proposal(q), 3, torch.Generator().manual_seed(0))  # 4000 independent draws of 3
    assert (tokens[:, 0] != tokens[:, 1]).all() and (tokens[:, 1] != tokens[:, 2]).all()
    assert (tokens[:, 0] != tokens[:, 2]).all()
    assert torch.allclose(torch.bincount(tokens[:, 0], minlength=4) / 4000, q[0], atol=0.03)  # first draw ~ q
    # verification reads each draw's probability off q and the earlier draws: q(x_c) / (1 - sum of the earlier q)
    drawn = torch.ones(tokens.shape, dtype=torch.bool)
    probs, mass_left = draw_probabilities(q[:, None], tokens[:, None], drawn[:, None])  # (4000, 1, 3) each
    first, second = q.gather(1, tokens[:, :1])[:, 0], q.gather(1, tokens[:, 1:2])[:, 0]
    assert torch.allclose(probs[:, 0, 0], first) and torch.allclose(probs[:, 0, 1], second / (1 - first))
    assert torch.allclose(mass_left[:, 0, 1], 1 - first) and torch.allclose(mass_left[:, 0, 0], torch.ones(4000))
    # only the slots that hold a child count as drawn; the mass of an empty slot's token stays left
    probs, mass_left = draw_probabilities(q[:1, None], tokens[:1, None], torch.tensor([[[True, True, False]]]))
    assert torch.allclose(mass_left[0, 0, 2], 1 - first[0] - q[0, tokens[0, 1]]) and probs[0, 0, 2] == 0
    tokens = gumbel_topk(Proposal(q[:1]), 4, None)
    probs, _ = draw_probabilities(q[:1, None], tokens[:, None], torch.ones(1, 1, 4, dtype=torch.bool))
    assert tokens[0, 3] == 3 and probs[0, 0, 3] == 0  # zero-probability tokens come last, never accepted
    tokens, q_drawn = gumbel_topk_with_q(Proposal(q), 1, torch.Generator().manual_seed(1))  # one draw: its q
    assert torch.equal(q_drawn, q.gather(1, tokens)) and torch.allclose(
        torch.bincount(tokens[:, 0], minlength=4) / 4000, q[0], atol=0.03
    )


def test_draw_probabilities_keep_a_small_remainder_exact():
    """The mass left is summed from what no child took and the later children, never as 1 minus the earlier:
    after a draw that took 1 - 1e-6 of q, the next one's probability is q(x) / 1e-6, not noise over 1e-7."""
    q = torch.tensor([1 - 1e-6, 6e-7, 4e-7] + [0.0] * 5)[None, None]  # (1, 1, 8)
    probs, mass_left = draw_probabilities(q, torch.tensor([[[0, 1]]]), torch.ones(1, 1, 2, dtype=torch.bool))
    torch.testing.assert_close(mass_left[0, 0], torch.tensor([1.0, 1e-6]), rtol=1e-6, atol=0)
    torch.testing.assert_close(probs[0, 0, 1], torch.tensor(0.6), rtol=1e-5, atol=0)


def test_gumbel_topk_over_a_support_draws_ordered_pairs_with_the_full_races_distribution():
    # q lives on 4 of 8 tokens; the support lists them (and one zero-mass token) in a shuffled order
    q = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.2, 0.0, 0.1, 0.0])
    support = torch.tensor([6, 0, 3, 1, 4])
    draws = 40000
    on_support = Proposal(q[support].expand(draws, -1), support.expand(draws, -1), vocab_size=8)  # q on 5 tokens
    tokens, q_drawn = gumbel_topk_with_q(on_support, 2, torch.Generator().manual_seed(1))
    assert set(tokens.flatten().tolist()) <= {1, 3, 4, 6}  # never a zero-mass token while mass is left
    # exact probability of drawing the ordered pair (a, b): q(a) q(b) / (1 - q(a))
    pairs = torch.zeros(8, 8)
    pairs.index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(draws), accumulate=True)
    exact = q[:, None] * q[None, :] / (1 - q[:, None])
    exact.fill_diagonal_(0.0)
    assert 0.5 * (pairs / draws - exact).abs().sum() < 0.015  # TV of the pair law; sampling noise ~0.005
    assert torch.equal(q_drawn, q[tokens])  # q of each drawn token, from its position in the support
    # fewer candidates than draws: the race falls back to the whole vocabulary, zero-mass tokens last
    tokens, q_drawn = gumbel_topk_with_q(on_support[:1], 6, torch.Generator().manual_seed(2))
    assert tokens.shape == (1, 6) and set(tokens[0, :4].tolist()) == {1, 3, 4, 6} and len(set(tokens[0].tolist())) == 6
    assert (q_drawn[0, 4:] == 0).all()


def test_a_race_drawn_beforehand_draws_what_the_race_drawn_inside_does_and_must_fit_q():
    q = torch.softmax(torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(3)), -1)  # (B, W, S)
    inside = gumbel_topk(Proposal(q), 3, torch.Generator().manual_seed(5))
    race = exponential_race(q.shape, q.device, torch.Generator().manual_seed(5))  # the same generator state
    beforehand = gumbel_topk(Proposal(q), 3, None, race)
    assert torch.equal(inside, beforehand)
    # a static tree slices each level's race from one block: a slice of it is as good as a fresh draw
    block = exponential_race((3, 9, 6), q.device, torch.Generator().manual_seed(6))
    tokens = gumbel_topk(Proposal(q), 2, None, block[:, 5:9])
    assert torch.equal(tokens, (q / block[:, 5:9]).topk(2, dim=-1).indices)
    with pytest.raises(ValueError, match=r"race draws of shape \(3, 4, 5\) for probabilities of shape \(3, 4, 6\)"):
        gumbel_topk(Proposal(q), 2, None, race[..., :5])


def test_a_level_selection_is_the_cheapest_index_that_takes_the_same_entries():
    x = torch.arange(2 * 6).view(2, 6)
    for positions in ([0, 1, 2, 3, 4, 5], [2, 3], [4], [0, 2, 5], [3, 1], []):
        chosen = selection(positions, 6, x.device)
        assert torch.equal(select(x, chosen), x[:, torch.tensor(positions, dtype=torch.long)])
    assert selection([0, 1, 2, 3, 4, 5], 6, x.device) is None  # every position in order: x itself
    assert selection([2, 3], 6, x.device) == slice(2, 4)  # a run: a view
    assert isinstance(selection([3, 1], 6, x.device), torch.Tensor)


def test_a_chain_of_single_draws_plans_no_index_tensors():
    chain = StaticTreeSpec(((0,), (0, 0), (0, 0, 0), (1,)))  # the root draws 2, then a chain of first draws
    levels = chain.plan(torch.device("cpu"))
    assert [level.width for level in levels] == [2, 1, 1]
    assert levels[0].expanded_slot == slice(0, 1) and levels[0].hidden_slot is None and levels[0].draw is None
    middle = levels[1]  # one node, one draw, one expanded node: nothing to index
    assert middle.draw is None and middle.hidden_slot is None and middle.expanded_slot is None
