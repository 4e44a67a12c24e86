"""Drafter losses and metrics as pure functions (docs/method.md, section "Drafter objectives"; docs/method.md, section
"Convergence-region reweighting").

Every loss is a masked sum divided by the number of positions that count (the loss-mask sum,
clamped to at least 1, so a batch of padding rows only gives 0 rather than NaN). CASCADE's
convergence weights multiply the soft cross-entropy terms but not the denominator, so w = 2 doubles
the pull of convergent positions relative to the rest (as the CASCADE development code divides by the loss-mask sum:
docs/method.md, section "Convergence-region reweighting").

Shapes: B rows, L positions, V vocabulary, D feature width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.decoding.similarity import cosine


def masked_mean_denominator(mask: Tensor) -> Tensor:
    """The number of counted positions, at least 1: (B, L) bool -> () float."""
    return mask.sum().clamp_min(1).float()


def soft_cross_entropy(draft_logits: Tensor, target_probs: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """-sum_pos w_pos sum_v p_target(v) log q_draft(v) / #mask.

    Args:
        draft_logits: (B, L, V) drafter logits; target_probs: (B, L, V) the target's distribution.
        weights: (B, L) per-position weights (0 outside the mask); mask: (B, L) bool, the positions that count.
    """
    log_q = draft_logits.float().log_softmax(-1)
    per_position = -(target_probs.float() * log_q.clamp_min(torch.finfo(log_q.dtype).min)).sum(-1)  # (B, L)
    return (per_position * weights).sum() / masked_mean_denominator(mask)


def feature_regression_loss(predicted: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """EAGLE-1's smooth-L1 between predicted and target features, mean over D, averaged over the mask."""
    per_position = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)  # (B, L)
    return (per_position * mask).sum() / masked_mean_denominator(mask)


def later_pairs(mask: Tensor) -> Tensor:
    """(B, L) bool -> (B, L, L) bool: the pairs (t, u) with u > t and both positions counted."""
    length = mask.shape[1]
    later = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu(1)
    return later & mask[:, :, None] & mask[:, None, :]


def later_similarity(features: Tensor, mask: Tensor, centred: bool = False) -> Tensor:
    """(B, L): each position's largest cosine with a later counted position (-2, below any cosine, where none).

    features (B, L, D) are compared by `inference.decoding.similarity.cosine`: in float32 (float64 stays float64)
    whatever autocast is active; centred: the mean-centred cosine (each vector minus its own mean over D, as
    CASCADE's decoder compares states) instead of the raw one.
    """
    similarity = cosine(features, centred=centred, pairwise=True)  # (B, L, L)
    return similarity.masked_fill(~later_pairs(mask), -2.0).amax(-1)


def convergent_positions(features: Tensor, mask: Tensor, tau: float, centred: bool = False) -> Tensor:
    """CASCADE's convergence region: positions whose feature has cosine > tau with any LATER valid position.

    features (B, L, D), mask (B, L) bool -> (B, L) bool (False outside the mask). centred: see `later_similarity`.
    """
    return later_similarity(features, mask, centred) > tau


def convergence_weights(features: Tensor, mask: Tensor, tau: float, weight: float, centred: bool = False) -> Tensor:
    """Per-position soft-CE weights: mask x (1 + convergent x (weight - 1)). weight = 1 turns reweighting off."""
    if weight == 1.0:
        return mask.float()
    convergent = convergent_positions(features, mask, tau, centred)
    return mask.float() * (1.0 + convergent.float() * (weight - 1.0))


def step_weights(steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3's weights of the unrolled steps: decay**k for k = 0 .. steps - 1."""
    return [decay**k for k in range(steps)]


def uniform_feature_noise(
    features: Tensor, std: float, reference_length: int | None, generator: torch.Generator | None = None
) -> Tensor:
    """EAGLE-1's input-feature noise: features + (U[0, 1) - 0.5) x std, scaled by reference_length / L when set.

    EAGLE-1 scales by 512 / L (docs/method.md, section "EAGLE-1"); None keeps the amplitude independent of the sequence
    length.
    """
    if std == 0:
        return features
    scale = std * (reference_length / features.shape[1] if reference_length else 1.0)
    noise = torch.rand(features.shape, generator=generator, device=features.device) - 0.5
    return features + (noise * scale).to(features.dtype)


def simulated_acceptance_length(accuracies: list[Tensor] | Tensor) -> Tensor:
    """tau_sim = 1 + sum_k prod_{i <= k} acc_i: the mean accepted chain + the bonus token, for a greedy chain draft."""
    acc = torch.stack(list(accuracies)) if isinstance(accuracies, list) else accuracies
    return 1.0 + acc.float().cumprod(0).sum()


def shift_left(x: Tensor, shift: int, fill: float | bool = 0) -> Tensor:
    """x[:, shift:] padded at the end with `fill` to the same length along dim 1."""
    if shift == 0:
        return x
    pad = x.new_full((x.shape[0], shift, *x.shape[2:]), fill)
    return torch.cat([x[:, shift:], pad], dim=1)
