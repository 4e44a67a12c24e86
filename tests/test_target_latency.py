"""Random-weight targets (real architecture sizes, tiny CPU builds) and the AR-vs-verify latency check."""

from __future__ import annotations

import json

import pytest
import torch

from inference.latency import measure_target_latency, synthetic_tree
from inference.tree import ancestor_mask
from models.random_weights import RANDOM_BUILDERS, random_target

pytest.importorskip("transformers")


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_synthetic_tree_is_a_breadth_first_k_ary_tree():
    parents, depths = synthetic_tree(13, branching=3)
    assert parents.tolist() == [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    mask = ancestor_mask(parents[None], int(depths.max()))[0]
    assert mask.sum(1).tolist() == [1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3]  # self + ancestors
    with pytest.raises(ValueError, match="num_nodes"):
        synthetic_tree(0, 2)


def test_janus_real_size_has_the_deepseek_7b_language_model():
    target = random_target("janus-pro-7b", "real", dtype=torch.bfloat16, device="meta")
    vocab, width, mlp, layers = 102400, 4096, 11008, 30
    per_layer = 4 * width * width + 3 * width * mlp + 2 * width  # q, k, v, o; gate, up, down; two RMSNorms
    expected = 2 * vocab * width + layers * per_layer + width  # embeddings, lm_head, layers, final norm
    language = target.model.model.language_model
    assert parameter_count(language) + parameter_count(target.model.lm_head) == expected
    assert (target.num_layers, target.hidden_size, target.image_vocab_size) == (30, 4096, 16384)
    assert target.geometry.grid == (24, 24) and target.geometry.image_size == (384, 384)
    assert target.aux_layer_ids == (2, 15, 27)
    assert target.image_head_weight().dtype == torch.bfloat16


def test_lumina_real_size_is_chameleon_7b():
    target = random_target("lumina-mgpt-7b", "real", dtype=torch.bfloat16, device="meta")
    vocab, width, mlp, layers = 65536, 4096, 11008, 32
    qk_norms = 2 * 2 * width  # q_norm and k_norm: per-head LayerNorm weight and bias, (heads, head_dim) each
    per_layer = 4 * width * width + 3 * width * mlp + 2 * width + qk_norms
    expected = 2 * vocab * width + layers * per_layer + width
    language = target.model.model
    assert parameter_count(language) - parameter_count(language.vqmodel) + parameter_count(target.model.lm_head) == (
        expected
    )
    assert target.image_vocab_size == 8192 + 2  # codes + end-of-line + end-of-image
    assert target.geometry.grid == (48, 49) and target.geometry.image_size == (768, 768)


def test_llamagen_real_size_is_gpt_xl():
    target = random_target("llamagen-xl", "real", dtype=torch.bfloat16, device="meta")
    vocab, width, mlp, layers, caption = 16384, 1280, 3584, 36, 2048
    per_layer = 4 * width * width + 3 * width * mlp + 2 * width
    expected = 2 * vocab * width + layers * per_layer + width + caption * width + width * width  # + caption MLP
    assert parameter_count(target.gpt) == expected  # about 775 M, the official GPT-XL
    assert target.geometry.grid == (32, 32) and target.prefix_length == 120


def test_unknown_random_target_is_refused():
    with pytest.raises(ValueError, match="known: janus-pro-7b"):
        random_target("toy", "tiny")
    with pytest.raises(ValueError, match="size"):
        random_target("janus-pro-7b", "huge")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(RANDOM_BUILDERS))
def test_latency_forwards_all_see_the_same_context(name):
    torch.manual_seed(0)
    target = random_target(name, "tiny", device="cpu")
    seen: list[tuple[int, int, bool]] = []
    calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    forward = target.forward

    def recording_forward(tokens, positions, cache, tree_mask=None, return_aux=False):
        seen.append((cache.length, tokens.shape[1], return_aux))
        calls.append((positions, tree_mask))
        return forward(tokens, positions, cache, tree_mask=tree_mask, return_aux=return_aux)

    target.forward = recording_forward  # type: ignore[method-assign]
    report = measure_target_latency(target, tree_nodes=7, steps=3, warmup=1, branching=2)
    context = target.geometry.num_tokens // 2
    assert report.context_tokens == context and report.rows == 2 and report.tree_nodes == 7
    base = target.prefix_length + context
    assert seen[0] == (target.prefix_length, context, False)  # the context fill
    assert seen[1:5] == [(base, 1, True)] * 4  # AR steps, each over the same cache, aux streams on
    assert seen[5:] == [(base, 7, True)] * 4  # tree verifications, each over the same cache
    ar_positions, ar_mask = calls[1]
    assert ar_mask is None and ar_positions.tolist() == target.image_positions(torch.tensor([context])).tolist()
    tree_positions, tree_mask = calls[5]
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2])  # a binary tree of 7 nodes, breadth first
    assert tree_positions.tolist() == target.image_positions(context + depths).tolist()
    expected_mask = torch.tensor([[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0],
                                  [1, 1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 0, 1, 0],
                                  [1, 0, 1, 0, 0, 0, 1]], dtype=torch.bool)  # fmt: skip
    assert tree_mask is not None and tree_mask.shape == (2, 7, 7)
    assert torch.equal(tree_mask[0], expected_mask) and torch.equal(tree_mask[1], expected_mask)
    assert report.ar_ms > 0 and report.verify_ms > 0 and report.ar_p90_ms >= report.ar_ms
    assert report.parameters > 0 and report.peak_memory_gib is None
    with pytest.raises(ValueError, match="context_tokens must be in"):
        measure_target_latency(target, context_tokens=target.geometry.num_tokens)
    with pytest.raises(ValueError, match="steps >= 1"):
        measure_target_latency(target, steps=0)


def test_bench_random_weights_cli_writes_the_report(tmp_path, capsys):
    from inference.bench import main

    out = tmp_path / "latency.json"
    main(["--target", "lumina-mgpt-7b", "--random-weights", "--size", "tiny", "--tree-nodes", "9",
          "--latency-steps", "2", "--threads", "1", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "tree verify (9 nodes/row)" in printed and "verify / AR" in printed
    saved = json.loads(out.read_text())
    assert saved["random_weights"] is True and saved["size"] == "tiny" and saved["tree_nodes"] == 9
    assert saved["verify_ms"] > 0 and saved["ar_ms"] > 0 and saved["verify_over_ar"] > 0


def test_registry_builds_random_weights_instead_of_loading():
    from models.registry import load_target

    # path would be a download; random_weights builds the architecture instead and ignores it
    target = load_target("janus-pro-7b", path="deepseek-community/Janus-Pro-7B", random_weights="tiny", device="cpu")
    assert target.name == "janus-pro-7b (random tiny)" and target.hidden_size == 32
    with pytest.raises(ValueError, match="size must be"):
        load_target("lumina-mgpt-7b", random_weights="large")


def test_bench_latency_of_a_loaded_target(capsys):
    from inference.bench import main

    (summary,) = main(["--target", "toy", "--latency", "--tree-nodes", "5", "--latency-steps", "2", "--threads", "1"])
    assert summary["random_weights"] is False and summary["size"] is None
    assert summary["target"] == "toy" and summary["rows"] == 2
    assert summary["context_tokens"] == 36 // 2  # half the 6x6 image
    assert "tree verify (5 nodes/row)" in capsys.readouterr().out
