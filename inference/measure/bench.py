"""Benchmark AR sampling and the tree decoder's verification rules on one prompt set: speed, tau and quality.

    python -m inference.bench --target toy --drafter outputs/drafters/demo \\
        --rules ar,exact,lantern,lantern++,gsd,gsd-blocks,cascade --num-prompts 32 --out bench.json
    python -m inference.bench --target toy --drafter outputs/drafters/demo --num-prompts 32 --sweep \\
        --out sweep.json --plot pareto.png

One table, one row per method:

- tau: accepted draft tokens + 1 per target verification forward (the +1 is the bonus/correction
  token every forward also yields), over all verification steps of all images (AR: 1);
- target and drafter forwards per image (target: the prefill, which yields token 0, included);
- wall seconds per image and the speedup over AR measured in the same run: every prompt is decoded
  by every method in turn, the order rotating from prompt to prompt, after one warm-up decode per
  method, so that machine load falls on all methods alike; images are decoded one at a time;
- prompt fidelity (the scene reader of the target's embedded world, toy or texture: every attribute read
  back from the pixels matches the caption; ± one binomial standard error) and the FID-style distance to
  the AR images of the same prompts (`models.toy.frechet_distance`, the reader's 256-d features). With N images
  and N < 256 the feature covariances are singular and the distance is biased upwards: compare rows
  of one run only; the AR row shows the distance between two independent AR draws, the noise floor;
- where the time of a step goes: the rule (`inference.decoding.verify.verify`), the target forward over the
  tree, drafting, and building the target view (CFG, softmax), in ms per verification step, and the
  rule's share of the step. The decode loop reports each phase to `DecodePhaseTimer` through its hooks
  (`inference.decoding.speculative.DecodeHooks`; nothing is wrapped or replaced); on CUDA each phase synchronises,
  which perturbs the timing a little.

`--sweep` decodes the prompts with a grid of rule settings instead (CASCADE's delta and thresholds,
LANTERN's delta, LANTERN++'s lambda, GSD's group size; `inference.measure.methods.SWEEP_GRID`, or
`--sweep-grid FILE.json`) and draws tau against fidelity and FID-style distance, one series per rule, into a PNG
(`--plot`).

`--random-weights` (with `--size real`, the default) builds the target's released architecture with
random weights and no download (`models.random_weights`), and a random drafter of its preset, and
measures a whole speculative step against an AR step: ms per AR step, tree forward, drafting, each
rule (`--rules`, default all) and bookkeeping, and the projected speedup tau x t(AR) / t(step) for
`--tau` (`inference.measure.step_latency`):

    python -m inference.bench --latency --target janus-pro-7b --random-weights --dtype bfloat16 --tau 3.5

`--latency` measures the same for a loaded target (`--target toy`, `--drafter` or a random one);
`--target-only` only the target's AR step against one forward over `--tree-nodes` nodes (`inference.measure.latency`).

Rule settings: `--rule-arg RULE.NAME=VALUE` (repeatable) sets a field of a rule's dataclass
(`inference.decoding.rules`), e.g. `cascade.delta=0.3`; a method may carry a label, `--rules cascade@wide`,
addressed as `cascade@wide.delta=1.0` (settings of `cascade.` apply to every cascade label).

Shapes: N prompts, G image tokens, H x W x 3 images.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from inference.decoding.autoregressive import generate_ar
from inference.decoding.compiled import add_compile_argument, compile_decoding
from inference.decoding.files import write_atomic, write_json
from inference.decoding.generate import (
    RULE_CLASSES,
    TAU_DEFINITION,
    add_decoder_arguments,
    build_rule,
    decoder_config,
    read_prompt_lines,
    rule_settings,
)
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative
from inference.decoding.verify import Rule, Verdict, verify
from inference.measure.cost import run_count_ops
from inference.measure.methods import SWEEP_GRID, Method, load_grid, parse_methods, sweep_methods
from inference.measure.provenance import provenance
from inference.measure.report import Quality, format_markdown, format_table, plot_sweep, sweep_title
from inference.measure.step_latency import add_latency_arguments, run_latency_command
from models.registry import load_target_for_process
from models.target import ImageTarget, SamplingDefaults
from models.worlds import caption_world

FID_NOTE = (
    "FID-style distance in the SceneReader's 256-d feature space to the AR images of the same prompts; "
    "with fewer images than feature dimensions the covariances are singular and the value is biased upwards, "
    "so compare rows of one run only; the AR row is the distance between two independent AR draws (noise floor)"
)
TIMING_NOTE = (
    "ms per verification step inside the decoder, timed with perf_counter through the decode loop's phase hooks: "
    "draft (drafter reads the path and drafts the tree), target (forward over the tree), view (CFG, softmax), "
    "verify (the rule), commit (KV commit, bookkeeping, the step's host read); AR: per generated token; "
    "verify_share = verify time / wall time per step"
)

DEFAULT_METHODS = "ar,exact,lantern,lantern++,gsd,gsd-blocks,cascade"


@dataclass
class Tally:
    """What decoding the prompts with one method produced and cost."""

    tokens: list[Tensor] = field(default_factory=list)  # N x (G,) int64
    steps: int = 0  # verification steps (AR: generated tokens after the first)
    tokens_per_step: float = 0.0  # sum over steps of (accepted drafts + 1)
    target_forwards: list[int] = field(default_factory=list)
    drafter_forwards: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    tv_charged: float = 0.0  # summed over steps
    timings: dict[str, float] = field(default_factory=dict)  # part -> seconds


class DecodePhaseTimer(DecodeHooks):
    """Seconds spent in each phase of the decode loop (draft, target, view, verify, commit), through the
    decoder's own hooks (`inference.decoding.speculative.DecodeHooks`); AR decodes count as "target" time."""

    def __init__(self, target: ImageTarget) -> None:
        self.seconds: dict[str, float] = {}
        cuda = target.device.type == "cuda"
        self._sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The seconds gathered since the last call, then zeroed."""
        taken, self.seconds = self.seconds, {}
        return taken


def build_rules(
    methods: Sequence[Method], target: ImageTarget, drafter_dir: Path | None = None
) -> dict[str, Rule | None]:
    """Each method's rule by label (None for AR); raises ValueError on a bad setting before any decoding.
    CASCADE reads the drafter folder's similarity calibration when there is one (`inference.decoding.calibrate`)."""
    return {m.label: None if m.rule == "ar" else build_rule(m.rule, target, m.options, drafter_dir) for m in methods}


def _decode_one(
    method: Method,
    rule: Rule | None,
    target: ImageTarget,
    drafter: Any,
    prompt: str,
    settings: SamplingDefaults,
    config: DecoderConfig,
    seed: int,
    timer: DecodePhaseTimer,
    verifier: Callable[..., Verdict] = verify,
) -> tuple[Tensor, dict[str, float]]:
    """One image: tokens (G,) and its costs; the time of each decode phase goes to `timer`."""
    generator = torch.Generator(device=target.device).manual_seed(seed)
    if rule is None:
        result = generate_ar(target, [prompt], settings, generator)
        timer.add("target", result.seconds)
        steps = result.target_forwards - 1
        return result.tokens[0], {"steps": steps, "plus_one": float(steps), "target": result.target_forwards,
                                  "drafter": 0, "seconds": result.seconds, "tv": 0.0}  # fmt: skip
    spec = generate_speculative(target, drafter, [prompt], rule, config, settings, generator, hooks=timer,
                                verifier=verifier)  # fmt: skip
    steps, plus_one = spec.tally(0)
    return spec.tokens[0], {
        "steps": steps,
        "plus_one": plus_one,
        "target": spec.target_forwards,
        "drafter": spec.drafter_forwards,
        "seconds": spec.seconds,
        "tv": spec.tv_charged * steps,
    }


def run_methods(
    methods: Sequence[Method],
    rules: dict[str, Rule | None],
    prompts: Sequence[str],
    target: ImageTarget,
    drafter: Any,
    settings: SamplingDefaults,
    config: DecoderConfig,
    seed: int = 0,
    warmup: bool = True,
    second_ar_draw: bool = True,
    progress: bool = True,
    verifier: Callable[..., Verdict] = verify,
    repeats: int = 1,
) -> tuple[dict[str, Tally], list[Tensor]]:
    """Decode every prompt with every method, interleaved (rotating order), and tally the results.

    With `repeats` > 1 every (prompt, method) is decoded that many times with the same seed, so the same
    tokens: an image's time is the median of its decodes, each phase's time their mean.

    Returns the tallies by label and, with `second_ar_draw`, a second AR draw per prompt (other seeds)
    for the FID noise floor.
    """
    if drafter is None and any(rule is not None for rule in rules.values()):
        raise ValueError("speculative rules need a drafter (--drafter)")
    tallies = {m.label: Tally() for m in methods}
    floor: list[Tensor] = []
    timer = DecodePhaseTimer(target)
    if warmup:  # first calls pay for allocations and lazy initialisation: keep them out of the table
        for m in methods:
            _decode_one(m, rules[m.label], target, drafter, prompts[0], settings, config, seed - 1, timer, verifier)
        timer.take()
    for i, prompt in enumerate(tqdm(prompts, desc="prompts", disable=not progress, file=sys.stderr)):
        shift = i % len(methods)
        for m in [*methods[shift:], *methods[:shift]]:
            decodes = [
                _decode_one(m, rules[m.label], target, drafter, prompt, settings, config, seed + i, timer, verifier)
                for _ in range(repeats)
            ]
            tokens, cost = decodes[0]
            if any(not torch.equal(again, tokens) for again, _ in decodes[1:]):
                raise RuntimeError(f"{m.label}: repeated decodes of prompt {i} (seed {seed + i}) drew other tokens")
            cost["seconds"] = float(np.median([more["seconds"] for _, more in decodes]))
            tally = tallies[m.label]
            tally.tokens.append(tokens.cpu())
            tally.steps += int(cost["steps"])
            tally.tokens_per_step += cost["plus_one"]
            tally.target_forwards.append(int(cost["target"]))
            tally.drafter_forwards.append(int(cost["drafter"]))
            tally.seconds.append(cost["seconds"])
            tally.tv_charged += cost["tv"]
            for part, spent in timer.take().items():
                tally.timings[part] = tally.timings.get(part, 0.0) + spent / repeats
        if second_ar_draw:
            generator = torch.Generator(device=target.device).manual_seed(1_000_003 + seed + i)
            floor.append(generate_ar(target, [prompt], settings, generator).tokens[0].cpu())
            timer.take()
    return tallies, floor


def summarise(
    methods: Sequence[Method],
    rules: dict[str, Rule | None],
    tallies: dict[str, Tally],
    floor: list[Tensor],
    prompts: Sequence[str],
    quality: Quality | None,
) -> list[dict[str, Any]]:
    """One JSON-ready record per method: tau, forwards, time, speedup, quality, time split per step."""
    ar = next((tallies[m.label] for m in methods if m.rule == "ar"), None)
    ar_seconds = float(np.mean(ar.seconds)) if ar else None
    images = {m.label: quality.images(tallies[m.label].tokens) for m in methods} if quality else {}
    reference = images.get(next((m.label for m in methods if m.rule == "ar"), ""), None)
    records = []
    for m in methods:
        tally = tallies[m.label]
        seconds = float(np.mean(tally.seconds))
        steps = max(tally.steps, 1)
        per_step = {part: 1000 * value / steps for part, value in sorted(tally.timings.items())}
        step_ms = 1000 * float(np.sum(tally.seconds)) / steps
        target_ms = per_step.get("target")
        fidelity, fidelity_se, fid = None, None, None
        if quality:
            fidelity, fidelity_se = quality.fidelity(images[m.label], prompts)
            if reference is not None and m.rule == "ar" and floor:
                fid = quality.distance(reference, quality.images(floor))
            elif reference is not None and m.rule != "ar":
                fid = quality.distance(reference, images[m.label])
        rule = rules[m.label]
        settings = {} if rule is None else {k: v for k, v in rule_settings(rule).items() if k != "rule"}
        records.append(
            {
                "label": m.label,
                "rule": m.rule,
                "series": m.series or m.label,
                "settings": settings,
                "tau": tally.tokens_per_step / steps,
                "verification_steps": tally.steps,
                "target_forwards_per_image": float(np.mean(tally.target_forwards)),
                "drafter_forwards_per_image": float(np.mean(tally.drafter_forwards)),
                "seconds_per_image": seconds,
                "seconds_per_image_median": float(np.median(tally.seconds)),
                "speedup_vs_ar": ar_seconds / seconds if ar_seconds else None,
                "fidelity": fidelity,
                "fidelity_se": fidelity_se,
                "fid_vs_ar": fid,
                "ms_per_step": {**per_step, "wall": step_ms},
                "verify_share": per_step["verify"] / step_ms if "verify" in per_step and step_ms else None,
                "verify_vs_target": per_step["verify"] / target_ms if "verify" in per_step and target_ms else None,
                "tv_charged_per_step": tally.tv_charged / steps,
            }
        )
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="toy", help="target name (default: toy)")
    add_decoder_arguments(parser)
    add_compile_argument(parser)
    parser.add_argument("--rules", help=f"comma-separated methods: ar and rules, optionally labelled RULE@LABEL "
                        f"(default {DEFAULT_METHODS}; --latency: every rule, {','.join(RULE_CLASSES)})")  # fmt: skip
    parser.add_argument("--rule-arg", action="append", metavar="RULE.NAME=VALUE", help="set a rule field")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="held-out prompts of an embedded world (toy, texture) (default 32)")  # fmt: skip
    parser.add_argument("--prompt-seed", type=int, default=5,
                        help="seed of the held-out draw of the target's embedded world (toy, texture)")  # fmt: skip
    parser.add_argument("--prompts", type=Path,
                        help="text file, one prompt per line (instead of an embedded world's (toy, texture) "
                        "prompts; other targets than the worlds draw the toy's)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    parser.add_argument("--cfg-scale", type=float, help="guidance scale (default: the target's)")
    parser.add_argument("--temperature", type=float, help="default: the target's")
    parser.add_argument("--top-k", type=int, help="default: the target's")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up decode per method")
    parser.add_argument("--repeats", type=int, default=1,
                        help="decode every (prompt, method) this many times (same seed, same tokens); an image's "
                        "time is the median (default 1)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="write the records as JSON here")
    parser.add_argument("--sweep", action="store_true", help="decode a grid of rule settings (see SWEEP_GRID)")
    parser.add_argument("--sweep-grid", type=Path, help="JSON grid [{series, rule, options}] instead of SWEEP_GRID")
    parser.add_argument("--markdown", type=Path, help="also write the table as markdown (as in docs/results.md)")
    parser.add_argument("--count-ops", action="store_true",
                        help="count aten ops and host syncs per speculative step, per phase, for every rule and "
                        "tree kind (--tree: only that one); decodes --num-prompts prompts")  # fmt: skip
    parser.add_argument("--plot", type=Path, help="sweep: Pareto plot PNG (default: next to --out, or pareto.png)")
    parser.add_argument("--replot", type=Path, help="only redraw the plot of a sweep JSON written by --out")
    add_latency_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot_sweep(saved["records"], args.plot or args.replot.with_suffix(".png"), sweep_title(saved))
        print(f"wrote the Pareto plot to {args.plot or args.replot.with_suffix('.png')}")
        return list(saved["records"])
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.latency or args.random_weights:
        try:
            timed = parse_methods(args.rules or ",".join(RULE_CLASSES), args.rule_arg)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        return [run_latency_command(args, argv, [(m.label, m.rule, m.options) for m in timed if m.rule != "ar"])]
    try:
        methods = parse_methods(args.rules or DEFAULT_METHODS, args.rule_arg)
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        if args.sweep:
            methods = sweep_methods(load_grid(args.sweep_grid) if args.sweep_grid else SWEEP_GRID, methods)
        config = decoder_config(args)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    target = load_target_for_process(args.target)
    config = config.for_target(target)
    overrides = {name: getattr(args, name) for name in ("cfg_scale", "temperature", "top_k")}
    settings = dataclasses.replace(target.sampling, **{k: v for k, v in overrides.items() if v is not None})
    if args.prompts:
        prompts = read_prompt_lines(args.prompts)[: args.num_prompts]
    else:  # the target's own embedded world, else the toy's
        prompts = caption_world(args.target).captions(args.num_prompts, args.prompt_seed, "heldout")
    drafter = None
    if args.drafter:
        from inference.decoding.eagle import EagleDrafter

        drafter = EagleDrafter.from_pretrained(args.drafter, target)
    try:
        rules = build_rules(methods, target, args.drafter)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.count_ops:
        return run_count_ops(args, target, drafter, methods, rules, prompts, settings, config)
    verifier = compile_decoding(target, drafter, args.compile) if args.compile else verify
    has_ar = any(m.rule == "ar" for m in methods)
    started = time.perf_counter()
    tallies, floor = run_methods(methods, rules, prompts, target, drafter, settings, config, args.seed,
                                 warmup=not args.no_warmup, second_ar_draw=has_ar, verifier=verifier,
                                 repeats=args.repeats)  # fmt: skip
    elapsed = time.perf_counter() - started
    quality = Quality.for_target(target)
    records = summarise(methods, rules, tallies, floor, prompts, quality)
    print(format_table(records))
    repeated = f", each decoded {args.repeats} times (time: the median)" if args.repeats > 1 else ""
    print(f"{len(prompts)} prompts{repeated}, {len(methods)} methods, {elapsed:.0f} s; {TAU_DEFINITION}.")
    print(f"FID vs AR: {FID_NOTE}. Speedup: mean s/img of AR over the method's, same interleaved run.")
    summary: dict[str, Any] = {
        "command": ["python", "-m", "inference.bench", *(sys.argv[1:] if argv is None else argv)],
        "target": args.target,
        "drafter": str(args.drafter) if args.drafter else None,
        "sampling": dataclasses.asdict(settings),
        "tree": dataclasses.asdict(config),
        "num_prompts": len(prompts),
        "prompts": list(prompts),
        "prompt_source": str(args.prompts)
        if args.prompts
        else f"{caption_world(args.target).name} heldout, seed {args.prompt_seed}",
        "seed": args.seed,
        "repeats": args.repeats,
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "seconds": elapsed,
        "provenance": provenance(),
        "tau_definition": TAU_DEFINITION,
        "fid_note": FID_NOTE,
        "timing_note": TIMING_NOTE,
        "records": records,
    }
    if args.out:
        write_json(summary, args.out)
    if args.markdown:
        write_atomic(args.markdown, format_markdown(records, summary["command"], summary))
        print(f"wrote {args.markdown}")
    if args.sweep:
        plot = args.plot or (args.out.with_suffix(".png") if args.out else Path("pareto.png"))
        plot_sweep(records, plot, sweep_title(summary))
        summary["plot"] = str(plot)
        print(f"wrote the Pareto plot to {plot}")
        if args.out:
            write_json(summary, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return records


if __name__ == "__main__":
    main()
