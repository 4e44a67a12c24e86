"""Target latency of one AR decoding step against one tree verification, on a target's own forward.

    target = random_target("janus-pro-7b", device="cuda")     # or any loaded ImageTarget
    report = measure_target_latency(target, tree_nodes=60)
    print(format_latency(report))

(`python -m inference.bench --latency --target-only`; the whole speculative step, drafting and the
rules included, is `inference.measure.step_latency`.)

This is the cost model of speculative decoding: a step of the tree decoder replaces `tau` AR steps
with one target forward over all tree nodes, so its wall-time speedup is at most
tau / (verify latency / AR latency) (drafting and the rule come on top). The measurement runs the
target's `prefill` and `forward` as the decoders call them ([cond; uncond] CFG rows, our KV cache,
a per-row tree attention mask, the EAGLE-3 auxiliary streams unless `aux=False`), at a fixed
context: the prompt plus `context_tokens` image tokens (default: half the image, the mean context
over a whole image).

- AR step: one new token per row over the context, `steps` times, each timed alone;
- tree verification: `tree_nodes` new tokens per row (the root, i.e. the last sampled token, and
  its drafts, laid out as a `branching`-ary tree, or as a given tree shape) with the tree attention
  mask and tree positions;
- after every timed forward the cache is truncated back to the context, so each one sees the same
  context; on CUDA every timed forward is bracketed by `torch.cuda.synchronize()`; the prefill is
  timed on its second run (the first one pays for lazy initialisation);
- reported: median and p90 ms of each, their ratio, the peak accelerator memory (CUDA) and the
  parameter count.

Shapes: R rows (2 per prompt with CFG), N tree nodes, X context image tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from inference.decoding.compiled import decoding_mode
from inference.decoding.tree import ancestor_mask
from models.target import ImageTarget

PROMPT = "a photo of a red fox in the snow"


@dataclass
class LatencyReport:
    """Median and p90 latencies (ms) of an AR step and of one tree verification at the same context."""

    target: str
    device: str
    dtype: str
    parameters: int
    prompts: int
    rows: int
    prefix_tokens: int
    context_tokens: int
    tree_nodes: int
    steps: int
    ar_ms: float
    ar_p90_ms: float
    verify_ms: float
    verify_p90_ms: float
    prefill_ms: float
    peak_memory_gib: float | None

    @property
    def ratio(self) -> float:
        """Verify latency over AR step latency: the tau a decoder needs just to break even on the target alone."""
        return self.verify_ms / self.ar_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verify_over_ar": self.ratio}


def synthetic_tree(num_nodes: int, branching: int) -> tuple[Tensor, Tensor]:
    """A `branching`-ary tree in breadth-first order: parents (N,) with parents[0] = -1, and depths (N,)."""
    if num_nodes < 1 or branching < 1:
        raise ValueError(f"a tree needs num_nodes >= 1 and branching >= 1, got {num_nodes} and {branching}")
    parents = torch.tensor([-1] + [(n - 1) // branching for n in range(1, num_nodes)])
    depths = torch.zeros(num_nodes, dtype=torch.long)
    for n in range(1, num_nodes):
        depths[n] = depths[parents[n]] + 1
    return parents, depths


def synchronized_clock(device: torch.device) -> float:
    """perf_counter seconds, read after the device has finished its queued work (CUDA: one synchronize)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: the forward must have finished before the clock is read
    return time.perf_counter()


def _percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `fraction` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


@decoding_mode
def measure_target_latency(
    target: ImageTarget,
    tree_nodes: int = 60,
    context_tokens: int | None = None,
    steps: int = 20,
    warmup: int = 3,
    prompts: int = 1,
    cfg: bool = True,
    branching: int = 4,
    seed: int = 0,
    aux: bool = True,
    tree: tuple[Tensor, Tensor] | None = None,
    inner_logits: bool = False,
) -> LatencyReport:
    """Time AR steps and `tree_nodes`-node verifications of `target` at one context (see the module docstring).

    Args:
        target: any target; its own `condition`, `prefill`, `forward` and cache are used.
        tree_nodes: N, nodes per verification forward (root included).
        context_tokens: X, image tokens already in the cache; None = half the image.
        steps: timed repetitions of each forward (after `warmup` untimed ones).
        prompts: images decoded together (R = 2 x prompts rows with CFG).
        cfg: include the unconditional rows.
        branching: fan-out of the synthetic tree (its shape barely matters: cost follows N and X).
        seed: seed of the random image tokens.
        aux: also return the EAGLE-3 auxiliary streams, as the decoder does for EAGLE-3 drafters.
        tree: (parents (N,), depths (N,)) of the tree to verify, parents[0] = -1, instead of the synthetic
            one; its N replaces `tree_nodes`.
        inner_logits: run the head only at the tree's nodes with children (`forward`'s `logits_at`), as the
            decoder does on static trees; else at every node.
    """
    if tree is not None:
        tree_nodes = int(tree[0].numel())
    image_tokens = target.geometry.num_tokens
    context = image_tokens // 2 if context_tokens is None else int(context_tokens)
    if not 0 <= context < image_tokens:
        raise ValueError(
            f"context_tokens must be in 0..{image_tokens - 1} (image tokens already decoded), got {context}"
        )
    if steps < 1 or warmup < 0 or tree_nodes < 1 or prompts < 1:
        raise ValueError(
            f"need steps >= 1, warmup >= 0, tree_nodes >= 1 and prompts >= 1; got {steps}, {warmup}, {tree_nodes}, "
            f"{prompts}"
        )
    device = target.device
    generator = torch.Generator().manual_seed(seed)
    conditioning = target.condition([PROMPT] * prompts, cfg=cfg)
    rows = conditioning.rows
    cache = target.allocate_cache(rows, target.prefix_length + context + max(tree_nodes, 1) + 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    target.prefill(conditioning, cache, return_aux=aux)  # untimed: the first forward initialises kernels
    cache.truncate(0)
    start = synchronized_clock(device)
    target.prefill(conditioning, cache, return_aux=aux)
    prefill_ms = (synchronized_clock(device) - start) * 1e3

    vocab = target.image_vocab_size

    def image_tokens_for(count: int) -> Tensor:
        """(R, count) random tokens, the same in a prompt's cond and uncond rows (as the decoders feed them)."""
        tokens = torch.randint(vocab, (prompts, count), generator=generator)
        return tokens.repeat(rows // prompts, 1).to(device)

    if context:
        positions = target.image_positions(torch.arange(context, device=device))
        target.forward(image_tokens_for(context), positions, cache)
    base = cache.length

    def timed(tokens: Tensor, positions: Tensor, mask: Tensor | None, logits_at: Tensor | None = None) -> list[float]:
        times = []
        for repeat in range(warmup + steps):
            begin = synchronized_clock(device)
            target.forward(tokens, positions, cache, tree_mask=mask, return_aux=aux, logits_at=logits_at)
            elapsed = synchronized_clock(device) - begin
            cache.truncate(base)
            if repeat >= warmup:
                times.append(elapsed * 1e3)
        return times

    ar_positions = target.image_positions(torch.tensor([context], device=device))
    ar_times = timed(image_tokens_for(1), ar_positions, None)

    parents, depths = synthetic_tree(tree_nodes, branching) if tree is None else tree
    mask = ancestor_mask(parents[None].expand(rows, -1), int(depths.max())).to(device)  # (R, N, N), per row
    tree_positions = target.image_positions((context + depths).clamp_max(image_tokens - 1).to(device))  # as the decoder
    inner = torch.unique(parents[parents >= 0]).to(device) if inner_logits else None  # (I,) nodes with children
    verify_times = timed(image_tokens_for(tree_nodes), tree_positions, mask, inner)

    weight = target.image_head_weight()
    modules = [module for module in vars(target).values() if isinstance(module, torch.nn.Module)]
    parameters = sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return LatencyReport(
        target=target.name, device=str(device), dtype=str(weight.dtype).removeprefix("torch."),
        parameters=parameters, prompts=prompts, rows=rows, prefix_tokens=target.prefix_length,
        context_tokens=context, tree_nodes=tree_nodes, steps=steps,
        ar_ms=statistics.median(ar_times), ar_p90_ms=_percentile(ar_times, 0.9),
        verify_ms=statistics.median(verify_times), verify_p90_ms=_percentile(verify_times, 0.9),
        prefill_ms=prefill_ms, peak_memory_gib=peak,
    )  # fmt: skip


def format_latency(report: LatencyReport) -> str:
    """A short human-readable table of one report."""
    peak = f"{report.peak_memory_gib:.1f} GiB" if report.peak_memory_gib is not None else "-"
    return "\n".join([
        f"target {report.target}: {report.parameters / 1e6:,.1f} M parameters, {report.dtype} on {report.device}, "
        f"peak memory {peak}",
        f"{report.prompts} prompt(s) = {report.rows} rows, context {report.prefix_tokens} prefix slots + "
        f"{report.context_tokens} image tokens, median of {report.steps} (p90 in brackets)",
        f"prefill                       {report.prefill_ms:9.2f} ms",
        f"AR step (1 token/row)         {report.ar_ms:9.2f} ms  ({report.ar_p90_ms:.2f})",
        f"tree verify ({report.tree_nodes} nodes/row)    {report.verify_ms:9.2f} ms  ({report.verify_p90_ms:.2f})",
        f"verify / AR                   {report.ratio:9.2f} x  (the tau needed to break even on target time)",
    ])  # fmt: skip
