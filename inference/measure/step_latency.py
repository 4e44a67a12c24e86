"""What one whole speculative step costs against one AR step, and the speedup that projects to.

    report = measure_step_latency(target, drafter, {"exact": ExactRule(), "cascade": CascadeRule()}, tau=3.5)
    print(format_step_latency(report))

    python -m inference.bench --latency --target janus-pro-7b --random-weights --dtype bfloat16 [--tau 3.5]

A step of the tree decoder replaces tau AR steps (tau: accepted drafts + 1 per target forward) with
drafting a tree, one target forward over it, the verification rule and bookkeeping, so its
projected speedup is

    tau x t(AR step) / t(speculative step),
    t(speculative step) = drafting + tree forward + target view + rule + bookkeeping.

- t(AR step) and the tree forward: `inference.measure.latency.measure_target_latency` at half an image of
  context (the mean over a whole image), the tree forward over the decoder's own tree (the static
  list's shape, with the head at its nodes with children where the decoder runs it so; a dynamic tree's node
  count), aux streams on for an EAGLE-3 drafter;
- drafting, target view (CFG, the target's logits chain), rule (`verify`) and bookkeeping (KV commit,
  token append, the step's one host read): the medians over `steps` speculative steps of the decode
  loop itself (`generate_speculative`), timed through its phase hooks ("draft", "view", "verify",
  "commit") by a `StepClock` after `warmup` untimed steps, one run per rule. These steps start at the
  beginning of an image (the loop cannot start mid-image); drafting and the rule barely depend on the
  context. The loop's own "target" phase is reported too (`target_in_loop_ms`, JSON only), at that
  early context.

On CUDA every timed region is bracketed by a synchronize (`synchronized_clock`). tau is not measured
(what random weights accept says nothing about a trained drafter): it comes from the command line
(default `DEFAULT_TAU`).
LANTERN's rules read the target's latent table (`ImageTarget.latent_table`; the random-weight targets' own
random VQ codebooks, at the real shapes); a target that exposes none gets a random stand-in (V x 8, VQ-16's
code width): their cost depends on its shape only. GSD reads the target's LM input embeddings, which every
target has.

Shapes: B prompts, R rows (2B with CFG), N tree nodes, V image vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inference.decoding.compiled import compile_decoding, decoding_mode
from inference.decoding.drafter import Drafter
from inference.decoding.rules import Rule
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative, inner_view_pays
from inference.decoding.tree import Tree
from inference.decoding.verify import TargetView, Verdict, verify
from inference.measure.latency import PROMPT, LatencyReport, format_latency, measure_target_latency, synthetic_tree
from inference.measure.latency import synchronized_clock as clock
from models.target import ImageTarget, SamplingDefaults

PHASES = ("draft", "target", "view", "verify", "commit")
"""The decode loop's phases (`inference.decoding.speculative.DecodeHooks`)."""
DEFAULT_TAU = 3.5
"""The tau of the projected speedup when none is given (the toy's static tree accepts about 4)."""
STAND_IN_CODE_WIDTH = 8
SPEC_STEP_DEFINITION = (
    "t(spec step) = drafting + tree forward + target view (CFG, softmax) + rule (verify) + bookkeeping "
    "(KV commit, token append, the step's host read)"
)
SPEEDUP_DEFINITION = "projected speedup = tau x t(AR step) / t(spec step)"


class EnoughSteps(Exception):
    """Raised by `StepClock` out of the decode loop once it has timed all the steps it was asked for."""


class StepClock(DecodeHooks):
    """Milliseconds of each phase of every decode step, through the loop's hooks; ends the decode after
    `warmup` + `steps` steps by raising `EnoughSteps` at the end of the step's "commit" phase."""

    def __init__(self, device: torch.device, steps: int, warmup: int) -> None:
        self.device, self.steps, self.warmup = device, steps, warmup
        self.ms: dict[str, list[float]] = {name: [] for name in PHASES}  # per timed step
        self.accepted: list[Tensor] = []  # (B,) accepted drafts of each timed step, left on the device
        self.completed = 0  # steps completed, warm-up ones included
        self._current: dict[str, float] = {}

    @property
    def timed(self) -> int:
        return max(0, self.completed - self.warmup)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begin = clock(self.device)
        yield
        self._current[name] = self._current.get(name, 0.0) + (clock(self.device) - begin) * 1e3
        if name != "commit":
            return
        if self.completed >= self.warmup:
            for part in PHASES:
                self.ms[part].append(self._current.get(part, 0.0))
        self._current = {}
        self.completed += 1
        if self.timed >= self.steps:
            raise EnoughSteps

    def on_verify(self, tree: Tree, view: TargetView, verdict: Verdict) -> None:
        if self.completed >= self.warmup:
            self.accepted.append(verdict.num_accepted.clone())  # outside every timed phase; no host read


@dataclass
class RuleLatency:
    """Median ms per speculative step of one rule's decode, its phases, and the tree forward it is charged."""

    rule: str
    steps: int
    draft_ms: float
    view_ms: float
    verify_ms: float
    commit_ms: float
    tree_forward_ms: float  # `measure_target_latency`'s verify forward, at half an image of context
    target_in_loop_ms: float  # the loop's own "target" phase, early in an image (not part of spec_step_ms)
    tau_random_weights: float  # accepted drafts + 1 per step seen here; random weights: says nothing

    @property
    def spec_step_ms(self) -> float:
        """t(speculative step): drafting + tree forward + target view + rule + bookkeeping."""
        return self.draft_ms + self.tree_forward_ms + self.view_ms + self.verify_ms + self.commit_ms

    def projected_speedup(self, tau: float, ar_ms: float) -> float:
        """tau x t(AR step) / t(speculative step)."""
        return tau * ar_ms / self.spec_step_ms


@dataclass
class StepLatencyReport:
    """The target's AR step and tree forward, and every rule's whole speculative step."""

    target: LatencyReport
    drafter: str
    drafter_parameters: int
    tree: DecoderConfig
    tau: float
    tau_given: bool
    warmup_steps: int
    rules: list[RuleLatency]
    peak_memory_gib: float | None  # CUDA: over both measurements

    def to_dict(self) -> dict[str, Any]:
        ar_ms = self.target.ar_ms
        return {
            **self.target.to_dict(),
            "peak_memory_gib": self.peak_memory_gib,
            "drafter": self.drafter,
            "drafter_parameters": self.drafter_parameters,
            "tree": dataclasses.asdict(self.tree),
            "tau": self.tau,
            "tau_default": not self.tau_given,
            "loop_warmup_steps": self.warmup_steps,
            "spec_step_definition": SPEC_STEP_DEFINITION,
            "speedup_definition": SPEEDUP_DEFINITION,
            "rules": [
                {
                    "rule": r.rule,
                    "steps": r.steps,
                    "ms": {
                        "draft": r.draft_ms,
                        "tree_forward": r.tree_forward_ms,
                        "view": r.view_ms,
                        "verify": r.verify_ms,
                        "commit": r.commit_ms,
                        "target_in_loop": r.target_in_loop_ms,
                    },
                    "spec_step_ms": r.spec_step_ms,
                    "projected_speedup": r.projected_speedup(self.tau, ar_ms),
                    "tau_random_weights": r.tau_random_weights,
                }
                for r in self.rules
            ],
        }


def decoder_tree_shape(config: DecoderConfig) -> tuple[Tensor, Tensor]:
    """(parents (N,), depths (N,)) of the decoder's tree: a static list's own, else a `top_k`-ary tree of its N
    nodes (a dynamic tree's shape changes every step; the forward's cost follows N)."""
    if config.tree == "static":
        return torch.tensor(config.spec.parents), torch.tensor(config.spec.depths)
    return synthetic_tree(config.num_nodes, config.top_k)


@decoding_mode
def time_decode_steps(
    target: ImageTarget,
    drafter: Drafter,
    rule: Rule,
    config: DecoderConfig,
    prompts: list[str],
    settings: SamplingDefaults,
    steps: int,
    warmup: int,
    seed: int = 0,
    verifier: Callable[..., Verdict] = verify,
) -> StepClock:
    """Run the decode loop on `prompts` under a `StepClock` until it has timed `steps` steps after `warmup`
    (starting a new decode, next seed, whenever an image completes first)."""
    timer = StepClock(target.device, steps, warmup)
    attempt = 0
    while timer.timed < steps:
        generator = torch.Generator(device=target.device).manual_seed(seed + attempt)
        with contextlib.suppress(EnoughSteps):
            generate_speculative(target, drafter, prompts, rule, config, settings, generator, hooks=timer,
                                 verifier=verifier)  # fmt: skip
        attempt += 1
    return timer


@decoding_mode
def measure_step_latency(
    target: ImageTarget,
    drafter: Drafter,
    rules: Mapping[str, Rule],
    config: DecoderConfig | None = None,
    settings: SamplingDefaults | None = None,
    tau: float | None = None,
    steps: int = 20,
    warmup: int = 3,
    prompts: int = 1,
    context_tokens: int | None = None,
    seed: int = 0,
    drafter_name: str = "",
    verifier: Callable[..., Verdict] = verify,
) -> StepLatencyReport:
    """Time `target`'s AR step and tree forward, then `steps` decode steps with each of `rules` (by label).

    Args:
        target, drafter: the pair decoded; the drafter's feature source decides the aux streams.
        rules: label -> rule; each gets its own decode run.
        config: the draft tree (default: the decoder's, the static tree the target names).
        settings: sampling settings (default: the target's); CFG rows follow its scale.
        tau: accepted drafts + 1 per target forward assumed by the projected speedup (None: `DEFAULT_TAU`).
        steps: timed repetitions of each forward and timed decode steps per rule.
        warmup: untimed repetitions before them (per forward kind, per rule).
        prompts: B, images decoded together.
        context_tokens: image tokens in the cache for the AR step and the tree forward (None: half the image).
        seed: of the random tokens and the decodes.
        drafter_name: how the report names the drafter.
        verifier: `inference.decoding.verify.verify` or its compiled form
            (`inference.decoding.compiled.compile_decoding`).
    """
    config, settings = (config or DecoderConfig()).for_target(target), settings or target.sampling
    if not rules:
        raise ValueError("measure_step_latency needs at least one rule")
    if tau is not None and tau < 1.0:
        raise ValueError(f"tau counts accepted drafts + 1 per target forward: it must be >= 1, got {tau}")
    if steps < 1 or warmup < 0 or prompts < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0 and prompts >= 1; got {steps}, {warmup}, {prompts}")
    cfg = settings.cfg_scale != 1.0
    inner_logits = config.tree == "static" and inner_view_pays(len(set(config.spec.parents[1:])), config.spec.num_nodes)
    base = measure_target_latency(target, context_tokens=context_tokens, steps=steps, warmup=warmup, prompts=prompts,
                                  cfg=cfg, seed=seed, aux=drafter.feature_source == "aux",
                                  tree=decoder_tree_shape(config), inner_logits=inner_logits)  # fmt: skip
    timings = []
    for label, rule in rules.items():
        timer = time_decode_steps(target, drafter, rule, config, [PROMPT] * prompts, settings, steps, warmup, seed,
                                  verifier)  # fmt: skip
        median = {name: statistics.median(values) for name, values in timer.ms.items()}
        accepted = torch.stack(timer.accepted).float()  # (steps, B)
        timings.append(
            RuleLatency(rule=label, steps=timer.timed, draft_ms=median["draft"], view_ms=median["view"],
                        verify_ms=median["verify"], commit_ms=median["commit"], tree_forward_ms=base.verify_ms,
                        target_in_loop_ms=median["target"], tau_random_weights=float(accepted.mean()) + 1.0)
        )  # fmt: skip
    cuda = target.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(target.device) / 2**30 if cuda else None
    model = getattr(drafter, "model", None)
    parameters = sum(p.numel() for p in model.parameters()) if isinstance(model, torch.nn.Module) else 0
    return StepLatencyReport(
        target=base, drafter=drafter_name or type(drafter).__name__, drafter_parameters=parameters, tree=config,
        tau=DEFAULT_TAU if tau is None else float(tau), tau_given=tau is not None, warmup_steps=warmup,
        rules=timings, peak_memory_gib=peak,
    )  # fmt: skip


def tree_name(config: DecoderConfig) -> str:
    """ "static mc_sim_7b_63 (26 nodes)", "dynamic 10/5/60 (60 nodes)": the tree as the report names it."""
    if config.tree == "static":
        shape = config.static_tree if isinstance(config.static_tree, str) else "custom"
    else:
        shape = f"{config.top_k}/{config.depth}/{config.total_tokens}"
    return f"{config.tree} {shape} ({config.num_nodes} nodes)"


def format_step_latency(report: StepLatencyReport) -> str:
    """The target's table (`format_latency`), then one line per rule: its phases, t(spec step), projected speedup."""
    ar_ms, tau = report.target.ar_ms, report.tau
    peak = f"{report.peak_memory_gib:.1f} GiB" if report.peak_memory_gib is not None else "-"
    speedup = f"speedup @ tau {tau:g}"
    header = (f"{'rule':<12} {'drafting':>9} {'tree fwd':>9} {'view':>8} {'rule':>8} {'bookkeep':>9} "
              f"{'spec step':>10} {speedup:>19}")  # fmt: skip
    lines = [
        format_latency(report.target),
        f"drafter {report.drafter} ({report.drafter_parameters / 1e6:,.2f} M parameters); "
        f"tree {tree_name(report.tree)}; peak memory over both measurements {peak}",
        f"speculative step, ms: median of {report.rules[0].steps} decode steps per rule (after "
        f"{report.warmup_steps} warm-up steps), timed through the decode loop's phase hooks",
        header,
        "-" * len(header),
    ]
    for r in report.rules:
        lines.append(
            f"{r.rule:<12} {r.draft_ms:9.2f} {r.tree_forward_ms:9.2f} {r.view_ms:8.2f} {r.verify_ms:8.2f} "
            f"{r.commit_ms:9.2f} {r.spec_step_ms:10.2f} {r.projected_speedup(tau, ar_ms):18.2f}x"
        )
    source = "given with --tau" if report.tau_given else "the default; set it with --tau"
    lines += [
        f"{SPEC_STEP_DEFINITION}; tree forward = the tree verify line above",
        f"{SPEEDUP_DEFINITION}, t(AR step) = {ar_ms:.2f} ms, tau = {tau:g} ({source}; not measured: what "
        "random weights accept says nothing about a trained drafter)",
    ]
    return "\n".join(lines)


def stand_in_latent_table(target: ImageTarget, seed: int = 0) -> Tensor | None:
    """None when `target` exposes its latent table (`latent_table()`); else a random (V, 8) one on its device."""
    try:
        target.latent_table()
        return None
    except NotImplementedError:
        pass
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(target.image_vocab_size, STAND_IN_CODE_WIDTH, generator=generator).to(target.device)


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--latency` argument group of `inference.bench`."""
    group = parser.add_argument_group(
        "latency", "time a whole speculative step against an AR step (inference.measure.step_latency; --target-only: "
        "the target's AR step against one tree forward, inference.measure.latency)",
    )  # fmt: skip
    group.add_argument("--latency", action="store_true", help="measure the latency of --target and stop")
    group.add_argument(
        "--random-weights",
        action="store_true",
        help="build --target's real architecture with random weights (no download); implies --latency",
    )
    group.add_argument("--size", choices=["real", "tiny"], default="real", help="--random-weights architecture size")
    group.add_argument("--dtype", help="target dtype (random weights: default bfloat16 on GPU, float32 on CPU)")
    group.add_argument("--device", help="target device (random weights: default this process's GPU, else CPU)")
    group.add_argument("--tau", type=float, help=f"tau of the projected speedup (default {DEFAULT_TAU})")
    group.add_argument(
        "--drafter-architecture",
        choices=["eagle3", "eagle1"],
        default="eagle3",
        help="the random drafter's architecture when no --drafter is given (default eagle3)",
    )
    group.add_argument("--target-only", action="store_true", help="only the target's AR step and tree forward")
    group.add_argument("--tree-nodes", type=int, help="--target-only: nodes per tree forward (default 60)")
    group.add_argument("--context-tokens", type=int, help="image tokens already decoded (default: half the image)")
    group.add_argument(
        "--latency-steps",
        type=int,
        default=20,
        help="timed forwards of each kind and timed decode steps per rule (default 20)",
    )
    group.add_argument("--latency-prompts", type=int, default=1, help="images decoded together (default 1)")
    group.add_argument("--no-aux", action="store_true", help="--target-only: skip the EAGLE-3 streams (EAGLE-1)")


def _build_target(args: argparse.Namespace) -> ImageTarget:
    if args.random_weights:
        from models.random_weights import random_target
        from models.transformers_decoder import process_device

        return random_target(args.target, args.size, args.dtype, args.device or process_device(), seed=args.seed)
    from models.registry import load_target_for_process

    placement = {name: getattr(args, name) for name in ("dtype", "device") if getattr(args, name) is not None}
    return load_target_for_process(args.target, **placement)


def _build_drafter(args: argparse.Namespace, target: ImageTarget) -> tuple[Drafter, str]:
    """--drafter's folder, or a random drafter of the target's preset (tiny for --size tiny)."""
    from inference.decoding.eagle import EagleDrafter

    if args.drafter:
        return EagleDrafter.from_pretrained(args.drafter, target), str(args.drafter)
    from models.random_weights import random_drafter_model

    preset = "tiny" if args.random_weights and args.size == "tiny" else args.target
    model = random_drafter_model(target, preset, args.drafter_architecture, seed=args.seed + 7)
    label = "EAGLE-3" if args.drafter_architecture == "eagle3" else "EAGLE-1"
    return EagleDrafter(model, target), f"{label} head of preset {preset}, random weights"


def run_latency_command(
    args: argparse.Namespace, argv: list[str] | None, rule_specs: Sequence[tuple[str, str, Mapping[str, object]]]
) -> dict[str, Any]:
    """`inference.bench --latency` / `--random-weights`: print the report and return it as JSON-ready data.

    `rule_specs`: (label, rule name, options) of the rules to time (bench's parsed `--rules`).
    """
    from inference.decoding.files import write_json
    from inference.decoding.generate import build_rule, decoder_config

    if args.tau is not None and args.tau < 1.0:
        raise SystemExit(f"--tau counts accepted drafts + 1 per target forward: it must be >= 1, got {args.tau}")
    if not args.target_only:
        given = [flag for flag, value in (("--tree-nodes", args.tree_nodes), ("--no-aux", args.no_aux)) if value]
        if given:
            raise SystemExit(
                f"{' and '.join(given)} shape(s) only --target-only; the speculative step uses the "
                "decoder's tree (--tree) and the drafter's feature source (--drafter-architecture)"
            )
    started = time.perf_counter()
    try:
        target = _build_target(args)
        built = time.perf_counter() - started
        summary: dict[str, Any]
        if args.target_only:
            if args.compile:
                compile_decoding(target, None, args.compile)
            report = measure_target_latency(
                target, tree_nodes=args.tree_nodes or 60, context_tokens=args.context_tokens,
                steps=args.latency_steps, prompts=args.latency_prompts, seed=args.seed, aux=not args.no_aux,
            )  # fmt: skip
            print(format_latency(report))
            summary = report.to_dict()
        else:
            config = decoder_config(args)
            drafter, drafter_name = _build_drafter(args, target)
            verifier = compile_decoding(target, drafter, args.compile) if args.compile else verify
            stand_in = stand_in_latent_table(target, args.seed)
            rules = {label: build_rule(name, target, options, args.drafter, stand_in)
                     for label, name, options in rule_specs}  # fmt: skip
            step_report = measure_step_latency(target, drafter, rules, config, tau=args.tau, steps=args.latency_steps,
                                               prompts=args.latency_prompts, context_tokens=args.context_tokens,
                                               seed=args.seed, drafter_name=drafter_name,
                                               verifier=verifier)  # fmt: skip
            print(format_step_latency(step_report))
            summary = step_report.to_dict()
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(str(error)) from None
    total = time.perf_counter() - started
    print(f"built the target in {built:.1f} s; {total:.1f} s in all")
    summary = {
        "command": ["python", "-m", "inference.bench", *(sys.argv[1:] if argv is None else argv)],
        "random_weights": bool(args.random_weights),
        "size": args.size if args.random_weights else None,
        "build_seconds": built,
        "seconds": total,
        **summary,
    }
    if args.out:
        write_json(summary, Path(args.out))
        print(f"wrote {args.out}")
    return summary
