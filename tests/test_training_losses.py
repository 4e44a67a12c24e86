"""Drafter losses and metrics against hand-computed values, and the objective over a real batch."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny_toy_target

from inference.decoding.similarity import cosine
from models.eagle import EagleDraftModel, drafter_preset
from training.losses import (
    convergence_weights,
    convergent_positions,
    feature_regression_loss,
    later_similarity,
    simulated_acceptance_length,
    soft_cross_entropy,
    step_weights,
    uniform_feature_noise,
)
from training.objective import ObjectiveConfig, drafter_objective


def test_soft_cross_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0]]])  # q = (1/4, 3/4) at position 0
    target = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    mask = torch.tensor([[True, False]])
    expected = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))  # 0.83698...
    assert soft_cross_entropy(logits, target, mask.float(), mask).item() == pytest.approx(expected, rel=1e-6)
    weights = torch.tensor([[2.0, 0.0]])  # a convergent position counts twice, the denominator stays #mask
    assert soft_cross_entropy(logits, target, weights, mask).item() == pytest.approx(2 * expected, rel=1e-6)
    empty = torch.zeros(1, 2, dtype=torch.bool)
    assert soft_cross_entropy(logits, target, empty.float(), empty).item() == 0.0  # padding only: 0, not NaN


def test_feature_regression_by_hand():
    predicted = torch.zeros(1, 2, 2)
    target = torch.tensor([[[0.5, 2.0], [9.0, 9.0]]])
    mask = torch.tensor([[True, False]])
    # smooth-L1 (beta 1): 0.5 * 0.5^2 = 0.125 and 2 - 0.5 = 1.5; mean over features 0.8125
    assert feature_regression_loss(predicted, target, mask).item() == pytest.approx(0.8125)


def test_convergence_marks_positions_similar_to_a_later_one():
    features = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.0, -1.0]]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    # cos(p0, p2) = 0.995 > 0.625; p1 and p3 are orthogonal/opposite to what follows; p3 has nothing later
    assert convergent_positions(features, mask, 0.625).tolist() == [[True, False, False, False]]
    assert convergence_weights(features, mask, 0.625, 2.0).tolist() == [[2.0, 1.0, 1.0, 1.0]]
    assert convergence_weights(features, mask, 0.625, 1.0).tolist() == [[1.0, 1.0, 1.0, 1.0]]  # w = 1: off
    assert convergent_positions(features, mask, 0.999).tolist() == [[False, False, False, False]]
    mask[0, 2] = False  # the only later match is padding
    assert convergence_weights(features, mask, 0.625, 2.0).tolist() == [[1.0, 1.0, 0.0, 1.0]]
    # only LATER positions count: the same pair seen from p2 does not mark p2
    reversed_features = features.flip(1)
    assert convergent_positions(reversed_features, torch.ones(1, 4, dtype=torch.bool), 0.625).tolist() == [
        [False, True, False, False]
    ]


def test_acceptance_length_and_step_weights():
    assert simulated_acceptance_length([torch.tensor(0.5), torch.tensor(0.5)]).item() == pytest.approx(1.75)
    assert simulated_acceptance_length([torch.tensor(1.0)] * 3).item() == pytest.approx(4.0)
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])


def test_feature_noise_is_bounded_uniform():
    features = torch.zeros(2, 64, 8)
    generator = torch.Generator().manual_seed(0)
    noisy = uniform_feature_noise(features, 0.2, None, generator)
    assert noisy.abs().max() <= 0.1 and noisy.std() > 0.05
    scaled = uniform_feature_noise(features, 0.2, 512, torch.Generator().manual_seed(0))  # EAGLE-1: x 512 / L
    assert torch.allclose(scaled, noisy * 8)
    assert torch.equal(uniform_feature_noise(features, 0.0, None, generator), features)


def _batch(target, batch_size=3, length=16, uncond=True):
    generator = torch.Generator().manual_seed(0)
    d = target.hidden_size
    batch = {
        "tokens": torch.randint(0, target.image_vocab_size, (batch_size, length), generator=generator),
        "hidden": torch.randn(batch_size, length, d, generator=generator),
        "aux": torch.randn(batch_size, length, 3 * d, generator=generator),
        "loss_mask": torch.ones(batch_size, length, dtype=torch.bool),
        "keys": [str(i) for i in range(batch_size)],
    }
    batch["loss_mask"][-1, 10:] = False
    if uncond:
        batch["uncond_hidden"] = torch.randn(batch_size, length, d, generator=generator)
        batch["uncond_aux"] = torch.randn(batch_size, length, 3 * d, generator=generator)
    return batch


def test_ttt_loss_is_the_decayed_sum_of_step_losses():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    config = ObjectiveConfig(ttt_steps=3, convergence_weight=1.0)
    out = drafter_objective(model, target, _batch(target, uncond=False), config, training=True)
    assert len(out.ce) == 3 and len(out.accuracy) == 3
    expected = sum(0.8**k * ce for k, ce in enumerate(out.ce))
    assert out.loss.item() == pytest.approx(float(expected), rel=1e-5)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    evaluation = drafter_objective(
        model, target, _batch(target, uncond=False), ObjectiveConfig(ttt_steps=3, eval_steps=5), training=False
    )
    assert len(evaluation.accuracy) == 5  # evaluation unrolls max(ttt_steps, eval_steps)


def test_eagle1_objective_adds_the_feature_regression():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle1"))
    config = ObjectiveConfig(ttt_steps=1, ce_weight=0.1, feature_weight=1.0, noise_std=0.2, convergence_weight=1.0)
    out = drafter_objective(
        model, target, _batch(target), config, training=True, generator=torch.Generator().manual_seed(0)
    )
    assert out.loss.item() == pytest.approx(float(0.1 * out.ce[0] + out.feature[0]), rel=1e-5)


def test_reweighting_changes_only_the_soft_ce():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    batch = _batch(target, uncond=False)
    batch["hidden"][:, 8] = batch["hidden"][:, 3]  # position 3 recurs later: convergent
    plain = drafter_objective(
        model, target, batch, ObjectiveConfig(ttt_steps=1, convergence_weight=1.0), training=False
    )
    weighted = drafter_objective(
        model, target, batch, ObjectiveConfig(ttt_steps=1, convergence_weight=2.0), training=False
    )
    assert weighted.ce[0] > plain.ce[0]
    assert weighted.accuracy[0] == plain.accuracy[0]
    assert weighted.convergent_fraction > 0 and plain.convergent_fraction == 0


def slightly_different_pair(seed: int = 0, width: int = 256, scale: float = 0.05) -> torch.Tensor:
    """(2, D) two vectors whose cosine is about 0.9987: where bfloat16 (steps of 2^-8 near 1) rounds it off."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(width, generator=generator)
    return torch.stack([a, a + scale * torch.randn(width, generator=generator)])


def old_matmul_cosine(features: torch.Tensor, centred: bool) -> torch.Tensor:
    """The cosine as it was computed before the one helper: float32 unit vectors, then a matmul (autocast applies)."""
    states = features.float()
    states = states - states.mean(-1, keepdim=True) if centred else states
    unit = torch.nn.functional.normalize(states, dim=-1)
    return unit @ unit.transpose(-1, -2)


@pytest.mark.parametrize("centred", [False, True])
def test_cosine_is_float32_under_bf16_autocast_where_a_matmul_is_not(centred: bool):
    """Every cosine that decides a region or a relaxation goes through `cosine`: under bf16 autocast it still
    matches the float64 value to 1e-6, where the old matmul of unit vectors was rounded to bfloat16."""
    pair = slightly_different_pair()
    a, b = pair.double()
    if centred:
        a, b = a - a.mean(), b - b.mean()
    exact = float(a @ b / (a.norm() * b.norm()))
    assert 0.99 < exact < 0.9995
    with torch.autocast("cpu", torch.bfloat16):
        pairwise = cosine(pair[None], centred=centred, pairwise=True)  # (1, 2, 2)
        matched = cosine(pair[0], pair[1], centred=centred)
        old = old_matmul_cosine(pair[None], centred)
    assert pairwise.dtype == matched.dtype == torch.float32
    assert abs(float(pairwise[0, 0, 1]) - exact) < 1e-6 and abs(float(matched) - exact) < 1e-6
    assert abs(float(old[0, 0, 1]) - exact) > 1e-4  # the old computation fails the same check
    assert cosine(pair.double(), pairwise=True).dtype == torch.float64  # float64 stays float64


@pytest.mark.parametrize("centred", [False, True])
def test_the_convergence_region_under_bf16_autocast_is_the_float32_region(centred: bool):
    """later_similarity / convergent_positions (training's region) under bf16 autocast: cosines to 1e-6 of the
    float32 ones, so a threshold between the cosine and its bfloat16 rounding decides as in float32."""
    features = slightly_different_pair(seed=1)[None]  # (1, 2, D)
    mask = torch.ones(1, 2, dtype=torch.bool)
    reference = later_similarity(features, mask, centred)
    with torch.autocast("cpu", torch.bfloat16):
        similarity = later_similarity(features, mask, centred)
        rounded = float(old_matmul_cosine(features, centred)[0, 0, 1])
        tau = (float(reference[0, 0]) + rounded) / 2  # between the true cosine and the old bf16 one
        flagged = convergent_positions(features, mask, tau, centred)
    assert similarity.dtype == torch.float32
    assert abs(float(similarity[0, 0]) - float(reference[0, 0])) < 1e-6
    assert rounded != pytest.approx(float(reference[0, 0]), abs=1e-4)  # bf16 moved the old cosine
    assert flagged.tolist() == [[float(reference[0, 0]) > tau, False]]


def test_centred_convergence_ignores_a_shared_offset():
    # two states that share a large common offset: raw cosine 0.995, mean-centred cosine -1/3
    features = torch.tensor([[[10.0, 10.0, 11.0, 10.0], [10.0, 11.0, 10.0, 10.0]]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert convergent_positions(features, mask, 0.9).tolist() == [[True, False]]
    assert convergent_positions(features, mask, 0.9, centred=True).tolist() == [[False, False]]
    assert convergent_positions(features, mask, -0.3, centred=True).tolist() == [[False, False]]
    assert convergent_positions(features, mask, -0.34, centred=True).tolist() == [[True, False]]
    features[0, 1] = torch.tensor([20.0, 20.0, 22.0, 20.0])  # the same centred direction, another offset
    assert convergent_positions(features, mask, 0.99, centred=True).tolist() == [[True, False]]


@pytest.mark.parametrize("source, stream", [("aux-low", 0), ("aux-mid", 1), ("aux-high", 2)])
def test_convergence_source_reads_its_stream_on_both_branches(source, stream):
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    d = target.hidden_size
    batch = _batch(target, uncond=True)
    columns = slice(stream * d, (stream + 1) * d)
    batch["aux"][0, 8, columns] = batch["aux"][0, 3, columns]  # cond branch: position 3 recurs in this stream
    batch["uncond_aux"][1, 9, columns] = batch["uncond_aux"][1, 2, columns]  # uncond branch: position 2 recurs
    config = ObjectiveConfig(ttt_steps=1, convergence_weight=2.0, convergence_tau=0.99, convergence_source=source)
    out = drafter_objective(model, target, batch, config, training=False)
    hidden_config = ObjectiveConfig(ttt_steps=1, convergence_weight=2.0, convergence_tau=0.99)
    by_hidden = drafter_objective(model, target, batch, hidden_config, training=False)
    counted = int(out.tokens)
    assert by_hidden.convergent_fraction == 0  # random hidden states: nothing recurs
    assert out.convergent_fraction.item() == pytest.approx(1 / counted)  # the cond row's target 3 (from row 2)
    cfg = ObjectiveConfig(
        ttt_steps=1, convergence_weight=2.0, convergence_tau=0.99, convergence_source=source, cfg_loss_weight=1.0
    )
    plain = ObjectiveConfig(ttt_steps=1, convergence_weight=1.0, cfg_loss_weight=1.0, convergence_source=source)
    weighted, unweighted = (drafter_objective(model, target, batch, c, training=False) for c in (cfg, plain))
    assert weighted.cfg_ce[0] > unweighted.cfg_ce[0]  # both branches' recurrences reweight the guided loss
    other = "aux-high" if source != "aux-high" else "aux-low"
    elsewhere = ObjectiveConfig(ttt_steps=1, convergence_weight=2.0, convergence_tau=0.99, convergence_source=other)
    assert drafter_objective(model, target, batch, elsewhere, training=False).convergent_fraction == 0


def test_convergence_source_needs_the_streams_and_a_known_name():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle1"))
    batch = _batch(target, uncond=False)
    del batch["aux"]
    config = ObjectiveConfig(ttt_steps=1, convergence_source="aux-low")
    with pytest.raises(ValueError, match="data.load_aux: true"):
        drafter_objective(model, target, batch, config, training=False)
    off = ObjectiveConfig(ttt_steps=1, convergence_source="aux-low", convergence_weight=1.0)
    assert drafter_objective(model, target, batch, off, training=False).convergent_fraction == 0  # off: not read
    with pytest.raises(ValueError, match="convergence_source='last'"):
        ObjectiveConfig(convergence_source="last")


def test_cfg_loss_runs_both_branches_and_needs_unconditional_features():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    config = ObjectiveConfig(ttt_steps=2, cfg_loss_weight=1.0)
    out = drafter_objective(model, target, _batch(target), config, training=True)
    assert len(out.cfg_ce) == 2
    expected = sum(0.8**k * (ce + cfg) for k, (ce, cfg) in enumerate(zip(out.ce, out.cfg_ce, strict=True)))
    assert out.loss.item() == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="uncond_aux"):
        drafter_objective(model, target, _batch(target, uncond=False), config, training=True)


def test_a_batch_of_padding_only_gives_zero_loss():
    target = build_tiny_toy_target()
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    batch = _batch(target)
    batch["loss_mask"][:] = False
    out = drafter_objective(model, target, batch, ObjectiveConfig(ttt_steps=2, cfg_loss_weight=1.0), training=True)
    assert out.loss.item() == 0.0 and all(torch.isfinite(a) for a in out.accuracy)
    out.loss.backward()  # still differentiable: a short DDP rank must join the gradient all-reduce


def test_the_targets_layout_rule_shapes_the_training_targets(monkeypatch):
    """With a layout rule (token i % V forced at every third image index i), every soft-CE target, plain and
    CFG-combined, is that forced token at ruled positions and gives it no mass elsewhere; no NaN appears."""
    import training.objective as objective

    target = build_tiny_toy_target()
    vocab = target.image_vocab_size

    def every_third(logits, token_index):
        index = token_index.to(logits.device)[..., None]  # (R, L, 1)
        forced = index % vocab
        forbidden = torch.where(index % 3 == 0, torch.arange(vocab) != forced, torch.arange(vocab) == forced)
        return logits.masked_fill(forbidden, float("-inf"))

    monkeypatch.setattr(target, "constrain_logits", every_third)
    captured = []

    def recording_soft_ce(draft_logits, target_probs, weights, counted):
        captured.append(target_probs.detach())
        return soft_cross_entropy(draft_logits, target_probs, weights, counted)

    monkeypatch.setattr(objective, "soft_cross_entropy", recording_soft_ce)
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    config = ObjectiveConfig(ttt_steps=2, cfg_loss_weight=1.0, convergence_weight=1.0)
    out = drafter_objective(model, target, _batch(target), config, training=True)
    assert torch.isfinite(out.loss)
    assert len(captured) == 4  # per step: both branches' soft CE, then the CFG-combined one
    length = _batch(target)["tokens"].shape[1]
    for call, probs in enumerate(captured):
        step = call // 2
        index = (torch.arange(length) + step + 1).clamp_max(target.geometry.num_tokens - 1)
        forced_mass = probs.gather(-1, (index % vocab).expand(probs.shape[0], -1)[..., None])[..., 0]  # (R, L)
        ruled = index % 3 == 0
        assert torch.all(forced_mass[:, ruled] > 0.999) and torch.all(forced_mass[:, ~ruled] < 1e-3)
