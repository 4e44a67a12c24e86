"""EAGLE-2 dynamic-tree drafting (`draft_dynamic_tree`) against a per-row textbook loop in plain Python.

The drafter is a lookup table: its logits after a token are that token's row, whatever the context, so the
reference can follow EAGLE-2's expansion literally (docs/method.md, section "Drafting a tree"): the root's top-k, then
per level the top-k children of every frontier node scored by cumulative log q, the top-k of those as the next frontier,
and finally the best `total_tokens - 1` candidates. The vectorised drafter must build the same tree and write q over the
vocabulary at exactly the kept nodes the drafter ran on.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from inference.decoding.drafter import DraftContext, DraftOutput
from inference.decoding.sampling import proposal_distribution
from inference.decoding.tree_drafting import draft_dynamic_tree
from models.kv_cache import KVCache
from models.target import SamplingDefaults


class TableDrafter:
    """Logits after token t are `table[t]` (V,), whatever the context; no features."""

    feature_source = "hidden"

    def __init__(self, table: Tensor) -> None:
        self.table = table

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        return KVCache.allocate(1, rows, 1, capacity, 1)  # only counts columns

    def prefill(self, conditioning, target_prefix, cache) -> None:  # noqa: ANN001 - protocol stub
        pass

    def forward(self, features: Tensor, tokens: Tensor, positions: Tensor, cache: KVCache, **_: object) -> DraftOutput:
        cache.advance(tokens.shape[1])
        return DraftOutput(self.table[tokens], torch.zeros(*tokens.shape, 1))


def reference_tree(q_after, root_token: int, root_q: list[float], top_k: int, depth: int, total: int):
    """EAGLE-2 for one row, one node at a time. Returns tokens, parents, depths and q per node (None: not run)."""

    def ranked(q: list[float]) -> list[tuple[int, float]]:  # top-k (token, log q), likeliest first
        order = sorted(range(len(q)), key=lambda t: -q[t])[:top_k]
        return [(t, math.log(q[t]) if q[t] > 0 else -1e30) for t in order]

    # candidates: [token, score, parent candidate (-1: the root), depth, q at it (if the drafter ran on it)]
    candidates = [[t, s, -1, 1, None] for t, s in ranked(root_q)]
    frontier = list(range(top_k))
    for level in range(1, depth):
        children = []
        for parent in frontier:
            q = q_after(candidates[parent][0])
            candidates[parent][4] = q
            children += [[t, candidates[parent][1] + s, parent, level + 1, None] for t, s in ranked(q)]
        first = len(candidates)
        candidates += children
        frontier = sorted(range(first, len(candidates)), key=lambda c: -candidates[c][1])[:top_k]
    kept = sorted(sorted(range(len(candidates)), key=lambda c: -candidates[c][1])[: total - 1])  # stable
    node_of = {c: n for n, c in enumerate(kept, start=1)}
    tokens = [root_token] + [candidates[c][0] for c in kept]
    parents = [-1] + [node_of.get(candidates[c][2], 0) for c in kept]
    depths = [0] + [candidates[c][3] for c in kept]
    return tokens, parents, depths, [root_q] + [candidates[c][4] for c in kept]


@pytest.mark.parametrize("top_k_setting", [None, 12], ids=["dense-q", "q-on-top-k-support"])
def test_dynamic_tree_drafting_equals_the_textbook_expansion(top_k_setting):
    from conftest import build_tiny_toy_target

    target = build_tiny_toy_target()
    vocab, batch, top_k, depth, total = target.image_vocab_size, 3, 3, 4, 14
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=g) * 3
    settings = SamplingDefaults(cfg_scale=1.0, temperature=1.0, top_k=top_k_setting)

    def q_after(token: int) -> list[float]:
        return proposal_distribution(table[token][None], settings, cfg=False).dense()[0].tolist()

    drafter = TableDrafter(table)
    cache = drafter.allocate_cache(batch, 64)
    root_token = torch.randint(0, vocab, (batch,), generator=g)
    root = proposal_distribution(table[root_token], settings, cfg=False)  # (B, V)
    ctx = DraftContext(drafter, cache, target, settings, False, torch.zeros(batch, dtype=torch.long), depth)
    tree = draft_dynamic_tree(ctx, root_token, root, torch.zeros(batch, 1), top_k, depth, total)
    assert ctx.forwards == depth - 1
    dense_root = root.dense()
    for b in range(batch):
        tokens, parents, depths, q_at = reference_tree(
            q_after, int(root_token[b]), dense_root[b].tolist(), top_k, depth, total
        )
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.depths[b].tolist() == depths
        for node, q in enumerate(q_at):
            want = torch.zeros(vocab) if q is None else torch.tensor(q)
            torch.testing.assert_close(tree.q_full[b, node], want, msg=f"row {b}, node {node}")
    assert not tree.sampled
