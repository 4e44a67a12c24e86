"""Fit a static draft tree to a drafter: measure how often each path of a large candidate tree is accepted,
then keep the best N drafts.

    python -m inference.tree_fit --target toy --drafter runs/demo/version_0/drafter \\
        --num-prompts 256 --prompt-seed 11 --drafts 6,8,10,14,20,25 --out outputs/tree_fit

A node's acceptance frequency is the share of verification steps whose accepted path runs through it. With
the lossless `exact` rule it does not depend on the rest of the tree, as long as the tree holds the node's
ancestors and its earlier siblings: a child is tried only after its earlier siblings were rejected (docs/method.md,
section "Tree verification"), a node's c-th draw is the same draw however many its parent makes (Gumbel top-k), and the
drafter reads only a node's ancestors. So one decode with the candidate tree gives the tau of every such sub-tree, 1 +
the sum of its nodes' frequencies, and the best sub-tree of N drafts takes the most frequent nodes that keep it closed
under parents and earlier siblings (`fit_static_tree`: exact when frequencies fall from a node to its children and later
siblings, as measured ones do; a greedy choice otherwise).

Which N is fastest depends on the hardware: a node costs tree-forward arithmetic, a level costs a drafter call.
Time the written trees side by side with `python -m inference.bench --static-tree FILE.json` (docs/decoding.md,
"Fitting the static tree").

Shapes: none here beyond the decoder's; paths are tuples of child indices, (c1, c2) the c2-th draw of the
c1-th draw of the root.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from inference.decoding.drafter import Drafter
from inference.decoding.rules import Rule
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative
from inference.decoding.tree import StaticTreeSpec, Tree
from inference.decoding.verify import TargetView, Verdict
from models.target import ImageTarget
from models.worlds import caption_world

TreePath = tuple[int, ...]  # child indices from the root: (c1, c2) is the c2-th draw of the c1-th draw


def candidate_paths(depth: int, budget: int) -> tuple[TreePath, ...]:
    """Every path of at most `depth` draws whose child indices sum to at most `budget`: depth 7, budget 3 gives
    329 drafts (a chain of first draws 7 deep, and every path that strays from it by up to 3 ranks)."""
    if depth < 1 or budget < 0:
        raise ValueError(f"a candidate tree needs depth >= 1 and budget >= 0, got depth {depth}, budget {budget}")
    return tuple(
        path
        for length in range(1, depth + 1)
        for path in itertools.product(range(budget + 1), repeat=length)
        if sum(path) <= budget
    )


class PathAcceptance(DecodeHooks):
    """Counts, per path of a static tree, the verification steps whose accepted path passes through it."""

    def __init__(self, spec: StaticTreeSpec) -> None:
        self.spec = spec
        self.counts: collections.Counter[TreePath] = collections.Counter()
        self.steps = 0

    def on_verify(self, tree: Tree, view: TargetView, verdict: Verdict) -> None:
        for last in verdict.last_node.tolist():  # one host read per step: a measurement, not a decode
            self.steps += 1
            node = last
            while node > 0:
                self.counts[self.spec.order[node]] += 1
                node = self.spec.parents[node]

    def frequencies(self) -> dict[TreePath, float]:
        """Every candidate path's share of steps (0.0 for a path never accepted)."""
        return {path: self.counts[path] / max(self.steps, 1) for path in self.spec.order[1:]}


def measure_path_acceptance(
    target: ImageTarget,
    drafter: Drafter,
    prompts: list[str],
    rule: Rule,
    candidate: Iterable[TreePath],
    seed: int = 0,
) -> tuple[dict[TreePath, float], int]:
    """Decode each prompt alone with the candidate tree -> ({path: acceptance frequency}, verification steps)."""
    spec = StaticTreeSpec(tuple(candidate))
    counter = PathAcceptance(spec)
    config = DecoderConfig(tree="static", static_tree=spec.paths)
    for i, prompt in enumerate(tqdm(prompts, desc="decoding with the candidate tree", leave=False)):
        generator = torch.Generator(device=target.device).manual_seed(seed + i)
        generate_speculative(target, drafter, [prompt], rule, config, generator=generator, hooks=counter)
    return counter.frequencies(), counter.steps


def fit_static_tree(
    frequencies: dict[TreePath, float], drafts: int, max_depth: int | None = None
) -> tuple[tuple[TreePath, ...], float]:
    """The `drafts` paths (at most `max_depth` draws deep) with the largest summed frequency among sub-trees that
    hold every path's parent and earlier siblings -> (paths parents-first, expected tau = 1 + their sum)."""
    if drafts < 1:
        raise ValueError(f"a tree needs at least 1 draft, got {drafts}")
    usable = {p: f for p, f in frequencies.items() if max_depth is None or len(p) <= max_depth}
    chosen: set[TreePath] = {()}
    for _ in range(drafts):
        frontier = [p for p in usable if p not in chosen and p[:-1] in chosen
                    and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in chosen)]  # fmt: skip
        if not frontier:
            raise ValueError(f"the candidate tree has fewer than {drafts} drafts within depth {max_depth}")
        chosen.add(max(frontier, key=lambda p: (usable[p], -len(p), [-c for c in p])))
    paths = tuple(sorted(chosen - {()}, key=lambda p: (len(p), p)))
    return paths, 1.0 + sum(usable[p] for p in paths)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inference.tree_fit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="toy", help="registered target (default toy)")
    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder (config.json + model.safetensors)")
    parser.add_argument("--prompts", type=Path, help="one prompt per line (default: held-out captions of an "
                        "embedded world (toy, texture): the target's own, else the toy's)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=256, help="prompts decoded (default 256)")
    parser.add_argument("--prompt-seed", type=int, default=11,
                        help="the embedded world's captions' seed: fit on tune captions (11)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="decode seed of the first prompt (then +1 per prompt)")
    parser.add_argument("--rule", default="exact", help="verification rule while measuring (default exact: "
                        "only a lossless rule's frequencies add up exactly over sub-trees)")  # fmt: skip
    parser.add_argument("--candidate-depth", type=int, default=7, help="draws per path of the candidate tree (7)")
    parser.add_argument("--candidate-budget", type=int, default=3, help="most summed child indices per path (3)")
    parser.add_argument("--drafts", default="6,8,10,14,20,25", help="comma-separated draft counts to fit")
    parser.add_argument("--max-depth", type=int, help="deepest level of the fitted trees (default: the candidate's)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, help="folder for drafts<N>.json (one tree each) and acceptance.json")
    parser.add_argument("--overwrite", action="store_true", help="replace files already in --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from inference.decoding.files import write_json
    from inference.decoding.generate import build_rule, read_prompt_lines
    from models.registry import load_target_for_process

    try:
        draft_counts = [int(n) for n in args.drafts.split(",")]
        candidate = candidate_paths(args.candidate_depth, args.candidate_budget)
    except ValueError as error:
        raise SystemExit(f"--drafts {args.drafts!r} / candidate tree: {error}") from None
    if args.out is not None and not args.overwrite:
        existing = [p for p in [args.out / "acceptance.json", *(args.out / f"drafts{n}.json" for n in draft_counts)]
                    if p.exists()]  # fmt: skip
        if existing:
            raise SystemExit(f"{existing[0]} exists: pass --overwrite to replace it, or another --out")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target_for_process(args.target)
    if args.prompts:
        prompts = read_prompt_lines(args.prompts)[: args.num_prompts]
    else:  # the target's own embedded world, else the toy's
        prompts = caption_world(args.target).captions(args.num_prompts, args.prompt_seed, "heldout")
    from inference.decoding.eagle import EagleDrafter

    try:
        rule = build_rule(args.rule, target, {}, args.drafter)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    drafter = EagleDrafter.from_pretrained(args.drafter, target)
    frequencies, steps = measure_path_acceptance(target, drafter, prompts, rule, candidate, args.seed)
    measured_tau = 1.0 + sum(frequencies.values())
    provenance = {
        "command": ["python", "-m", "inference.tree_fit", *(sys.argv[1:] if argv is None else argv)],
        "target": args.target, "drafter": str(args.drafter), "rule": args.rule, "prompts": len(prompts),
        "prompt_source": str(args.prompts) if args.prompts else f"{caption_world(args.target).name} heldout, seed "
        f"{args.prompt_seed}",
        "verification_steps": steps, "candidate": {"depth": args.candidate_depth, "budget": args.candidate_budget,
                                                   "drafts": len(candidate), "tau": measured_tau},
    }  # fmt: skip
    print(f"candidate tree: {len(candidate)} drafts, depth {args.candidate_depth}, tau {measured_tau:.3f} over "
          f"{steps} verification steps of {len(prompts)} prompts ({args.rule})")  # fmt: skip
    print("| drafts | depth | expected tau | paths |\n|---|---|---|---|")
    fitted = []
    for count in draft_counts:
        try:
            paths, tau = fit_static_tree(frequencies, count, args.max_depth)
        except ValueError as error:
            raise SystemExit(f"--drafts {count}: {error}") from None
        depth = max(len(p) for p in paths)
        fitted.append({"drafts": count, "depth": depth, "expected_tau": tau, "paths": [list(p) for p in paths]})
        print(f"| {count} | {depth} | {tau:.3f} | {' '.join('-'.join(map(str, p)) for p in paths)} |")
    if args.out is not None:
        for record in fitted:
            write_json({**record, "fitted_on": provenance}, args.out / f"drafts{record['drafts']}.json")
        acceptance = {",".join(map(str, p)): f for p, f in sorted(frequencies.items(), key=lambda kv: -kv[1])}
        write_json({**provenance, "frequency": acceptance}, args.out / "acceptance.json")
        print(f"wrote {args.out}/drafts<N>.json; decode with --static-tree {args.out}/drafts<N>.json")
    return fitted


if __name__ == "__main__":
    main()
