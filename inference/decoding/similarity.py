"""Similarity and distribution measures of the CASCADE-family rules (docs/method.md, section "The similarity and its
representation").

Mean-centred cosine similarity of hidden states (and its unit vectors, whose dot products are the
cosines), the KL divergence between target distributions, and the mass above a token, which says whether it lies in
the target's nucleus: x is in the top set holding `mass` iff the tokens strictly more likely than x hold less.

Shapes: "..." any leading dims, D feature width, V vocabulary, K tokens asked about.
"""

from __future__ import annotations

import torch
from torch import Tensor


def centred_cosine(a: Tensor, b: Tensor) -> Tensor:
    """Mean-centred cosine similarity in fp32 of (..., D) against (..., D) -> (...) (docs/method.md, section "The
    similarity and its representation")."""
    a = a.float() - a.float().mean(-1, keepdim=True)
    b = b.float() - b.float().mean(-1, keepdim=True)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-8)


def centred_unit(features: Tensor) -> Tensor:
    """(..., D) features -> fp32, mean-centred over D and scaled to unit length (norm floored at 1e-8).

    Dot products of the results are the mean-centred cosines CASCADE thresholds (docs/method.md, section "The similarity
    and its representation").
    """
    feats = features.float()
    feats = feats - feats.mean(-1, keepdim=True)
    return feats / feats.norm(dim=-1, keepdim=True).clamp_min(1e-8)


def kl_divergence(p: Tensor, q: Tensor) -> Tensor:
    """KL(p || q) over the last dim, zero where p = 0."""
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log()), 0.0).sum(-1)


def mass_above(p: Tensor, tokens: Tensor) -> Tensor:
    """The mass of the tokens strictly more likely than each token: p (..., V), tokens (..., K) -> (..., K).

    One comparison per (token, vocabulary entry) instead of a sort of the vocabulary: 0.26 against
    0.68 ms for 26 nodes of 4096 tokens and 4 children each on this CPU.
    """
    p_tokens = p.gather(-1, tokens)  # (..., K)
    rows = p[..., None, :]  # (..., 1, V)
    return (rows * (rows > p_tokens[..., None])).sum(-1)  # (..., K); a product, not a where: no scalar tensor
