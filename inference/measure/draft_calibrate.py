"""How hard an embedded world is to draft for: lossless tau on fitted static trees and the dynamic tree, and how
acceptance falls with depth.

`python -m inference.world_calibrate --drafter DIR` prints these next to the target's entropy. With the
lossless `exact` rule:

1. the path acceptance of a large candidate tree is measured on the tune captions (`inference.tree_fit`'s
   `measure_path_acceptance`), and static trees of each requested size are fitted to it (`fit_static_tree`,
   whose expected tau is exact for a lossless rule);
2. each fitted tree and the deterministic dynamic top-k tree (EAGLE-2) decode the report captions, a
   different caption set, and their measured tau is printed;
3. from the report decode of each fitted tree, the acceptance at depth d given that the walk reached depth
   d - 1: the share of verification steps that accept at least d drafts among those that accept at least
   d - 1. It falls with depth on real targets; a world whose drafts are as good deep as shallow is too easy.

Shapes: S verification steps, B prompts of a decode batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from inference.decoding.drafter import Drafter
from inference.decoding.rules import Rule
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.measure.tree_fit import TreePath, candidate_paths, fit_static_tree, measure_path_acceptance
from models.target import ImageTarget


@dataclass(frozen=True)
class TreeResult:
    """One tree's lossless decode of the report captions."""

    name: str  # "static 25" (a fitted tree of 25 drafts) or "dynamic top-10, depth 6, 60 nodes"
    drafts: int  # draft nodes, root excluded
    depth: int
    expected_tau: float | None  # from the tune captions' path acceptance (fitted static trees only)
    tau: float  # measured on the report captions
    steps: int  # verification steps measured
    depth_acceptance: tuple[float, ...]  # acceptance at depth 1, 2, ... given the walk reached the depth above
    paths: tuple[TreePath, ...] | None = None  # a fitted static tree's child-index paths (None: dynamic)


def depth_acceptance(accepted: Tensor, max_depth: int) -> tuple[float, ...]:
    """(S,) accepted drafts per verification step -> acceptance at depths 1..max_depth, each given the depth above.

    Depth d's figure is #(steps accepting >= d drafts) / #(steps accepting >= d - 1); NaN where no step got there.
    """
    reached = torch.stack([(accepted >= d).sum() for d in range(max_depth + 1)]).double()  # (max_depth + 1,)
    return tuple(float(x) for x in reached[1:] / reached[:-1])  # 0 / 0 = NaN: no step reached the depth above


def lossless_decode(
    target: ImageTarget,
    drafter: Drafter,
    prompts: Sequence[str],
    rule: Rule,
    config: DecoderConfig,
    seed: int,
    batch_size: int = 8,
    description: str = "decoding",
) -> Tensor:
    """Decode `prompts` in batches; returns the (S,) accepted drafts of every verification step of every prompt."""
    accepted: list[Tensor] = []
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, desc=description, leave=False):
        generator = torch.Generator(device=target.device).manual_seed(seed + start)
        batch = list(prompts[start : start + batch_size])
        generation = generate_speculative(target, drafter, batch, rule, config, generator=generator)
        steps = generation.accepted.flatten()  # (steps * B,), -1 once an image was complete
        accepted.append(steps[steps >= 0].cpu())
    return torch.cat(accepted)


def drafting_report(
    target: ImageTarget,
    drafter: Drafter,
    rule: Rule,
    tune_prompts: Sequence[str],
    report_prompts: Sequence[str],
    drafts: Sequence[int] = (25, 40, 60),
    candidate_depth: int = 7,
    candidate_budget: int = 3,
    dynamic: tuple[int, int, int] = (10, 6, 60),
    seed: int = 0,
) -> list[TreeResult]:
    """Fit static trees of `drafts` nodes on the tune captions, then decode the report captions with each and with
    the dynamic tree `dynamic` = (top_k, depth, total_tokens)."""
    candidate = candidate_paths(candidate_depth, candidate_budget)
    frequencies, _ = measure_path_acceptance(target, drafter, list(tune_prompts), rule, candidate, seed)
    results = []
    for count in drafts:
        paths: tuple[TreePath, ...]
        paths, expected = fit_static_tree(frequencies, count)
        depth = max(len(p) for p in paths)
        config = DecoderConfig(tree="static", static_tree=paths)
        accepted = lossless_decode(target, drafter, report_prompts, rule, config, seed, description=f"static {count}")
        results.append(TreeResult(f"static {count}", count, depth, expected, 1.0 + float(accepted.double().mean()),
                                  accepted.numel(), depth_acceptance(accepted, depth), paths))  # fmt: skip
    top_k, depth, total = dynamic
    config = DecoderConfig(tree="dynamic", top_k=top_k, depth=depth, total_tokens=total)
    accepted = lossless_decode(target, drafter, report_prompts, rule, config, seed, description="dynamic")
    name = f"dynamic top-{top_k}, depth {depth}, {total} nodes"
    results.append(TreeResult(name, total - 1, depth, None, 1.0 + float(accepted.double().mean()), accepted.numel(),
                              depth_acceptance(accepted, depth)))  # fmt: skip
    return results


def report_table(results: Sequence[TreeResult]) -> str:
    """The results as a Markdown table: tau (expected on the tune captions, measured on the report ones) and the
    acceptance by depth."""
    deepest = max(r.depth for r in results)
    header = ["tree", "drafts", "depth", "expected tau (tune)", "tau (report)", "steps"]
    header += [f"accept @{d}" for d in range(1, deepest + 1)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        expected = "" if r.expected_tau is None else f"{r.expected_tau:.3f}"
        by_depth = [f"{a:.3f}" if a == a else "" for a in r.depth_acceptance]  # NaN: no step reached the depth
        by_depth += [""] * (deepest - len(by_depth))
        cells = [r.name, str(r.drafts), str(r.depth), expected, f"{r.tau:.3f}", str(r.steps), *by_depth]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
