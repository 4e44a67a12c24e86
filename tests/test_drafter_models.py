"""EAGLE-1/EAGLE-3 draft heads: the TTT unroll against a step-by-step decode, vocab maps, checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import build_tiny_toy_target

from inference.decoding.autoregressive import generate_ar
from inference.decoding.eagle import EagleDrafter
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.verify import ExactRule
from models.eagle import DrafterConfig, EagleDraftModel, drafter_preset, ttt_attention_mask, vocab_map_from_counts

PROMPTS = ["a small red circle at the top left on a plain blue background", "a big green square on stripes"]


def tiny_drafter(architecture: str, seed: int = 0, **overrides) -> EagleDraftModel:
    torch.manual_seed(seed)
    model = EagleDraftModel(drafter_preset("tiny", architecture, num_kv_heads=1, **overrides))
    for parameter in model.parameters():  # weights large enough that every input changes the output
        parameter.data.normal_(0, 0.3)
    return model


def test_ttt_mask_is_causal_context_plus_own_ancestors():
    valid = torch.tensor([[True, True, True], [True, True, False]])
    mask = ttt_attention_mask(valid, step=2)  # (2, 3, 9)
    expected_row1 = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0], expected_row1)
    assert torch.equal(mask[1, :2], expected_row1[:2])
    assert mask[1, 2].tolist() == [True, True, True, False, False, True, False, False, True]  # padding sees itself


def close_in_fp32(decoded: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal up to fp32 rounding relative to the vector's scale: the decoder multiplies fused, pre-transposed
    weights (models.eagle_fused), so its sums round differently from the training modules' on large values."""
    return bool((decoded - reference).abs().max() <= 1e-5 + 1e-5 * reference.abs().max())


@pytest.mark.parametrize("architecture", ["eagle1", "eagle3"])
def test_ttt_unroll_equals_step_by_step_decoding(architecture):
    """Step k at element t must equal the drafter run through its KV cache as the decoder runs it:
    context 0..t from target features, then a chain of k draft nodes fed its own hidden."""
    target = build_tiny_toy_target()
    model = tiny_drafter(architecture).eval()
    drafter = EagleDrafter(model, target)
    rows, length, steps = 2, 7, 3
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(rows, length, model.config.feature_width, generator=generator)
    tokens = torch.randint(0, 64, (rows, length), generator=generator)
    valid = torch.ones(rows, length, dtype=torch.bool)
    valid[1, 5:] = False  # a shorter sample: its padding must not leak into valid elements
    index = torch.arange(length + steps - 1)
    positions = target.image_positions(index).expand(rows, -1)
    with torch.no_grad():
        unrolled = model.unroll(target.embed_image_tokens, features, tokens, positions, valid, steps)
    checked = 0
    for row in range(rows):
        size = int(valid[row].sum())
        for t in range(size):
            cache = drafter.allocate_cache(1, 32)
            out = drafter.forward(
                features[row : row + 1, : t + 1],
                tokens[row : row + 1, : t + 1],
                positions[row : row + 1, : t + 1],
                cache,
                from_target=True,
            )
            hidden = out.hidden[:, -1:]
            assert close_in_fp32(hidden[0, 0], unrolled[0][row, t])
            tree_start = cache.length
            for depth in range(1, steps):
                if t + depth >= size:
                    break
                out = drafter.forward(
                    hidden,
                    tokens[row : row + 1, t + depth : t + depth + 1],
                    positions[row : row + 1, t + depth : t + depth + 1],
                    cache,
                    from_target=False,
                    tree_start=tree_start,
                    tree_mask=torch.ones(1, 1, depth, dtype=torch.bool),
                )
                hidden = out.hidden
                assert close_in_fp32(hidden[0, 0], unrolled[depth][row, t]), (row, t, depth)
                checked += 1
    assert checked == (6 + 5) + (4 + 3)  # every (t, k >= 1) with t + k inside the sample (lengths 7 and 5)


def test_ttt_unroll_really_depends_on_the_mask():
    """Guard for the test above: letting step k see other elements' ancestors changes the outputs."""
    target = build_tiny_toy_target()
    model = tiny_drafter("eagle3").eval()
    features = torch.randn(1, 6, model.config.feature_width)
    tokens = torch.randint(0, 64, (1, 6))
    positions = target.image_positions(torch.arange(8)).expand(1, -1)
    valid = torch.ones(1, 6, dtype=torch.bool)
    right = model.unroll(target.embed_image_tokens, features, tokens, positions, valid, 3)
    import models.eagle as eagle

    original = eagle.ttt_attention_mask
    try:  # the bug the reference EAGLE-3 code shipped: causal (not diagonal) blocks for earlier steps
        eagle.ttt_attention_mask = lambda v, s: torch.cat([original(v, 0)] * (s + 1), dim=-1)
        wrong = model.unroll(target.embed_image_tokens, features, tokens, positions, valid, 3)
    finally:
        eagle.ttt_attention_mask = original
    assert torch.allclose(right[0], wrong[0])
    assert not torch.allclose(right[2], wrong[2], atol=1e-4)


def test_vocab_map_keeps_the_most_frequent_tokens_in_id_order():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = vocab_map_from_counts(counts, 3)
    used = torch.arange(3) + d2t
    assert used.tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        vocab_map_from_counts(counts, 7)


def test_reduced_vocabulary_logits_land_on_their_image_tokens():
    model = tiny_drafter("eagle3", draft_vocab_size=4)
    counts = torch.zeros(64)
    counts[[3, 10, 20, 63]] = 1
    d2t, t2d = vocab_map_from_counts(counts, 4)
    model.set_vocab_map(d2t, t2d)
    draft = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    full = model.to_image_vocab(draft)
    assert full.shape == (1, 64)
    assert full[0, [3, 10, 20, 63]].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert (full == torch.finfo(full.dtype).min).sum() == 60  # impossible, yet finite under CFG's u + s (c - u)


@pytest.mark.parametrize("architecture", ["eagle1", "eagle3"])
def test_checkpoint_round_trip_is_self_describing(tmp_path, architecture):
    model = tiny_drafter(architecture)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["drafter_config"]["architecture"] == architecture
    assert config["num_hidden_layers"] == 1
    loaded = EagleDraftModel.from_pretrained(tmp_path)
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    keys = set(model.state_dict())
    if architecture == "eagle3":
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
        assert "midlayer.self_attn.q_proj.weight" in keys and "midlayer.hidden_norm.weight" in keys
    else:
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= keys
        assert not any("input_layernorm" in key or "lm_head" in key for key in keys)
    assert not any("embed" in key for key in keys)  # the frozen embedding is the target's


def test_checkpoint_errors_name_the_problem(tmp_path):
    model = tiny_drafter("eagle3")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["drafter_config"]["hidden_sise"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_sise"):
        EagleDraftModel.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        EagleDraftModel.from_pretrained(tmp_path / "missing")


def test_config_validation():
    with pytest.raises(ValueError, match="architecture"):
        drafter_preset("tiny", "eagle2")
    with pytest.raises(ValueError, match="target_hidden_size"):
        drafter_preset("tiny", "eagle1", target_hidden_size=64)
    with pytest.raises(ValueError, match="unknown drafter preset"):
        drafter_preset("gpt", "eagle3")
    assert DrafterConfig.from_dict(dataclasses.asdict(drafter_preset("toy", "eagle3"))).vocab_size == 4096


def test_drafter_refuses_a_target_of_another_shape():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("toy", "eagle3"))
    with pytest.raises(ValueError, match="vocab_size 4096 vs the target's image vocabulary 64"):
        EagleDrafter(model, target)


@pytest.mark.parametrize("architecture", ["eagle1", "eagle3"])
def test_greedy_decoding_with_an_eagle_drafter_equals_greedy_ar(tiny_target, architecture):
    settings = dataclasses.replace(tiny_target.sampling, temperature=0.0)
    drafter = EagleDrafter(tiny_drafter(architecture), tiny_target)
    config = DecoderConfig(tree="dynamic", top_k=4, depth=3, total_tokens=14)
    result = generate_speculative(tiny_target, drafter, PROMPTS, ExactRule(), config, settings)
    assert torch.equal(result.tokens, generate_ar(tiny_target, PROMPTS, settings).tokens)
