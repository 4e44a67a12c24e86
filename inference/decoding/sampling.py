"""Logits processing and sampling, in the order LlamaGen's sampler applies them.

    guided = combine_cfg(logits, scale)                # u + s (c - u) over [cond; uncond] rows
    token = sample_tokens(guided, settings, generator)  # / temperature -> top-k -> top-p -> multinomial

The same processing is applied to drafter logits in the tree decoder, so drafts are proposed
from the distribution the target samples from (`proposal_distribution`, which keeps exactly top-k
tokens and returns q on them as a `Proposal`). Randomness is explicit: every sampler takes a
`torch.Generator`.

Shapes: R rows = 2B with CFG ([cond; uncond] halves), B prompts, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from models.target import ImageTarget, SamplingDefaults


def combine_cfg(logits: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance over [cond; uncond] halves: (2B, ..., V) -> (B, ..., V) = u + s (c - u),
    as one `lerp` (one kernel instead of three; s = 1 gives c exactly)."""
    if logits.shape[0] % 2:
        raise ValueError(f"CFG needs an even number of rows ([cond; uncond] halves), got {logits.shape[0]}")
    cond, uncond = logits.chunk(2, dim=0)
    return torch.lerp(uncond, cond, scale)


def guided_logits(logits: Tensor, settings: SamplingDefaults, cfg: bool) -> Tensor:
    """Guided logits of the rows: CFG when the batch carries unconditional rows, else unchanged."""
    return combine_cfg(logits, settings.cfg_scale) if cfg else logits


def filter_logits(logits: Tensor, settings: SamplingDefaults) -> Tensor:
    """Temperature, then top-k, then top-p; removed tokens get -inf. Greedy (T = 0) keeps logits unscaled."""
    logits = _temperature(logits, settings)
    if settings.top_k is not None and settings.top_k < logits.shape[-1]:
        # unsorted: the k largest in any order, a quarter faster on CPU than sorting them
        values = logits.topk(settings.top_k, dim=-1, sorted=False).values
        logits = logits.masked_fill(logits < values.amin(-1, keepdim=True), float("-inf"))
    return _top_p(logits, settings)


def _temperature(logits: Tensor, settings: SamplingDefaults) -> Tensor:
    """Logits over the temperature; greedy (T = 0) and T = 1 leave them as they are (no op to pay for)."""
    return logits / settings.temperature if settings.temperature > 0 and settings.temperature != 1.0 else logits


def _top_p(logits: Tensor, settings: SamplingDefaults) -> Tensor:
    """-inf on the tokens past the top-p nucleus (the token that crosses top_p is kept). (..., V) -> (..., V)."""
    if settings.top_p is None or settings.top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= settings.top_p  # keep the token that crosses top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probabilities(logits: Tensor, settings: SamplingDefaults) -> Tensor:
    """The distribution a token is drawn from (one-hot at the argmax when greedy). (..., V) -> (..., V)."""
    if settings.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return filter_logits(logits, settings).softmax(-1)


def processed_distribution(
    logits: Tensor,
    settings: SamplingDefaults,
    cfg: bool,
    target: ImageTarget | None = None,
    token_index: Tensor | None = None,
    one_hot_greedy: bool = False,
    unfiltered: bool = False,
) -> tuple[Tensor, Tensor]:
    """The one logits chain of AR sampling, drafting and verification: (R, ..., V) -> guided (B, ..., V), probs.

    CFG over [cond; uncond] rows, then (given `target` and `token_index` (B, ...), the image index each
    position predicts) the target's layout rule `constrain_logits`, then in fp32 temperature, top-k,
    top-p and softmax. Greedy settings (temperature 0) keep the logits unscaled, so the distribution still
    ranks the tokens, or with `one_hot_greedy` put all mass on the argmax (what AR sampling draws from).
    `unfiltered` skips temperature, top-k and top-p: softmax(guided), what LANTERN's greedy verification reads.
    """
    guided = _guided(logits, settings, cfg, target, token_index)
    if one_hot_greedy:
        return guided, sampling_probabilities(guided, settings)
    if unfiltered:
        return guided, guided.softmax(-1)
    return guided, filter_logits(guided, settings).softmax(-1)


@dataclass(frozen=True)
class Proposal:
    """A drafter's processed distribution q (`proposal_distribution`).

    Under top-k, q lives on k tokens: `probs` (..., k) are their probabilities and `support` (..., k)
    their ids, so drawing and storing it costs k entries, not V. Without top-k, `probs` is q over the
    whole vocabulary (..., V) and `support` is None.
    """

    probs: Tensor  # (..., k) on the support, or (..., V)
    support: Tensor | None = None  # (..., k) int64 token ids, or None
    vocab_size: int | None = None  # V; needed with a support

    def __post_init__(self) -> None:
        if self.support is not None and self.vocab_size is None:
            raise ValueError("a Proposal with a support needs vocab_size, the size of the vocabulary it lives in")

    @property
    def size(self) -> int:
        """V, the vocabulary q is a distribution over."""
        return self.probs.shape[-1] if self.vocab_size is None else self.vocab_size

    def __getitem__(self, index: Any) -> Proposal:
        """The same entries of `probs` and `support` (an index over the leading dimensions)."""
        support = None if self.support is None else self.support[index]
        return Proposal(self.probs[index], support, self.vocab_size)

    def dense(self) -> Tensor:
        """q over the vocabulary, (..., V): zero outside the support."""
        if self.support is None:
            return self.probs
        return self.probs.new_zeros(*self.probs.shape[:-1], self.size).scatter_(-1, self.support, self.probs)

    def top(self, k: int) -> tuple[Tensor, Tensor]:
        """The k likeliest tokens, likeliest first: their probabilities and ids, (..., k) each. Under top-k
        the sort runs over the support's k' entries, not the vocabulary."""
        if self.support is None or self.support.shape[-1] < k:
            return self.dense().topk(k, dim=-1)
        probs, order = self.probs.topk(k, dim=-1)
        return probs, self.support.gather(-1, order)

    def largest(self, k: int) -> Tensor:
        """The k largest probabilities, descending, (..., k): `top` without the token ids."""
        if self.support is None or self.support.shape[-1] < k:
            return self.dense().topk(k, dim=-1).values
        return self.probs.topk(k, dim=-1).values

    def ranked(self, k: int) -> Tensor:
        """The k likeliest tokens, likeliest first (greedy drafting). -> (..., k) int64."""
        return self.top(k)[1]


def proposal_distribution(
    logits: Tensor,
    settings: SamplingDefaults,
    cfg: bool,
    target: ImageTarget | None = None,
    token_index: Tensor | None = None,
) -> Proposal:
    """The target's processing applied to drafter logits: (R, ..., V) -> q (B, ..., V) as a `Proposal`:
    under top-k its probabilities on the support (B, ..., k), the ids of the tokens q keeps.

    `processed_distribution`'s chain, except that the top-k keeps exactly k tokens (the target's filter
    keeps ties at the k-th logit too; `topk` breaks them), so q is zero outside the support, and q is
    only ever made dense where verification needs it. Greedy settings (temperature 0) keep the logits
    unscaled, so q still ranks the candidates.
    """
    guided = _guided(logits, settings, cfg, target, token_index)
    vocab_size = guided.shape[-1]
    if settings.top_k is None or settings.top_k >= vocab_size:
        return Proposal(filter_logits(guided, settings).softmax(-1), None, vocab_size)
    values, support = _temperature(guided, settings).topk(settings.top_k, dim=-1, sorted=False)  # (B, ..., k)
    return Proposal(_top_p(values, settings).softmax(-1), support, vocab_size)


def _guided(
    logits: Tensor, settings: SamplingDefaults, cfg: bool, target: ImageTarget | None, token_index: Tensor | None
) -> Tensor:
    """CFG, the target's layout rule when given, fp32: the first links of the chain."""
    guided = guided_logits(logits, settings, cfg)
    if target is not None and token_index is not None:
        guided = target.constrain_logits(guided, token_index)
    return guided.float()


def draw_tokens(probabilities: Tensor, settings: SamplingDefaults, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row from `sampling_probabilities` output (argmax when greedy). (B, V) -> (B,) int64."""
    if settings.temperature == 0:
        return probabilities.argmax(-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def sample_tokens(logits: Tensor, settings: SamplingDefaults, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row from processed logits. (B, V) -> (B,) int64."""
    return draw_tokens(sampling_probabilities(logits, settings), settings, generator)
