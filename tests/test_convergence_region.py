"""The convergence-region study: its ground truth and scores against naive loops, and its summary on known cases."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_toy_target

from inference.measure.pipeline.convergence_region import (
    RegionStudy,
    build_study,
    convergent_truth,
    format_table,
    parse_args,
    token_patches,
)
from models.registry import target_device
from training.losses import later_similarity
from training.objective import ObjectiveConfig


def test_token_patches_are_the_codebook_patches_in_grey_levels():
    target = build_tiny_toy_target()
    tokens = torch.randint(0, 64, (2, target.geometry.num_tokens), generator=torch.Generator().manual_seed(0))
    patches = token_patches(target, tokens)  # (B, G, C)
    expected = (target.vq.codebook[tokens].clamp(0, 1) * 255).round()
    assert torch.equal(patches, expected)


def test_truth_and_similarity_equal_naive_loops():
    generator = torch.Generator().manual_seed(1)
    patches = torch.randint(0, 30, (3, 7, 12), generator=generator).float()  # close and far patches
    features = torch.randn(3, 7, 5, generator=generator) + 2.0
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[2, 5:] = False
    truth = convergent_truth(patches, mask, 10.0)
    for centred in (False, True):
        similarity = later_similarity(features.double(), mask, centred)
        for b in range(3):
            for t in range(7):
                later = [u for u in range(t + 1, 7) if mask[b, t] and mask[b, u]]
                rms = [((patches[b, t] - patches[b, u]) ** 2).mean().sqrt().item() for u in later]
                assert bool(truth[b, t]) == any(r <= 10.0 for r in rms)
                a = features[b, t].double() - (features[b, t].double().mean() if centred else 0)
                cosines = []
                for u in later:
                    v = features[b, u].double() - (features[b, u].double().mean() if centred else 0)
                    cosines.append(float(a @ v / (a.norm() * v.norm())))
                assert similarity[b, t].item() == pytest.approx(max(cosines, default=-2.0), abs=1e-9)


def _repeating_batch():
    """Tokens with repeats; hidden = a one-hot of the token (similar exactly when equal), aux = noise."""
    tokens = torch.tensor([[3, 5, 3, 7, 9, 5, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29]])  # 3 and 5 recur later
    hidden = torch.nn.functional.one_hot(tokens, 64).float()  # (1, G, 64)
    aux = torch.randn(1, 16, 3 * 64, generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens, "loss_mask": torch.ones(1, 16, dtype=torch.bool), "hidden": hidden, "aux": aux}


def test_the_study_scores_a_perfect_signal_and_the_configs_region():
    target = build_tiny_toy_target()
    target.vq.codebook.copy_(torch.rand(target.vq.codebook.shape, generator=torch.Generator().manual_seed(2)))
    study = RegionStudy(ObjectiveConfig(convergence_tau=0.5), pixel_threshold=10.0)
    study.add(target, _repeating_batch())
    summary = study.summary()
    assert summary["positions"] == 15  # the last position has nothing later
    assert summary["convergent_share"] == pytest.approx(2 / 15)  # positions 0 and 1 recur, nothing else
    assert summary["candidates"]["hidden raw"]["auc"] == 1.0
    assert set(summary["candidates"]) == {f"{s} {c}" for s in ("hidden", "aux-low", "aux-mid", "aux-high")
                                         for c in ("raw", "centred")}  # fmt: skip
    assert summary["config"] == pytest.approx(
        {"source": "hidden raw", "tau": 0.5, "flagged_share": 2 / 15, "precision": 1.0, "recall": 1.0}
    )
    assert "precision 1.000, recall 1.000" in format_table(summary)
    low = RegionStudy(ObjectiveConfig(convergence_tau=0.99, convergence_source="aux-low"), pixel_threshold=10.0)
    low.add(target, _repeating_batch())
    assert low.summary()["config"]["flagged_share"] == 0.0  # random streams: nothing above 0.99
    with pytest.raises(ValueError, match="no batch"):
        RegionStudy(ObjectiveConfig()).summary()


def test_a_real_config_builds_through_the_fit_config_check_with_one_target():
    """The study builds system and DataModule as `training/fit.py` does (`check_config`), so both carry the config's
    `target_options` and resolve to one shared target; nothing loads here (the target loads in setup)."""
    args = parse_args(["--config", "eagle3_janus", "--train-dir", "/nowhere/shards", "--convergence-source", "aux-low",
                       "--convergence-tau", "0.8"])  # fmt: skip
    system, datamodule = build_study(args)
    assert system.target_options == datamodule.target_options == {"dtype": "bfloat16"}
    assert system.target_name == datamodule.target_name == "janus-pro-7b"
    assert system.target_placement() == target_device(datamodule.target_options, datamodule.target_placement())
    assert (system.objective.convergence_source, system.objective.convergence_tau) == ("aux-low", 0.8)
    assert system.vocab_dir == datamodule.config.train_dir == "/nowhere/shards"  # fit.py's link
    assert (datamodule.config.num_val_shards, datamodule.config.load_uncond) == (0, False)  # every shard, cond rows
