"""Random-weight targets (real architecture sizes, tiny CPU builds), the AR-vs-verify latency check and the
whole speculative step's latency (drafting, tree forward, every rule, bookkeeping, projected speedup)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from inference.decoding.tree import ancestor_mask
from inference.measure.latency import measure_target_latency, synthetic_tree
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


def test_the_tree_forward_runs_the_head_where_the_decoder_does():
    """With `inner_logits` (the decoder's static trees) the timed tree forward computes logits only at the nodes
    with children, as `generate_speculative` does; otherwise at every node."""
    target = random_target("janus-pro-7b", "tiny", device="cpu")
    parents, depths = synthetic_tree(7, branching=2)  # nodes 0-2 have children
    asked: list[torch.Tensor | None] = []
    forward = target.forward

    def recording_forward(tokens, positions, cache, tree_mask=None, return_aux=False, logits_at=None):
        if tree_mask is not None:
            asked.append(logits_at)
        return forward(tokens, positions, cache, tree_mask=tree_mask, return_aux=return_aux, logits_at=logits_at)

    target.forward = recording_forward  # type: ignore[method-assign]
    for inner in (True, False):
        asked.clear()
        measure_target_latency(target, steps=2, warmup=0, tree=(parents, depths), inner_logits=inner)
        assert len(asked) == 2
        assert all(a is not None and a.tolist() == [0, 1, 2] for a in asked) if inner else asked == [None, None]


@pytest.mark.parametrize("name", sorted(RANDOM_BUILDERS))
def test_latency_forwards_all_see_the_same_context(name):
    torch.manual_seed(0)
    target = random_target(name, "tiny", device="cpu")
    seen: list[tuple[int, int, bool]] = []
    calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    forward = target.forward

    def recording_forward(tokens, positions, cache, tree_mask=None, return_aux=False, logits_at=None):
        seen.append((cache.length, tokens.shape[1], return_aux))
        calls.append((positions, tree_mask))
        return forward(tokens, positions, cache, tree_mask=tree_mask, return_aux=return_aux, logits_at=logits_at)

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
    from inference.measure.bench import main

    out = tmp_path / "latency.json"
    main(["--target", "lumina-mgpt-7b", "--random-weights", "--size", "tiny", "--target-only", "--tree-nodes", "9",
          "--latency-steps", "2", "--threads", "1", "--device", "cpu", "--out", str(out)])  # fmt: skip
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
    from inference.measure.bench import main

    (summary,) = main(["--target", "toy", "--latency", "--target-only", "--tree-nodes", "5", "--latency-steps", "2",
                       "--threads", "1"])  # fmt: skip
    assert summary["random_weights"] is False and summary["size"] is None
    assert summary["target"] == "toy" and summary["rows"] == 2
    assert summary["context_tokens"] == 36 // 2  # half the 6x6 image
    assert "tree verify (5 nodes/row)" in capsys.readouterr().out


def test_step_clock_times_the_asked_steps_through_the_loop_hooks():
    from inference.decoding.eagle import EagleDrafter
    from inference.decoding.rules import ExactRule
    from inference.decoding.speculative import DecoderConfig
    from inference.measure.step_latency import PHASES, time_decode_steps
    from models.random_weights import random_drafter_model

    target = random_target("llamagen-xl", "tiny", device="cpu")
    drafter = EagleDrafter(random_drafter_model(target, "tiny"), target)
    config = DecoderConfig(tree="dynamic", top_k=2, depth=2, total_tokens=5)
    timer = time_decode_steps(target, drafter, ExactRule(), config, ["a red fox"], target.sampling, steps=15, warmup=2)
    # 16 image tokens: at most 15 steps per decode, so 17 steps take a second decode, stopped right after step 17
    assert target.geometry.num_tokens == 16
    assert timer.completed == 17 and timer.timed == 15 and len(timer.accepted) == 15
    assert all(len(timer.ms[name]) == 15 and min(timer.ms[name]) > 0 for name in PHASES)


def test_bench_latency_measures_the_whole_speculative_step(tmp_path, capsys):
    from inference.decoding.rules import RULES
    from inference.decoding.speculative import DecoderConfig
    from inference.measure.bench import main
    from inference.measure.step_latency import DEFAULT_TAU

    out = tmp_path / "step.json"
    argv = ["--latency", "--target", "janus-pro-7b", "--random-weights", "--size", "tiny", "--latency-steps", "2",
            "--threads", "1", "--device", "cpu", "--out", str(out)]  # fmt: skip
    (summary,) = main(argv)
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["rules"] == json.loads(json.dumps(summary["rules"]))
    assert saved["tau"] == DEFAULT_TAU and saved["tau_default"] is True and "set it with --tau" in printed
    # the decoder's default: Janus names EAGLE's static list
    assert saved["tree"] == {**dataclasses.asdict(DecoderConfig()), "static_tree": "mc_sim_7b_63"}
    assert saved["tree_nodes"] == 26
    assert saved["drafter"].startswith("EAGLE-3 head of preset tiny") and saved["drafter_parameters"] > 0
    assert [r["rule"] for r in saved["rules"]] == list(RULES)  # exact, cascade and every other registered rule
    for line in ("AR step (1 token/row)", f"tree verify ({saved['tree_nodes']} nodes/row)", "drafting", "bookkeep"):
        assert line in printed
    ar_ms = saved["ar_ms"]
    for record in saved["rules"]:
        ms = record["ms"]
        assert record["steps"] == 2 and all(ms[part] > 0 for part in ms)
        assert ms["tree_forward"] == saved["verify_ms"]  # the isolated forward over the decoder's tree
        phases = ms["draft"] + ms["tree_forward"] + ms["view"] + ms["verify"] + ms["commit"]
        assert record["spec_step_ms"] == pytest.approx(phases, rel=1e-12)
        assert record["projected_speedup"] == pytest.approx(DEFAULT_TAU * ar_ms / record["spec_step_ms"], rel=1e-12)
        row = next(line for line in printed.splitlines() if line.startswith(f"{record['rule']} "))
        numbers = row.split()[1:]  # drafting, tree fwd, view, rule, bookkeeping, spec step, speedup
        assert [float(n) for n in numbers[:6]] == pytest.approx(
            [ms["draft"], ms["tree_forward"], ms["view"], ms["verify"], ms["commit"], record["spec_step_ms"]], abs=0.006
        )
        assert float(numbers[6].rstrip("x")) == pytest.approx(record["projected_speedup"], abs=0.006)


def test_bench_latency_refuses_target_only_options_for_the_whole_step():
    from inference.measure.bench import main

    with pytest.raises(SystemExit, match="--tree-nodes shape"):
        main(["--latency", "--target", "janus-pro-7b", "--random-weights", "--size", "tiny", "--tree-nodes", "9",
              "--device", "cpu"])  # fmt: skip
    with pytest.raises(SystemExit, match="tau"):
        main(["--latency", "--target", "llamagen-xl", "--random-weights", "--size", "tiny", "--tau", "0.5",
              "--rules", "exact", "--latency-steps", "1", "--threads", "1", "--device", "cpu"])  # fmt: skip


@pytest.mark.parametrize("name", sorted(RANDOM_BUILDERS))
def test_real_size_random_drafter_is_its_targets_preset(name):
    from inference.decoding.eagle import EagleDrafter
    from models.eagle import drafter_preset
    from models.random_weights import random_drafter_model

    target = random_target(name, "real", dtype=torch.bfloat16, device="meta")
    model = random_drafter_model(target, name)
    EagleDrafter(model, target)  # check_compatible: vocabulary, hidden size, aux streams
    assert model.config == drafter_preset(name, "eagle3", target=target.name)  # the preset's shape, untouched
    assert model.fc.weight.dtype == torch.bfloat16 and model.fc.weight.device.type == "meta"
    assert model.d2t.dtype == torch.long  # integer buffers keep their type
