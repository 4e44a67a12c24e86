"""The speculative generation loop on tiny random targets with stub drafters.

Greedy decoding must reproduce greedy AR token for token; with the `exact` rule sampling must
reproduce AR's token distribution (a two-sample chi-square test); stub drafters pin down tau.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_toy_target
from stub_drafters import FixedLogitsDrafter, OracleDrafter
from test_drafter_models import tiny_drafter

from inference.decoding import speculative, tree_drafting
from inference.decoding.autoregressive import generate_ar
from inference.decoding.drafter import build_draft_attention_mask
from inference.decoding.eagle import EagleDrafter
from inference.decoding.rules import CascadeRule, ExactRule, GSDBlocksRule, GSDRule, LanternRule
from inference.decoding.sampling import Proposal, proposal_distribution
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative
from inference.decoding.tree import MC_SIM_7B_63, StaticTreeSpec, Tree, WalkTables, load_static_tree, node_paths
from inference.decoding.tree_drafting import q_over_nodes
from inference.decoding.verify import build_latent_neighbours
from models.kv_cache import KVCache
from models.toy.target import ToyTarget

PROMPTS = ["a small red circle at the top left on a plain blue background", "a big green square on stripes"]
DYNAMIC = DecoderConfig(tree="dynamic", top_k=4, depth=3, total_tokens=14)
STATIC = DecoderConfig(tree="static", static_tree="naive_extend_57")
SAMPLED_DYNAMIC = DecoderConfig(tree="dynamic-sampled", top_k=4, depth=3, total_tokens=13)


def greedy(target):
    return dataclasses.replace(target.sampling, temperature=0.0)


@pytest.mark.parametrize(
    "config, make_drafter",
    [
        (STATIC, lambda t: OracleDrafter(t)),
        (STATIC, lambda t: OracleDrafter(t, wrong_every=3)),
        (DYNAMIC, lambda t: OracleDrafter(t, scale=0.3)),
        (DYNAMIC, lambda t: FixedLogitsDrafter(torch.randn(64, generator=torch.Generator().manual_seed(0)))),
        (SAMPLED_DYNAMIC, lambda t: OracleDrafter(t, wrong_every=3)),
    ],
    ids=["static-oracle", "static-partial", "dynamic-blurred", "dynamic-fixed", "dynamic-sampled-partial"],
)
def test_greedy_speculative_output_equals_greedy_ar(tiny_target, config, make_drafter):
    settings = greedy(tiny_target)
    expected = generate_ar(tiny_target, PROMPTS, settings).tokens
    result = generate_speculative(tiny_target, make_drafter(tiny_target), PROMPTS, ExactRule(), config, settings)
    assert torch.equal(result.tokens, expected)
    assert result.target_forwards == 1 + result.accepted.shape[0]


def test_greedy_speculative_output_equals_greedy_ar_without_guidance(tiny_target):
    settings = dataclasses.replace(greedy(tiny_target), cfg_scale=1.0)  # B rows only, no unconditional half
    expected = generate_ar(tiny_target, PROMPTS, settings).tokens
    result = generate_speculative(
        tiny_target, OracleDrafter(tiny_target, scale=0.3), PROMPTS, ExactRule(), DYNAMIC, settings
    )
    assert torch.equal(result.tokens, expected)


def test_greedy_static_decoding_without_top_k_equals_greedy_ar(tiny_target):
    settings = dataclasses.replace(greedy(tiny_target), top_k=None)  # q over the whole vocabulary, no support
    expected = generate_ar(tiny_target, PROMPTS, settings).tokens
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    result = generate_speculative(tiny_target, drafter, PROMPTS, ExactRule(), STATIC, settings)
    assert torch.equal(result.tokens, expected)


def test_q_of_the_inner_nodes_is_scattered_to_the_same_rows_from_supports_as_from_dense_rows():
    generator = torch.Generator().manual_seed(0)
    vocab, k, batch = 10, 3, 2
    inner_nodes = torch.tensor([0, 1, 3, 4])  # the root, then inner nodes of two levels; 2 and 5 are leaves
    levels = []
    for width in (1, 1, 2):  # the root, level 1's one expanded node, level 2's two
        support = torch.rand(batch, width, vocab, generator=generator).argsort(-1)[..., :k]  # distinct ids
        probs = torch.rand(batch, width, k, generator=generator).softmax(-1)
        levels.append(Proposal(probs, support, vocab))
    sparse = q_over_nodes(levels, inner_nodes, 6, vocab)  # one scatter
    dense = q_over_nodes([Proposal(q.dense()) for q in levels], inner_nodes, 6, vocab)  # one index_copy
    assert torch.equal(sparse, dense) and sparse.shape == (batch, 6, vocab)
    assert (sparse[:, [2, 5]] == 0).all() and torch.allclose(sparse[:, inner_nodes].sum(-1), torch.ones(batch, 4))
    with pytest.raises(ValueError, match="2 drafted nodes for a tree of 4 inner nodes"):
        q_over_nodes(levels[:2], inner_nodes, 6, vocab)


def test_oracle_drafter_is_fully_accepted_and_tau_is_depth_plus_one(tiny_target):
    result = generate_speculative(
        tiny_target, OracleDrafter(tiny_target), PROMPTS[:1], ExactRule(), STATIC, greedy(tiny_target)
    )
    # 16 tokens: token 0 from the prefill, then 6 + 6 per step, then the 3 left (2 drafts + bonus).
    assert result.accepted[:, 0].tolist() == [5, 5, 2]
    assert result.target_forwards == 4
    assert result.tau == pytest.approx((6 + 6 + 3) / 3)


def test_always_wrong_drafter_gives_tau_one(tiny_target):
    result = generate_speculative(
        tiny_target, OracleDrafter(tiny_target, scale=-1.0), PROMPTS, ExactRule(), DYNAMIC, greedy(tiny_target)
    )
    assert result.tau == 1.0 and (result.accepted == 0).all()
    assert result.target_forwards == tiny_target.geometry.num_tokens  # as many as AR


def test_partly_right_drafter_accepts_up_to_its_first_wrong_level(tiny_target):
    result = generate_speculative(
        tiny_target, OracleDrafter(tiny_target, wrong_every=3), PROMPTS[:1], ExactRule(), STATIC, greedy(tiny_target)
    )
    count, expected = 1, []
    while count < 16:  # the drafter is wrong about image indices 2, 5, 8, ...
        first_wrong = next(i for i in range(count, 64) if i % 3 == 2)
        accepted = min(first_wrong - count, 5, 16 - count - 1)
        expected.append(accepted)
        count += accepted + 1
    assert result.accepted[:, 0].tolist() == expected
    assert 1 < result.tau < 6


def chi_square_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square homogeneity test of equal-size samples of category ids; sparse cells pooled."""
    size = int(max(a.max(), b.max())) + 1
    ca, cb = torch.bincount(a, minlength=size).double(), torch.bincount(b, minlength=size).double()
    sparse = (ca + cb) < 10
    ca = torch.cat([ca[~sparse], ca[sparse].sum()[None]])
    cb = torch.cat([cb[~sparse], cb[sparse].sum()[None]])
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    statistic = ((ca - cb) ** 2 / (ca + cb)).sum()
    dof = torch.tensor(float(len(ca) - 1))
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.fixture(scope="module")
def lossless_case():
    """A target with 6 codes and 4 tokens per image, and 1200 plain AR samples from it."""
    torch.set_num_threads(1)
    target = build_tiny_toy_target(seed=3, grid=2, vocab=6)
    prompts = [PROMPTS[0]] * 1200  # one batch: rows accept different numbers of drafts
    return target, prompts, generate_ar(target, prompts, generator=torch.Generator().manual_seed(1)).tokens


@pytest.mark.parametrize(
    "config",
    [
        DecoderConfig(tree="static", static_tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
        DecoderConfig(tree="dynamic", top_k=3, depth=3, total_tokens=10),
        DecoderConfig(tree="dynamic-sampled", top_k=3, depth=3, total_tokens=10),
    ],
    ids=["static", "dynamic", "dynamic-sampled"],
)
def test_exact_rule_samples_the_ar_distribution(config, lossless_case):
    target, prompts, ar = lossless_case
    drafter = FixedLogitsDrafter(torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 0.8]))  # context-blind, often wrong
    spec = generate_speculative(
        target, drafter, prompts, ExactRule(), config, generator=torch.Generator().manual_seed(2)
    )
    assert 1.0 < spec.tau  # some drafts were accepted, some rejected
    assert (spec.accepted >= 0).any() and (spec.accepted == 0).any()
    for i in range(3):  # joint distribution of consecutive token pairs
        p_value = chi_square_p_value(ar[:, i] * 6 + ar[:, i + 1], spec.tokens[:, i] * 6 + spec.tokens[:, i + 1])
        assert p_value > 1e-3, f"tokens {i}, {i + 1}: p = {p_value:.2g}"


def test_sampling_is_reproducible_with_a_seed(tiny_target):
    rule = CascadeRule(tau_pos=0.5, tau_seq=0.3)
    runs = [
        generate_speculative(
            tiny_target,
            OracleDrafter(tiny_target, scale=0.5),
            PROMPTS,
            rule,
            STATIC,
            generator=torch.Generator().manual_seed(7),
        ).tokens
        for _ in range(2)
    ]
    assert torch.equal(*runs)


def test_the_inner_view_is_chosen_only_where_leaves_are_at_least_half_the_nodes():
    """The leaf row a walk may need costs more than the rows a tree of few leaves saves."""

    def tree_of(name: str):
        spec = StaticTreeSpec(load_static_tree(name))
        structure = spec.structure(torch.device("cpu"))
        n = spec.num_nodes
        tree = Tree(tokens=torch.zeros(1, n, dtype=torch.long), parents=structure.parents, depths=structure.depths,
                    q_full=torch.zeros(1, n, 4), sampled=True, max_depth=spec.max_depth,
                    max_children=spec.max_children)  # fmt: skip
        return tree.with_structure(structure)

    mc_sim, fitted = tree_of("mc_sim_7b_63"), tree_of("toy_demo_fit_8")
    assert speculative.view_nodes(mc_sim, ExactRule()).tolist() == mc_sim.inner_nodes.tolist()  # 11 of 26
    assert len(mc_sim.inner_nodes) == 11 and len(fitted.inner_nodes) == 7 and fitted.num_nodes == 9
    assert speculative.view_nodes(fitted, ExactRule()) is None  # 7 of 9: every node
    assert speculative.view_nodes(mc_sim, CascadeRule(kl_gate=0.5)) is None  # reads leaves


@pytest.mark.parametrize("cfg_scale", [None, 1.0], ids=["guided", "unguided"])
@pytest.mark.parametrize(
    "rule", [ExactRule(), CascadeRule(tau_pos=0.5, tau_seq=0.3, delta=0.3)], ids=["exact", "cascade"]
)
def test_a_view_of_the_inner_nodes_decodes_the_same_image(tiny_target, rule, cfg_scale, monkeypatch):
    """On a static tree the target's head and logits chain run only at nodes with children (and at a leaf that
    ends a walk): for one seed the image must be the one decoded with the target at every node."""
    spec = StaticTreeSpec(MC_SIM_7B_63)
    inner = spec.structure(torch.device("cpu")).inner_nodes
    assert len(inner) == 11 and spec.num_nodes == 26  # what the view saves on the default tree

    last_nodes, restricted = [], []
    settings = tiny_target.sampling if cfg_scale is None else dataclasses.replace(tiny_target.sampling, cfg_scale=1.0)

    class Record(DecodeHooks):
        def on_verify(self, tree, view, verdict):
            last_nodes.append(verdict.last_node)
            restricted.append(view.nodes is not None)

    def decode() -> torch.Tensor:
        drafter = OracleDrafter(tiny_target, scale=0.5)
        config = DecoderConfig(tree="static", static_tree="mc_sim_7b_63")
        generator = torch.Generator().manual_seed(3)
        return generate_speculative(tiny_target, drafter, PROMPTS, rule, config, settings, generator, Record()).tokens

    inner_only = decode()
    assert all(restricted)  # the decoder did verify with the inner-node view
    leaf = spec.structure(torch.device("cpu")).inner_row[torch.cat(last_nodes)] < 0
    assert 0 < leaf.sum() < len(leaf)  # some walks end at a leaf, where only at_leaf knows the target
    restricted.clear()
    monkeypatch.setattr(speculative, "view_nodes", lambda tree, rule: None)
    assert torch.equal(inner_only, decode())
    assert not any(restricted)


def test_every_rule_decodes_every_tree_kind(tiny_target):
    neighbours = build_latent_neighbours(tiny_target.vq.codebook, 20)
    rules = [
        LanternRule(neighbours=neighbours, k=10, delta=0.2),
        LanternRule(neighbours=neighbours, k=10, lam=3.0),
        GSDBlocksRule(group=8),
        GSDRule(embeddings=tiny_target.vq.codebook),
        CascadeRule(tau_pos=0.5, tau_seq=0.3, delta=0.3),
    ]
    sampled_dynamic = DecoderConfig(tree="dynamic-sampled", top_k=4, depth=3, total_tokens=13)
    for config in (DYNAMIC, DecoderConfig(tree="static", static_tree="mc_sim_7b_63"), sampled_dynamic):
        for rule in rules:
            result = generate_speculative(
                tiny_target,
                OracleDrafter(tiny_target, scale=0.5),
                PROMPTS[:1],
                rule,
                config,
                generator=torch.Generator().manual_seed(0),
            )
            assert result.tokens.shape == (1, 16) and 0 <= result.tokens.min() and result.tokens.max() < 64
            assert result.tau >= 1.0 and result.tv_charged <= 0.3 + 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_drafted_tree_that_claims_distinct_siblings_has_them(tiny_target, temperature):
    """Verification skips the duplicate-sibling test for a tree flagged `distinct_siblings`: every drafter sets
    the flag, so every tree it drafts, greedy or sampled, must have no two children of one node with one token."""

    class Record(DecodeHooks):
        def __init__(self) -> None:
            self.trees: list[Tree] = []

        def on_verify(self, tree, view, verdict) -> None:
            self.trees.append(tree)

    # a random tiny drafter: flat proposals, many near-equal candidates per node
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    configs = (
        DYNAMIC,
        DecoderConfig(tree="dynamic-sampled", top_k=4, depth=3, total_tokens=13),
        DecoderConfig(tree="static", static_tree="mc_sim_7b_63"),
    )
    settings = dataclasses.replace(tiny_target.sampling, temperature=temperature)
    for config in configs:
        record = Record()
        generate_speculative(
            tiny_target, drafter, PROMPTS, ExactRule(), config, settings=settings,
            generator=torch.Generator().manual_seed(0), hooks=record,
        )  # fmt: skip
        assert record.trees
        for tree in record.trees:
            assert tree.distinct_siblings
            children = tree.children  # (B, N, K), -1 padded
            kid_tokens = tree.tokens.gather(1, children.clamp_min(0).flatten(1)).view_as(children)
            same = (kid_tokens[..., :, None] == kid_tokens[..., None, :]) & (children[..., :, None] >= 0)
            same &= children[..., None, :] >= 0
            assert torch.equal(same.sum((-1, -2)), (children >= 0).sum(-1)), config.tree  # only each child itself


def test_decoding_after_a_kv_commit_equals_a_fresh_forward(tiny_target):
    """Commit different-length paths per row (padding marked invalid), then compact: logits match a fresh cache."""
    target, spec = tiny_target, StaticTreeSpec(MC_SIM_7B_63)
    conditioning = target.condition(PROMPTS, cfg=True)
    cache = target.allocate_cache(conditioning.rows, target.prefix_length + 64)
    target.prefill(conditioning, cache)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, spec.num_nodes), generator=g)
    parents = torch.tensor(spec.parents).expand(2, -1)
    depths = torch.tensor(spec.depths).expand(2, -1)
    from inference.decoding.tree import ancestor_mask

    mask = ancestor_mask(parents, spec.max_depth)
    start = cache.length
    target.forward(
        torch.cat([tokens, tokens]), target.image_positions(torch.cat([depths, depths])), cache, torch.cat([mask, mask])
    )
    last = torch.tensor([23, 5])  # a depth-5 node for prompt 0, a depth-2 node for prompt 1
    paths = node_paths(parents, depths, spec.max_depth)[torch.arange(2), last]  # (B, P)
    valid = paths >= 0
    cache.keep_columns(start, torch.cat([start + paths.clamp_min(0)] * 2), torch.cat([valid, valid]))
    next_tokens = torch.tensor([[7], [9]])
    lengths = valid.sum(1)  # tokens on each committed path
    for step in range(2):
        index = (lengths + step)[:, None]  # (B, 1) image index of the next token, per prompt
        got = target.forward(torch.cat([next_tokens] * 2), target.image_positions(torch.cat([index, index])), cache)
        for b in range(2):
            fresh_cond = target.condition([PROMPTS[b]], cfg=True)
            fresh = target.allocate_cache(2, target.prefix_length + 16)
            target.prefill(fresh_cond, fresh)
            sequence = torch.cat([tokens[b, paths[b, : lengths[b]]], next_tokens[b].repeat(step + 1)])[None]
            positions = target.image_positions(torch.arange(sequence.shape[1]))
            want = target.forward(sequence.repeat(2, 1), positions, fresh).logits[:, -1]  # (2, V)
            torch.testing.assert_close(got.logits[[b, b + 2], -1], want, atol=1e-4, rtol=1e-4)
        cache.compact(target.prefix_length)  # squeeze the padding out: nothing may change


def test_decoder_config_rejects_bad_trees():
    with pytest.raises(ValueError, match="tree must be"):
        DecoderConfig(tree="chain")
    with pytest.raises(ValueError, match="total_tokens"):
        DecoderConfig(tree="dynamic", top_k=2, depth=2, total_tokens=50)


class _AuxDrafter(FixedLogitsDrafter):
    """An EAGLE-3-style stub: reads the target's low/mid/high streams and records their width."""

    feature_source = "aux"

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__(logits)
        self.widths: list[int] = []

    def forward(self, features, tokens, positions, cache, *, from_target, **kwargs):
        if from_target:
            self.widths.append(features.shape[-1])
        return super().forward(features, tokens, positions, cache, from_target=from_target, **kwargs)


def test_eagle3_style_drafters_read_the_aux_streams(tiny_target):
    drafter = _AuxDrafter(torch.zeros(64))
    result = generate_speculative(tiny_target, drafter, PROMPTS, ExactRule(), DYNAMIC, greedy(tiny_target))
    assert set(drafter.widths) == {3 * tiny_target.hidden_size}
    assert torch.equal(result.tokens, generate_ar(tiny_target, PROMPTS, greedy(tiny_target)).tokens)


def test_draft_attention_mask_combines_context_validity_and_the_tree():
    cache = KVCache.allocate(1, 1, 1, 10, 1)
    cache.advance(torch.tensor([[True, False, True]]))  # committed context, one padded column
    cache.advance(torch.tensor([[True, True]]))  # two draft columns of an earlier tree level
    tree_mask = torch.tensor([[[True, False, False, False], [False, True, False, False]]])  # (1, T=2, J+T=4)
    mask = build_draft_attention_mask(cache, torch.ones(1, 2, dtype=torch.bool), tree_start=3, tree_mask=tree_mask)
    expected = torch.tensor([[[1, 0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 1]]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_the_causal_mask_after_the_cache_equals_the_general_mask_of_a_tree_started_there():
    generator = torch.Generator().manual_seed(0)
    cache = KVCache.allocate(1, 3, 1, 12, 1)
    cache.advance(torch.rand(3, 5, generator=generator) < 0.7)  # committed context with padded columns
    new_valid = torch.rand(3, 4, generator=generator) < 0.6  # (R, T): some new elements are padding
    fast = build_draft_attention_mask(cache, new_valid)  # no tree: the causal run after the cache
    general = build_draft_attention_mask(cache, new_valid, tree_start=cache.length)  # the same, built generally
    assert fast.shape == (3, 4, 9) and torch.equal(fast, general)
    assert fast[:, :, 5:].diagonal(dim1=1, dim2=2).all()  # every element sees itself, padding included


def test_a_static_trees_prebuilt_level_masks_are_each_levels_ancestors_after_the_committed_columns(tiny_target):
    spec = StaticTreeSpec(MC_SIM_7B_63)  # levels of several expanded nodes, some of them not first draws
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    forward, checked = drafter.forward, []

    def checking_forward(features, tokens, positions, cache, **kwargs):
        if kwargs.get("attention_mask") is not None:
            tree_start = kwargs["tree_start"]
            depth = 1 if cache.length == tree_start else depth_of[-1] + 1
            depth_of.append(depth)
            drafted = [n for d in range(1, depth + 1) for n in spec.expanded(d)]  # draft columns so far
            ancestors = spec.ancestors[spec.expanded(depth)][:, drafted]  # (W, J + W) from the spec itself
            context = cache.column_valid[:, None, :tree_start].expand(-1, len(spec.expanded(depth)), -1)
            expected = torch.cat([context, ancestors.expand(cache.rows, -1, -1)], dim=-1)  # (R, W, S)
            bias = kwargs["attention_mask"]  # additive: 0 where allowed, -inf elsewhere, in the drafter's dtype
            checked.append(
                bias.dtype == cache.entries.dtype
                and torch.equal(bias == 0, expected)
                and torch.equal(bias == float("-inf"), ~expected)
                and torch.equal(kwargs["tree_mask"], expected[..., tree_start:])
            )
        return forward(features, tokens, positions, cache, **kwargs)

    depth_of: list[int] = []
    drafter.forward = checking_forward  # type: ignore[method-assign]
    config = DecoderConfig(tree="static", static_tree="mc_sim_7b_63")
    generate_speculative(tiny_target, drafter, PROMPTS, ExactRule(), config, generator=torch.Generator().manual_seed(0))
    assert len(checked) >= spec.max_depth - 1 and all(checked)  # every level of every tree got its own mask
    assert max(depth_of) == spec.max_depth - 1


@pytest.mark.parametrize("reads_bias", [True, False], ids=["reads-bias", "wants-tree-mask"])
@pytest.mark.parametrize("tree", ["dynamic", "dynamic-sampled"])
def test_a_dynamic_trees_level_masks_are_each_nodes_ancestors_after_the_committed_columns(
    tiny_target, tree, reads_bias
):
    """Each level of a dynamic tree hands the drafter its whole mask as the additive bias: the committed columns'
    validity, then every node's ancestors and itself among the draft columns. The expected masks are rebuilt
    here from which node each node's features came from: a node's features are its parent's output hidden. A
    drafter that reads the bias (`reads_attention_mask`) gets no tree_mask; one that does not gets the ancestors."""
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    drafter.reads_attention_mask = reads_bias  # type: ignore[misc]
    forward, checked, deepest = drafter.forward, [], [0]
    previous: dict[str, torch.Tensor] = {}

    def checking_forward(features, tokens, positions, cache, **kwargs):
        tree_start = kwargs.get("tree_start")
        if tree_start is not None:
            rows, width = tokens.shape
            if cache.length == tree_start:  # the first level: every node is a child of the root
                ancestry = torch.zeros(rows, width, 0, dtype=torch.bool)
                depth = 1
            else:
                match = (features[:, :, None, :] == previous["hidden"][:, None, :, :]).all(-1)  # (R, W, W_prev)
                assert (match.sum(-1) == 1).all()  # each node's features are exactly one earlier node's hidden
                parent = match.long().argmax(-1)  # (R, W)
                ancestry = previous["ancestry"][torch.arange(rows)[:, None], parent]  # (R, W, J)
                depth = previous["depth"] + 1
            ancestry = torch.cat([ancestry, torch.eye(width, dtype=torch.bool).expand(rows, -1, -1)], dim=2)
            context = cache.column_valid[:, None, :tree_start].expand(-1, width, -1)
            expected = torch.cat([context, ancestry], dim=-1)  # (R, W, S)
            bias = kwargs["attention_mask"]  # additive: 0 where allowed, -inf elsewhere, in the drafter's dtype
            checked.append(
                bias.dtype == cache.entries.dtype
                and torch.equal(bias == 0, expected)
                and torch.equal(bias == float("-inf"), ~expected)
                and (kwargs["tree_mask"] is None if reads_bias else torch.equal(kwargs["tree_mask"], ancestry))
            )
            previous.update(ancestry=ancestry, depth=depth)
            deepest[0] = max(deepest[0], depth)
        out = forward(features, tokens, positions, cache, **kwargs)
        if tree_start is not None:
            previous["hidden"] = out.hidden
        return out

    drafter.forward = checking_forward  # type: ignore[method-assign]
    config = DecoderConfig(tree=tree)
    generate_speculative(tiny_target, drafter, PROMPTS, ExactRule(), config, generator=torch.Generator().manual_seed(0))
    assert checked and all(checked)
    assert deepest[0] == config.depth - 1  # levels whose parents are draft columns were checked too


_MC_SIM = StaticTreeSpec(MC_SIM_7B_63)


@pytest.mark.parametrize(
    "config, sampler, levels, rows_per_level",
    [  # a static tree's block: the root's row, then one per drafted node
        (DecoderConfig(tree="static", static_tree="mc_sim_7b_63"), "gumbel_topk", _MC_SIM.max_depth, None),
        # the sampled dynamic tree's levels hold 1, 4 and 4 nodes: level 1 races on the root's row, each later
        # level on as many rows as the level before it has nodes
        (DecoderConfig(tree="dynamic-sampled", top_k=4, depth=3, total_tokens=13), "gumbel_topk_with_q", 3, [1, 4, 4]),
    ],
    ids=["static", "dynamic-sampled"],
)
def test_a_sampled_trees_levels_race_on_disjoint_rows_of_one_block_drawn_per_tree(
    tiny_target, monkeypatch, config, sampler, levels, rows_per_level
):
    """Every level of a sampled tree draws its children with Exp(1) draws of its own: disjoint rows of one
    block drawn per tree (shared rows would correlate the draws of different levels)."""
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    races: list[torch.Tensor] = []
    draw = getattr(tree_drafting, sampler)

    def recording(q, k, generator, race=None):
        races.append(race)
        return draw(q, k, generator, race)

    monkeypatch.setattr(tree_drafting, sampler, recording)
    generate_speculative(tiny_target, drafter, PROMPTS, ExactRule(), config, generator=torch.Generator().manual_seed(0))
    assert races and len(races) % levels == 0 and all(race is not None for race in races)
    block_rows = 1 + _MC_SIM.run_mask(torch.device("cpu")).shape[0] if rows_per_level is None else sum(rows_per_level)
    for start in range(0, len(races), levels):
        tree_races = races[start : start + levels]
        if rows_per_level is not None:
            assert [race.shape[1] for race in tree_races] == rows_per_level
        # one (B, rows, S) block per tree, each level's race a slice of its rows (decoding runs in inference
        # mode, which keeps no `_base`: the storage tells)
        storage = tree_races[0].untyped_storage().data_ptr()
        assert all(race.untyped_storage().data_ptr() == storage for race in tree_races)
        rows = [race.storage_offset() // race.stride(1) + i for race in tree_races for i in range(race.shape[1])]
        assert sorted(rows) == list(range(block_rows))  # disjoint, and together the whole block


def test_a_static_shapes_walk_tables_are_built_at_the_first_step_and_stay_what_a_fresh_build_gives(tiny_target):
    """Verification's index tables of a static shape are built once per device and batch and read at every
    later step; after whole decodes under every kind of rule they still equal tables built afresh."""
    spec = StaticTreeSpec(MC_SIM_7B_63)
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    memo = spec.walk_memo(torch.device("cpu"), len(PROMPTS))
    memo.clear()
    built = []
    original = WalkTables.build

    def counting_build(tree, nodes):
        built.append(nodes is None)
        return original(tree, nodes)

    config = DecoderConfig(tree="static", static_tree="mc_sim_7b_63")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WalkTables, "build", staticmethod(counting_build))
        neighbours = build_latent_neighbours(tiny_target.vq.codebook, 20)
        for rule in (ExactRule(), CascadeRule(), LanternRule(neighbours=neighbours, k=10, delta=0.2)):
            generate_speculative(
                tiny_target, drafter, PROMPTS, rule, config, generator=torch.Generator().manual_seed(1)
            )
    assert built == [False]  # the inner nodes' tables, once, for every step of the three decodes
    shared, batch, structure = memo[False], len(PROMPTS), spec.structure(torch.device("cpu"))
    parents, depths = structure.parents.expand(batch, -1), structure.depths.expand(batch, -1)
    tokens, q_full = torch.zeros(batch, spec.num_nodes, dtype=torch.long), torch.zeros(batch, spec.num_nodes, 2)
    fresh_tree = Tree(tokens, parents, depths, q_full, True, spec.max_depth, spec.max_children)
    fresh = original(fresh_tree, structure.inner_nodes)  # from parents, not from the shape's tables
    for field in dataclasses.fields(WalkTables):
        assert torch.equal(getattr(shared, field.name), getattr(fresh, field.name)), field.name
    for built_on_use in ("grandchildren", "parent_path_index", "parent_on_path"):  # CASCADE's, built at first use
        assert torch.equal(getattr(shared, built_on_use), getattr(fresh, built_on_use)), built_on_use


class _RowSplitDrafter(OracleDrafter):
    """The oracle for prompt 0 (its images finish in a few steps), the always-wrong drafter for the others."""

    def forward(self, features, tokens, positions, cache, **kwargs):
        out = super().forward(features, tokens, positions, cache, **kwargs)
        sign = torch.ones(out.logits.shape[0], 1, 1)
        batch = sign.shape[0] // 2  # [cond; uncond] rows
        sign[1:batch] = sign[batch + 1 :] = -1.0
        return type(out)(out.logits * sign, out.hidden)


def test_finished_images_stop_filling_the_cache_while_others_continue():
    """Prompt 0 completes in about a third of the steps, the others need one step per token: the finished
    row must not keep committing (and marking valid) its root every step, or the target cache overflows."""
    target = build_tiny_toy_target(grid=6)  # 36 tokens per image
    prompts = PROMPTS + ["a large blue cross in the center on a checkered pink background"]
    settings = greedy(target)
    deep = DecoderConfig(tree="dynamic", top_k=2, depth=6, total_tokens=10)  # prompt 0 takes 7 tokens per step
    result = generate_speculative(target, _RowSplitDrafter(target), prompts, ExactRule(), deep, settings)
    assert torch.equal(result.tokens, generate_ar(target, prompts, settings).tokens)
    idle = (result.accepted[:, 0] < 0).sum()
    assert idle > 9 + 7  # prompt 0 idled longer than the cache's spare columns (G // 4 + tree depth + 1)


class _EveryThirdTarget(ToyTarget):
    """A toy target with a layout rule: at image indices i with i % 3 == 0 only token i % V may appear."""

    def constrain_logits(self, logits: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        index = token_index.to(logits.device)[..., None]  # (B, ..., 1)
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        forbidden = (index % 3 == 0) & (vocab != index % logits.shape[-1])
        return logits.masked_fill(forbidden, float("-inf"))


def constrained(target: ToyTarget) -> _EveryThirdTarget:
    target.__class__ = _EveryThirdTarget
    return target


def obeys_rule(tokens: torch.Tensor, vocab: int) -> bool:
    index = torch.arange(tokens.shape[1])
    ruled = index % 3 == 0
    return bool(tokens[:, ruled].eq(index[ruled] % vocab).all())


@pytest.mark.parametrize(
    "config, make_drafter",
    [
        (STATIC, lambda t: OracleDrafter(t, wrong_every=3)),
        (DYNAMIC, lambda t: OracleDrafter(t, scale=0.3)),
        (DYNAMIC, lambda t: FixedLogitsDrafter(torch.randn(64, generator=torch.Generator().manual_seed(0)))),
    ],
    ids=["static-partial", "dynamic-blurred", "dynamic-fixed"],
)
def test_greedy_decoding_obeys_the_targets_constraint(config, make_drafter):
    settings = greedy(build_tiny_toy_target())
    assert not obeys_rule(generate_ar(build_tiny_toy_target(), PROMPTS, settings).tokens, 64)  # the rule bites
    target = constrained(build_tiny_toy_target())
    expected = generate_ar(target, PROMPTS, settings).tokens
    assert obeys_rule(expected, 64)
    result = generate_speculative(target, make_drafter(target), PROMPTS, ExactRule(), config, settings)
    assert torch.equal(result.tokens, expected)


def test_sampled_exact_decoding_obeys_the_targets_constraint():
    target = constrained(build_tiny_toy_target(seed=3, grid=2, vocab=6))
    prompts = [PROMPTS[0]] * 600
    ar = generate_ar(target, prompts, generator=torch.Generator().manual_seed(1)).tokens
    assert obeys_rule(ar, 6)
    drafter = FixedLogitsDrafter(torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 0.8]))
    for config in (
        DecoderConfig(tree="static", static_tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
        DecoderConfig(tree="dynamic", top_k=3, depth=3, total_tokens=10),
    ):
        spec = generate_speculative(
            target, drafter, prompts, ExactRule(), config, generator=torch.Generator().manual_seed(2)
        )
        assert obeys_rule(spec.tokens, 6)
        for i in (1,):  # the free tokens 1 and 2 still follow AR's distribution
            p_value = chi_square_p_value(ar[:, i] * 6 + ar[:, i + 1], spec.tokens[:, i] * 6 + spec.tokens[:, i + 1])
            assert p_value > 1e-3, f"{config.tree}, tokens {i}, {i + 1}: p = {p_value:.2g}"


@pytest.mark.parametrize(
    "config, accepted",
    [(STATIC, [5, 5, 2]), (DecoderConfig(tree="dynamic", top_k=2, depth=4, total_tokens=15), [4, 4, 4])],
    ids=["static", "dynamic"],  # dynamic: roots at 5 and 10 predict the constrained indices 6 and 11
)
def test_oracle_drafts_obey_the_targets_constraint_and_are_fully_accepted(config, accepted):
    """The drafter's q gets the constraint at the index each node predicts (root and deeper levels alike),
    so the oracle drafter stays exact on the constrained target."""
    target = constrained(build_tiny_toy_target())
    result = generate_speculative(target, OracleDrafter(target), PROMPTS[:1], ExactRule(), config, greedy(target))
    assert obeys_rule(result.tokens, 64)
    assert result.accepted[:, 0].tolist() == accepted


def test_a_reduced_vocabulary_drafter_proposes_only_its_tokens_under_guidance(tiny_target):
    """CFG combines the drafter's [cond; uncond] logits as u + s (c - u): tokens outside a reduced draft
    vocabulary must stay impossible there, not turn into NaN (-inf - -inf) and poison q."""
    model = tiny_drafter("eagle3", draft_vocab_size=20)
    vocab = tiny_target.image_vocab_size
    image_ids = torch.arange(20) * 2  # draft id i is image token 2i
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[image_ids] = True
    model.set_vocab_map(image_ids - torch.arange(20), allowed)
    drafter = EagleDrafter(model, tiny_target)
    assert tiny_target.sampling.cfg_scale != 1.0
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 3, model.config.feature_width, generator=generator)  # [cond; uncond] rows
    tokens = image_ids[torch.randint(0, 20, (1, 3), generator=generator)].expand(2, -1)
    positions = tiny_target.image_positions(torch.arange(3)).expand(2, -1)
    out = drafter.forward(features, tokens, positions, drafter.allocate_cache(2, 8), from_target=True)
    proposal = proposal_distribution(out.logits, tiny_target.sampling, cfg=True)
    q, support = proposal.dense(), proposal.support  # (1, 3, V), (1, 3, k)
    assert torch.isfinite(q).all()
    assert torch.allclose(q.sum(-1), torch.ones(1, 3))
    assert q[..., ~allowed].abs().max() == 0
    assert allowed[support].all()
