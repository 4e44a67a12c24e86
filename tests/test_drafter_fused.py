"""The decoding form of the drafter (`models.eagle_fused.FusedDraftStep`) against the training modules.

Same hidden states and logits through the KV cache, for both heads, grouped key/value heads and a
reduced draft vocabulary; fused weights that follow an optimizer step; fewer aten ops than the modules;
CFG before the drafter's own head equal to CFG of its logits, at the elements asked for.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_toy_target
from test_drafter_models import close_in_fp32, tiny_drafter

from inference.decoding.eagle import EagleDrafter
from inference.decoding.sampling import combine_cfg
from inference.measure.cost import OpCounter
from models.eagle_fused import FusedDraftStep
from models.kv_cache import KVCache


def run_both(model, target, seed: int = 0, three_op_norms: bool | None = None):
    """Two passes (3 context elements, then 2 tree nodes) of the modules and of the fused step, each
    through its own cache. Returns [(module hidden, fused hidden, module logits, fused logits)] per pass."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = 2, model.config.feature_width
    module_cache, fused_cache = (model_cache(model, rows) for _ in range(2))
    step = FusedDraftStep(model, three_op_norms)
    passes = []
    features = torch.randn(rows, 3, width, generator=generator)
    for length, from_target in ((3, True), (2, False)):
        tokens = torch.randint(0, target.image_vocab_size, (rows, length), generator=generator)
        positions = target.image_positions(torch.arange(length) + module_cache.length).expand(rows, -1)
        columns = module_cache.length + length
        mask = torch.ones(rows, length, columns, dtype=torch.bool).tril(module_cache.length)
        embeds = target.embed_image_tokens(tokens)
        with torch.no_grad():
            module_hidden, _, _ = model(embeds, features, positions, mask, from_target=from_target, cache=module_cache)
            fused_hidden = step.run(step.weights(), embeds, features, positions, mask, from_target=from_target,
                                    cache=fused_cache)  # fmt: skip
            head = target.image_head
            module_logits, fused_logits = (
                model.draft_logits(module_hidden, head),
                step.draft_logits(fused_hidden, head)[0],
            )
            passes.append((module_hidden, fused_hidden, module_logits, fused_logits))
        module_cache.advance(length)
        fused_cache.advance(length)
        features = module_hidden[:, -2:]  # deeper levels read the drafter's own hidden
    return passes, module_cache, fused_cache


def test_a_drafter_call_checks_its_fused_weights_once(monkeypatch):
    """The rebuild check walks every parameter; `EagleDrafter.forward` makes it once and hands the weights to
    both the step and `draft_logits`."""
    target = build_tiny_toy_target()
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), target)
    checks = 0
    check = drafter.step.weights

    def counted():
        nonlocal checks
        checks += 1
        return check()

    monkeypatch.setattr(drafter.step, "weights", counted)
    config, rows = drafter.model.config, 2
    cache = KVCache.allocate(1, rows, config.kv_heads, 8, config.head_dim)
    tokens = torch.zeros(rows, 3, dtype=torch.long)
    features = torch.randn(rows, 3, config.feature_width)
    positions = target.image_positions(torch.arange(3)).expand(rows, -1)
    with torch.no_grad():
        drafter.forward(features, tokens, positions, cache, from_target=True)
    assert checks == 1


def model_cache(model, rows: int):
    from models.kv_cache import KVCache

    config = model.config
    return KVCache.allocate(1, rows, config.kv_heads, 16, config.head_dim)


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("eagle1", {}), ("eagle3", {}), ("eagle3", {"draft_vocab_size": 40})],
    ids=["eagle1", "eagle3", "eagle3-reduced-vocab"],
)
@pytest.mark.parametrize("three_op_norms", [True, False], ids=["three-op-norms", "rms-norm-kernel"])
def test_fused_step_equals_the_modules_through_the_cache(architecture, overrides, three_op_norms):
    """Both forms of the norms: the CPU's three ops (the default here) and `F.rms_norm` (CUDA's default)."""
    target = build_tiny_toy_target()
    model = tiny_drafter(architecture, **overrides).eval()
    assert model.config.kv_heads < model.config.num_heads  # grouped key/value heads are exercised
    passes, module_cache, fused_cache = run_both(model, target, three_op_norms=three_op_norms)
    for module_hidden, fused_hidden, module_logits, fused_logits in passes:
        assert close_in_fp32(fused_hidden, module_hidden)
        assert close_in_fp32(fused_logits, module_logits)
    assert close_in_fp32(fused_cache.keys[:, :, :, :5], module_cache.keys[:, :, :, :5])  # rotated keys
    assert close_in_fp32(fused_cache.values[:, :, :, :5], module_cache.values[:, :, :, :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trees_rotary_tables_and_attention_bias_built_once_give_the_per_call_results_bit_for_bit(dtype):
    """A static tree's drafting computes the rotary tables of all its levels and its additive attention
    bias once, and passes each level its slice; each call alone computes them from positions and a bool mask."""
    target = build_tiny_toy_target()
    model = tiny_drafter("eagle3").to(dtype).eval()
    generator = torch.Generator().manual_seed(4)
    rows, width = 2, model.config.feature_width
    per_call, once = FusedDraftStep(model), FusedDraftStep(model)
    caches = [KVCache.allocate(1, rows, model.config.kv_heads, 16, model.config.head_dim, dtype) for _ in range(2)]
    level_positions = target.image_positions(torch.arange(3, 6)).expand(rows, -1)  # (R, 3) levels 1..3
    tables = once.rotary_per_column(level_positions)
    widths = (1, 3, 2)
    tree_mask = torch.rand(6, 6, generator=generator) < 0.5
    tree_mask = (tree_mask | torch.eye(6, dtype=torch.bool)).tril().expand(rows, -1, -1)  # (R, 6, 6) with itself
    bias = torch.zeros(tree_mask.shape, dtype=dtype).masked_fill_(~tree_mask, float("-inf"))
    features = torch.randn(rows, 1, width, generator=generator).to(dtype)
    start = 0
    for level, count in enumerate(widths):
        tokens = torch.randint(0, target.image_vocab_size, (rows, count), generator=generator)
        positions = level_positions[:, level : level + 1].expand(rows, count)  # one level, one position
        embeds = target.embed_image_tokens(tokens)
        mask, level_bias = (
            tree_mask[:, start : start + count, : start + count],
            bias[:, start : start + count, : start + count],
        )
        with torch.no_grad():
            expected = per_call.run(per_call.weights(), embeds, features, positions, mask, from_target=level == 0,
                                    cache=caches[0])  # fmt: skip
            got = once.run(once.weights(), embeds, features, positions, level_bias, from_target=level == 0,
                           cache=caches[1], rotary=tables[level])  # fmt: skip
        assert got.dtype == dtype and torch.equal(got, expected)
        for cache in caches:
            cache.advance(count)
        features = expected[:, -1:].expand(rows, widths[level + 1] if level + 1 < len(widths) else 1, -1)
        start += count
    assert torch.equal(caches[0].entries, caches[1].entries)  # the same rotated keys


def test_fused_weights_follow_an_optimizer_step():
    target = build_tiny_toy_target()
    model = tiny_drafter("eagle3")
    step = FusedDraftStep(model)
    before = step.weights()
    assert step.weights() is before  # nothing changed: no rebuild
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hidden, _, _ = model(*dummy_inputs(model, target), from_target=True)
    hidden.sum().backward()
    optimizer.step()  # in place: bumps every parameter's version
    after = step.weights()
    assert after is not before
    layer = model.midlayer
    expected = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    norms = torch.cat([layer.input_layernorm.weight, layer.hidden_norm.weight])  # folded into the rows
    gain = model.config.hidden_size**0.5  # and, on CPU, the factor the three-op norms leave out
    assert torch.equal(after.qkv, (expected.t() * (norms * gain)[:, None]).detach())
    model.eval()
    passes, _, _ = run_both(model, target)
    assert all(close_in_fp32(fused, module) for module, fused, _, _ in passes)


def dummy_inputs(model, target):
    rows, length = 1, 3
    tokens = torch.arange(length)[None]
    positions = target.image_positions(torch.arange(length))[None]
    mask = torch.ones(rows, length, length, dtype=torch.bool).tril()
    features = torch.randn(rows, length, model.config.feature_width)
    return target.embed_image_tokens(tokens), features, positions, mask


def test_fused_step_dispatches_fewer_ops_than_the_modules():
    target = build_tiny_toy_target()
    model = tiny_drafter("eagle3").eval()
    embeds, features, positions, mask = dummy_inputs(model, target)
    counts = {}
    for name in ("modules", "fused"):
        cache = model_cache(model, 1)
        step = FusedDraftStep(model)
        step.weights()  # the one-off fusion is not part of a call
        counter = OpCounter()
        with torch.no_grad(), counter.phase("draft"):
            if name == "modules":
                hidden, _, _ = model(embeds, features, positions, mask, from_target=True, cache=cache)
                model.draft_logits(hidden, target.image_head)
            else:
                hidden = step.run(step.weights(), embeds, features, positions, mask, from_target=True, cache=cache)
                step.draft_logits(hidden, target.image_head)
        counts[name] = counter.ops["draft"]
    # measured: 116 (modules) against 48 (fused: three norms of three ops each, not five)
    assert counts["fused"] <= 0.42 * counts["modules"], counts


@pytest.mark.parametrize("architecture, own_head", [("eagle1", False), ("eagle3", True)])
def test_guidance_before_the_drafters_head_equals_guidance_of_its_logits(architecture, own_head):
    """The decoder passes `cfg_scale` and `logits_at` (the last element read before a tree): a drafter's own
    (linear) head then runs on the combined rows at that element only, and must give what CFG of every row's
    logits gives there; through the target's head (the tiny EAGLE-1 drafter's) the logits come back unguided."""
    target = build_tiny_toy_target()
    reduced = {"draft_vocab_size": 40} if architecture == "eagle3" else {}  # with a reduced vocabulary too
    model = tiny_drafter(architecture, **reduced).eval()
    generator = torch.Generator().manual_seed(0)
    rows, length, scale = 4, 3, 4.5  # [cond; uncond] rows of two prompts
    features = torch.randn(rows, length, model.config.feature_width, generator=generator)
    tokens = torch.randint(0, target.image_vocab_size, (rows, length), generator=generator)
    positions = target.image_positions(torch.arange(length)).expand(rows, -1)
    valid = torch.ones(rows, length, dtype=torch.bool)
    last = torch.tensor([2, 1, 2, 1])  # per row, the element whose logits are wanted
    outputs = []
    for keywords in ({}, {"logits_at": last, "cfg_scale": scale}):
        drafter = EagleDrafter(model, target)
        cache = drafter.allocate_cache(rows, 8)
        outputs.append(drafter.forward(features, tokens, positions, cache, from_target=True, valid=valid, **keywords))
    every, guided = outputs
    picked = every.logits[torch.arange(rows), last]  # (R, V)
    want = (combine_cfg(picked, scale) if own_head else picked)[:, None]  # (B or R, 1, V)
    assert not every.guided and guided.guided == own_head and guided.logits.shape == want.shape
    finite = want > torch.finfo(want.dtype).min / 2  # outside a reduced draft vocabulary: the lowest logit
    torch.testing.assert_close(guided.logits[finite], want[finite], atol=1e-4, rtol=1e-4)
    assert torch.equal(finite, guided.logits > torch.finfo(want.dtype).min / 2)
    torch.testing.assert_close(guided.hidden, every.hidden)
