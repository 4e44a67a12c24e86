"""The checks only a CUDA GPU can run: every test here is `@pytest.mark.gpu` (skipped without CUDA, tests/conftest.py).

Run them through `python -m inference.measure.gpu_check` (about 5 minutes on one 80 GB GPU), which writes the
device, the versions, each test's outcome and duration, and the figures the tests record (`record_property`)
to one JSON file:

- a real-size Janus-Pro-7B with random weights trains its EAGLE-3 drafter for two steps as configs/eagle3_janus.yaml
  says (online features, bf16-mixed, Lightning's stock DeepSpeed ZeRO-2), on a token-only dataset extracted on
  the fly: peak GPU memory and wall time;
- the decode latency command (`python -m inference.bench --latency --random-weights`) for the three real-size
  targets: AR step, tree forward and the speculative step of `exact` and `cascade`;
- `exact` speculative sampling reproduces AR's distribution on a tiny target moved to the GPU.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_toy_target
from stub_drafters import FixedLogitsDrafter
from test_decoder_generate import PROMPTS, chi_square_p_value

from inference.decoding.autoregressive import generate_ar
from inference.decoding.rules import ExactRule
from inference.decoding.speculative import DecoderConfig, generate_speculative
from models.registry import shared_target

pytestmark = pytest.mark.gpu

GIB = 2**30
JANUS_BF16_WEIGHTS_GIB = 7.4e9 * 2 / GIB  # the target alone; the fit's peak must hold it


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    """Start every test with no target cached and the peak-memory counter reset; free what it built after."""
    shared_target.cache_clear()  # type: ignore[attr-defined]
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    shared_target.cache_clear()  # type: ignore[attr-defined]
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def deepspeed_on_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DeepSpeed's CUDA accelerator for this test, whatever an earlier import picked (CPU tests may ask for its CPU
    accelerator through DS_ACCELERATOR)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    previous = get_accelerator()
    if previous.device_name() != "cuda":
        set_accelerator(CUDA_Accelerator())
    yield
    set_accelerator(previous)


def janus_fit_arguments(folder: Path) -> list[str]:
    """configs/eagle3_janus.yaml on one GPU for two steps: the real-size target with random weights, online features
    from a 4-image token-only dataset extracted first, no validation (its decode callback samples whole images)."""
    return [
        "--config", "eagle3_janus",
        "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
        "--trainer.strategy", "deepspeed_stage_2", "--trainer.precision", "bf16-mixed",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(folder / "runs"),
        "--model.target_options", "{random_weights: real}",
        "--data.train_dir", str(folder / "shards"), "--data.extract_config", "extract_toy",
        "--data.extract_overrides", "{prompts.count: 4, samples_per_shard: 4, batch_size: 4}",
        "--data.num_workers", "0", "--data.num_val_shards", "0",
        "--checkpoint.every_n_train_steps", "2", "--validate_before", "false",
    ]  # fmt: skip


def test_janus_pro_7b_real_size_trains_online_under_deepspeed(
    tmp_path: Path, deepspeed_on_cuda: None, record_property, capsys: pytest.CaptureFixture[str]
):
    from training.fit import main

    started = time.perf_counter()
    status = main(janus_fit_arguments(tmp_path))
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / GIB
    record_property("seconds", round(seconds, 1))
    record_property("peak_memory_gib", round(peak, 2))
    record_property("gpu", torch.cuda.get_device_name())
    printed = capsys.readouterr().out
    assert status == 0, printed[-2000:]
    assert "steps: 2" in printed
    assert peak > JANUS_BF16_WEIGHTS_GIB  # the real-size target sat on the GPU, beside the drafter
    run = tmp_path / "runs" / "eagle3_janus" / "version_0"
    assert (run / "drafter" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "last.ckpt").exists()  # DeepSpeed writes a checkpoint folder


@pytest.mark.parametrize("name", ["janus-pro-7b", "lumina-mgpt-7b", "llamagen-xl"])
def test_decode_latency_of_the_real_size_targets(name: str, tmp_path: Path, record_property):
    from inference.measure.bench import main

    out = tmp_path / f"latency-{name}.json"
    argv = ["--latency", "--target", name, "--random-weights", "--size", "real", "--dtype", "bfloat16",
            "--device", "cuda", "--rules", "exact,cascade", "--latency-steps", "10", "--out", str(out)]  # fmt: skip
    (summary,) = main(argv)
    record_property("command", "python -m inference.bench " + " ".join(argv))
    record_property("build_seconds", round(summary["build_seconds"], 1))
    record_property("ar_step_ms", round(summary["ar_ms"], 3))
    record_property("tree_forward_ms", round(summary["verify_ms"], 3))
    record_property("tree_nodes", summary["tree_nodes"])
    record_property("peak_memory_gib", round(summary["peak_memory_gib"], 2))
    for rule in summary["rules"]:
        record_property(f"spec_step_ms_{rule['rule']}", round(rule["spec_step_ms"], 3))
    assert summary["device"].startswith("cuda") and summary["ar_ms"] > 0 and summary["verify_ms"] > 0
    assert [rule["rule"] for rule in summary["rules"]] == ["exact", "cascade"]
    assert all(rule["spec_step_ms"] > 0 for rule in summary["rules"])


@pytest.mark.parametrize(
    "config",
    [
        DecoderConfig(tree="static", static_tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
        DecoderConfig(tree="dynamic-sampled", top_k=3, depth=3, total_tokens=10),
    ],
    ids=["static", "dynamic-sampled"],
)
def test_exact_rule_samples_the_ar_distribution_on_cuda(config: DecoderConfig, record_property):
    """tests/test_decoder_generate.py's two-sample test (4800 images of 4 tokens over 6 codes), on the GPU."""
    target = build_tiny_toy_target(seed=3, grid=2, vocab=6).to("cuda")
    assert target.device.type == "cuda"
    prompts = [PROMPTS[0]] * 4800
    ar = generate_ar(target, prompts, generator=torch.Generator("cuda").manual_seed(1)).tokens
    drafter = FixedLogitsDrafter(torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 0.8], device="cuda"))  # often wrong
    spec = generate_speculative(
        target, drafter, prompts, ExactRule(), config, generator=torch.Generator("cuda").manual_seed(2)
    )
    assert spec.tokens.device.type == "cuda"
    ar, tokens = ar.cpu(), spec.tokens.cpu()
    record_property("tau", round(float(spec.tau), 3))
    assert 1.0 < spec.tau and (spec.accepted == 0).any()  # some drafts accepted, some rejected
    p_values = []
    for i in range(3):  # joint distribution of consecutive token pairs
        p_values.append(chi_square_p_value(ar[:, i] * 6 + ar[:, i + 1], tokens[:, i] * 6 + tokens[:, i + 1]))
    record_property("pair_p_values", [round(p, 4) for p in p_values])
    assert min(p_values) > 1e-3, f"AR and exact differ: pair p-values {p_values}"


@pytest.mark.parametrize("kind", ["static-sampled", "dynamic-sampled", "deterministic"])
def test_exact_verification_is_lossless_on_cuda(kind: str, record_property):
    """tests/test_decoder_lossless.py's enumeration (every draft tree, every accept/reject), with `verify` on CUDA."""
    from test_decoder_lossless import TREE_KINDS, World, enumerate_kind, output_tv

    assert kind in TREE_KINDS
    world = World(seed=3)
    tv = output_tv(world, enumerate_kind(world, kind), ExactRule(), device="cuda")
    record_property("total_variation", tv)
    assert tv <= 1e-6
