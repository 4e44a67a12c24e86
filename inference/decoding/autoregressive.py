"""Plain autoregressive image generation with a KV cache: the baseline every speed figure is measured against.

    result = generate_ar(target, prompts, generator=torch.Generator().manual_seed(0))

One target forward per image token (the prefill yields token 0), sampled through the same logits
chain as the tree decoder (`inference.decoding.sampling.processed_distribution`).

Shapes: B prompts, R rows (2B with CFG), G image tokens, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from inference.decoding.compiled import decoding_mode
from inference.decoding.sampling import draw_tokens, processed_distribution
from models.target import ImageTarget, SamplingDefaults


@dataclass
class Generation:
    """Tokens of B generated images and what producing them cost."""

    tokens: Tensor  # (B, G) int64
    target_forwards: int  # target calls, prefill included
    seconds: float
    mean_entropy: float  # nats, of the distribution each token was drawn from
    mean_top1: float  # probability of that distribution's most likely token


@decoding_mode
def generate_ar(
    target: ImageTarget,
    prompts: list[str],
    settings: SamplingDefaults | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> Generation:
    """Sample one image per prompt, token by token, with a KV cache.

    Args:
        target: the model.
        prompts: B prompts.
        settings: sampling settings; None means the target's defaults. CFG rows are added when
            `cfg_scale != 1`.
        generator: source of randomness (seeded by the caller).
        progress: show a progress bar over image tokens.
    """
    settings = settings or target.sampling
    cfg = settings.cfg_scale != 1.0
    started = time.perf_counter()
    num_tokens = target.geometry.num_tokens
    conditioning = target.condition(prompts, cfg=cfg)
    cache = target.allocate_cache(conditioning.rows, target.prefix_length + num_tokens)
    logits = target.prefill(conditioning, cache).logits[:, -1]  # (R, V): predicts image token 0
    tokens = torch.empty(len(prompts), num_tokens, dtype=torch.long, device=logits.device)
    entropy = torch.zeros((), device=logits.device)
    top1 = torch.zeros((), device=logits.device)
    for index in tqdm(range(num_tokens), desc="image tokens", disable=not progress, leave=False):
        predicted = torch.full((len(prompts),), index, device=logits.device)
        _, probabilities = processed_distribution(logits, settings, cfg, target, predicted, one_hot_greedy=True)
        entropy += -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1).mean()
        top1 += probabilities.max(-1).values.mean()
        tokens[:, index] = draw_tokens(probabilities, settings, generator)
        if index + 1 == num_tokens:
            break
        rows = tokens[:, index : index + 1].repeat(2 if cfg else 1, 1)  # (R, 1): the same token in both halves
        position = target.image_positions(torch.tensor([index], device=rows.device))
        logits = target.forward(rows, position, cache).logits[:, -1]
    return Generation(
        tokens=tokens,
        target_forwards=num_tokens,  # the prefill plus G - 1 single-token forwards
        seconds=time.perf_counter() - started,
        mean_entropy=float(entropy) / num_tokens,
        mean_top1=float(top1) / num_tokens,
    )
