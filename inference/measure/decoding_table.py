"""The decoding table (docs/results.md) and tau-vs-quality plot, from one command, on every tree kind.

    python -m inference.decoding_table --target toy --drafter runs/demo/version_0/drafter \\
        --grid configs/decoding_table.json --trees static,dynamic --num-prompts 256 \\
        --prompt-seed 2026 --tuned-on 11 --threads 2 --out outputs/decoding_table

For each tree kind (`--trees`: the decoder's default static tree, the deterministic EAGLE-2 tree,
the sampled one), AR and every rule of the grid at its swept settings are decoded interleaved in one
run (`inference.measure.bench.run_methods`), on captions drawn with `--prompt-seed`. The settings were chosen
on the captions of `--tuned-on`, a different seed, which the table prints next to it; the command
refuses to report on the seed it was tuned on. It writes, into `--out`:

- `table.md`: per tree, the command, the seeds, and one row per method: settings, tau, target forwards
  per image, s/image, speedup against the same run's AR, prompt fidelity, FID-style distance to AR;
- `tau_quality.png`: tau against prompt fidelity and against the FID-style distance, one series per
  (rule, tree), with the Pareto front;
- `table.json`: every record, the command and the seeds.

The grid is a JSON list of {"series", "rule", "options"} (as `inference.bench --sweep-grid`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

from inference.decoding.files import write_atomic, write_json
from inference.decoding.speculative import TREE_KINDS, DecoderConfig
from inference.measure.bench import build_rules, run_methods, summarise
from inference.measure.methods import load_grid, parse_methods, sweep_methods
from inference.measure.provenance import provenance
from inference.measure.report import Quality, format_markdown, plot_sweep
from inference.measure.step_latency import tree_name
from models.registry import load_target_for_process
from models.worlds import caption_world


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="toy", help="target name (default: toy; an embedded world (toy, "
                        "texture) is scored, other targets draw toy captions and get no quality columns)")  # fmt: skip
    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder")
    parser.add_argument("--grid", type=Path, required=True, help="JSON grid [{series, rule, options}]")
    parser.add_argument("--trees", default="static,dynamic", help="comma-separated tree kinds (default static,dynamic)")
    parser.add_argument("--num-prompts", type=int, default=256,
                        help="held-out captions of the target's embedded world (toy, texture; 256)")  # fmt: skip
    parser.add_argument("--prompt-seed", type=int, default=2026, help="seed of the report captions (default 2026)")
    parser.add_argument("--tuned-on", type=int, default=11, help="seed of the captions the grid was tuned on (11)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of caption i is seed + i")
    parser.add_argument("--repeats", type=int, default=1, help="decodes per (caption, method); time = their median")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--static-tree", help="the static tree: a name (models' trees) or a JSON file of paths, such "
                        "as `inference.tree_fit` writes (default: the target's default_static_tree)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="folder for table.md, table.json, tau_quality.png")
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    unknown = [t for t in trees if t not in TREE_KINDS]
    if unknown or not trees:
        raise SystemExit(f"--trees: unknown tree kind(s) {unknown or args.trees!r}; accepted: {', '.join(TREE_KINDS)}")
    if args.prompt_seed == args.tuned_on:
        raise SystemExit(f"--prompt-seed {args.prompt_seed} is the seed the grid was tuned on: report on another one")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.static_tree is not None:
        if "static" not in trees:
            raise SystemExit(f"--static-tree {args.static_tree} is a static tree, but --trees {args.trees} has none")
        try:  # an unknown name, a bad file or a tree with a hole fails here, before any decode
            DecoderConfig(tree="static", static_tree=args.static_tree)
        except (ValueError, OSError) as error:
            raise SystemExit(f"--static-tree {args.static_tree}: {error}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        methods = sweep_methods(load_grid(args.grid), parse_methods("ar", None))
    except (ValueError, KeyError, OSError) as error:
        raise SystemExit(f"--grid {args.grid}: {error}") from None
    target = load_target_for_process(args.target)
    from inference.decoding.eagle import EagleDrafter

    try:
        rules = build_rules(methods, target, args.drafter)
    except ValueError as error:
        raise SystemExit(f"--grid {args.grid}: {error}") from None
    drafter = EagleDrafter.from_pretrained(args.drafter, target)
    world = caption_world(args.target)  # the target's own embedded world, else the toy's
    prompts = world.captions(args.num_prompts, args.prompt_seed, "heldout")
    quality = Quality.for_target(target)
    command = ["python", "-m", "inference.decoding_table", *(sys.argv[1:] if argv is None else argv)]
    records: list[dict[str, Any]] = []
    sections, summaries = [], []
    for kind in trees:
        static_tree = args.static_tree if kind == "static" else None
        config = dataclasses.replace(DecoderConfig(), tree=kind, static_tree=static_tree).for_target(target)
        started = time.perf_counter()
        tallies, floor = run_methods(methods, rules, prompts, target, drafter, target.sampling, config, args.seed,
                                     repeats=args.repeats)  # fmt: skip
        tree_records = summarise(methods, rules, tallies, floor, prompts, quality)
        summary = {
            "tree": dataclasses.asdict(config),
            "num_prompts": len(prompts),
            "prompt_source": f"{world.name} heldout, seed {args.prompt_seed}; settings tuned on seed {args.tuned_on}",
            "seed": args.seed,
            "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - started,
        }
        summaries.append(summary)
        sections.append(f"### Tree {tree_name(config)}\n\n" + format_markdown(tree_records, command, summary))
        for r in tree_records:
            records.append({**r, "tree": kind, "series": f"{r['series']} ({kind})" if r["rule"] != "ar" else "ar"})
        print(sections[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    plot = args.out / "tau_quality.png"
    ar_first = [r for r in records if r["rule"] == "ar"][:1] + [r for r in records if r["rule"] != "ar"]
    title = (f"{args.target}, drafter {args.drafter}, {len(prompts)} captions (seed {args.prompt_seed}; "
             f"tuned on seed {args.tuned_on}), trees {', '.join(trees)}")  # fmt: skip
    plot_sweep(ar_first, plot, title)
    write_atomic(args.out / "table.md", "\n".join(sections))
    write_json({"command": command, "provenance": provenance(), "drafter": str(args.drafter),
                "prompt_seed": args.prompt_seed, "tuned_on": args.tuned_on,
                "trees": summaries, "records": records}, args.out / "table.json")  # fmt: skip
    print(f"wrote {args.out / 'table.md'}, {args.out / 'table.json'} and {plot}")
    return records


if __name__ == "__main__":
    main()
