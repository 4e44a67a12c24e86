"""What the online step costs: the target's FLOPs per step before and after, extraction time and step times.

    python -m inference.online_bench                # all three parts, the demo's recipe on the toy target
    python -m inference.online_bench --parts flops  # the FLOPs table alone (seconds)
    python -m inference.online_bench --steps 50 --rounds 3 --extract-count 256

1. Target FLOPs per online step (`torch.utils.flop_counter.FlopCounterMode` over the target's forward
   of one step, `models.target.teacher_forced_states`), on the tiny random-weight Janus, LlamaGen and
   Lumina (`models.random_weights`, size "tiny") and the toy, each with its config's recipe and per-GPU
   batch (configs/eagle3_*.yaml: uncond_rate 0.1, batch 2; the toy: configs/demo.yaml, cfg_loss_weight 1,
   batch 16). "before" is the old step: [cond; uncond] rows for every sample through the decode path
   (prefill into a KV cache, then the tokens over it: `decode_cache=True`, `uncond=True`). "after" is the
   step as it runs now: the B conditional rows plus the unconditional rows of the samples the objective
   reads (`training.objective.uncond_samples_read`), in one cacheless causal pass. Its expectation
   over the swap draw is cond + uncond_rate x (all uncond rows), FLOPs being linear in rows; the mean
   over `--flop-steps` steps of the system's own generator is printed beside it. Every "after" pass is
   checked against the old path's streams (largest |difference| / max |stream|). The last column times
   the two passes over the same rows (every [cond; uncond] row; median of `--repeats`, interleaved): the
   cacheless pass is kept where it is faster.
2. Time to a dataset: the same extraction recipe (configs/extract_toy.yaml, `--extract-count`
   captions) run with `features: tokens` and with `features: full`, alternately, into fresh folders.
3. Training: the demo's drafter, objective, optimizer and batch size (configs/demo.yaml) under a real
   Lightning Trainer, reading one full-feature dataset offline (the stored states), online with the old
   target forward ("online before": every row through the decode path) and online as it runs now.
   Rounds alternate the three; each fit's first `--warmup` steps are not timed. The step time is the
   loop period (one on_train_batch_start to the next), so it covers reading the batch, the online
   forward, the drafter step and the optimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

import training.online_features as online_features
from data.drafter_data import DrafterDataModule, resolve_config_path
from data.extract import load_config, run_extraction
from inference.measure.pipeline.training_bench import TrainingBatchTimer
from models.random_weights import STAND_IN_WORDS, random_target
from models.registry import shared_target
from models.target import ImageTarget, TeacherForcedStates, teacher_forced_states
from training.objective import ObjectiveConfig, draw_uncond_swap, uncond_samples_read
from training.system import DrafterSystem, OptimizerConfig

PROG = "python -m inference.online_bench"

PARTS = ("flops", "extract", "steps")
FLOP_TARGETS = {  # bench name -> (random-weight target or "toy", the config whose recipe and batch it runs)
    "tiny janus": ("janus-pro-7b", "eagle3_janus"),
    "tiny llamagen": ("llamagen-xl", "eagle3_llamagen"),
    "tiny lumina": ("lumina-mgpt-7b", "eagle3_lumina"),
    "toy": ("toy", "demo"),
}


@dataclass
class FlopRow:
    """One target's FLOPs per online step (forward of the target only)."""

    name: str
    recipe: str
    batch: int
    before: float  # [cond; uncond] for every sample, decode path
    expected: float  # cond + uncond_rate x every uncond row (or every row when both branches train), cacheless
    measured: float  # mean over the system generator's steps
    uncond_rows: float  # mean unconditional rows per step, measured
    worst_difference: float  # largest |after - before| / max |before| over every stream and step
    seconds_before: float  # median wall time of the old forward
    seconds_after: float  # median wall time of the cacheless forward over the same rows ([cond; uncond], every row)


def count_flops(function: Any) -> tuple[float, Any]:
    """(FLOPs, result) of one call of `function()` under `FlopCounterMode`."""
    with FlopCounterMode(display=False) as counter:
        result = function()
    return float(counter.get_total_flops()), result


def stream_difference(after: TeacherForcedStates, before: TeacherForcedStates, samples: Tensor) -> float:
    """Largest |after - before| / max |before| over the streams, the unconditional ones on `samples` (S,)."""
    worst = 0.0
    for name, value in after.fields().items():
        reference = before.fields()[name]
        reference = reference[samples] if name.startswith("uncond") else reference
        if value.numel():
            scale = float(reference.float().abs().max())
            worst = max(worst, float((value.float() - reference.float()).abs().max()) / max(scale, 1e-30))
    return worst


def flop_row(name: str, steps: int, repeats: int) -> FlopRow:
    """Target FLOPs per online step of the bench target `name` with its config's recipe and batch, and the
    median time of `repeats` forwards over every row, decode path against the cacheless pass."""
    target_name, config_name = FLOP_TARGETS[name]
    config = yaml.safe_load(resolve_config_path(config_name).read_text())
    objective = ObjectiveConfig(**config["model"]["objective"])
    batch = int(config["data"]["batch_size"])
    target: ImageTarget = shared_target("toy") if target_name == "toy" else random_target(target_name, "tiny")
    words = list(STAND_IN_WORDS)
    prompts = [" ".join(words[(3 * i) % len(words) :][: 4 + i % 5]) for i in range(batch)]  # lengths 4 .. 8
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.image_vocab_size, (batch, target.geometry.num_tokens), generator=generator)
    aux = bool(config["data"].get("load_aux", True))

    before_flops, before = count_flops(
        lambda: teacher_forced_states(target, prompts, tokens, aux=aux, uncond=True, decode_cache=True)
    )
    everyone = torch.ones(batch, dtype=torch.bool)
    nobody = torch.zeros(batch, dtype=torch.bool)
    all_flops, _ = count_flops(lambda: teacher_forced_states(target, prompts, tokens, aux=aux, uncond=everyone))
    cond_flops, _ = count_flops(lambda: teacher_forced_states(target, prompts, tokens, aux=aux, uncond=nobody))
    share = 1.0 if objective.cfg_loss_weight > 0 else objective.uncond_rate
    expected = cond_flops + share * (all_flops - cond_flops)

    measured, rows, worst = [], [], 0.0
    for step in range(steps if objective.uncond_rate > 0 else 1):  # DrafterSystem._generator's seeds, seed 0, rank 0
        step_generator = torch.Generator().manual_seed(step * 1009)
        swap = draw_uncond_swap(objective, batch, step_generator)
        read = uncond_samples_read(objective, batch, True, swap)
        step_states = functools.partial(teacher_forced_states, target, prompts, tokens, aux=aux, uncond=read)
        flops, after = count_flops(step_states)
        measured.append(flops)
        rows.append(int(read.sum()))
        worst = max(worst, stream_difference(after, before, read.nonzero().squeeze(1)))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):  # interleaved, so that a change of load hits both
        for cache in (True, False):
            start = time.perf_counter()
            teacher_forced_states(target, prompts, tokens, aux=aux, uncond=True, decode_cache=cache)
            times[cache].append(time.perf_counter() - start)
    recipe = f"cfg_loss_weight {objective.cfg_loss_weight:g}" if objective.cfg_loss_weight else (
        f"uncond_rate {objective.uncond_rate:g}")  # fmt: skip
    return FlopRow(name, recipe, batch, before_flops, expected, statistics.mean(measured), statistics.mean(rows),
                   worst, statistics.median(times[True]), statistics.median(times[False]))  # fmt: skip


def print_flops(rows: list[FlopRow], steps: int) -> None:
    print(f"\ntarget FLOPs per online step (forward of the target only; 'measured': mean over {steps} steps' swap "
          "draws):")  # fmt: skip
    print(
        "| target | recipe | B | before (decode path, all rows) | after, expected | after / before | "
        "after, measured | uncond rows per step | max stream difference | all rows: decode path / cacheless |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row.name} | {row.recipe} | {row.batch} | {row.before / 1e6:.2f} MFLOP | {row.expected / 1e6:.2f} "
            f"MFLOP | {row.expected / row.before:.3f} | {row.measured / 1e6:.2f} MFLOP | {row.uncond_rows:.2f} | "
            f"{row.worst_difference:.1e} | {row.seconds_before * 1e3:.1f} / {row.seconds_after * 1e3:.1f} ms |"
        )


def extract_seconds(count: int, features: str, folder: Path) -> tuple[float, int]:
    """(wall seconds, bytes written) of the toy recipe for `count` captions in `features` mode."""
    config = load_config(resolve_config_path("extract_toy"), [f"out_dir={folder}", f"prompts.count={count}",
                                                              f"features={features}"])  # fmt: skip
    start = time.perf_counter()
    manifest = run_extraction(config, shared_target("toy"), rank=0, world_size=1, progress=False)
    assert manifest is not None
    return time.perf_counter() - start, sum(info.num_bytes for info in manifest.shards)


@contextlib.contextmanager
def old_online_forward() -> Iterator[None]:
    """The online step's target forward as it was: every row through the decode path, then the rows asked for."""

    def old(target: ImageTarget, prompts: list[str], tokens: Tensor, aux: bool = True,
            uncond: bool | Tensor = False) -> TeacherForcedStates:  # fmt: skip
        states = teacher_forced_states(target, prompts, tokens, aux=aux, uncond=uncond is not False, decode_cache=True)
        if isinstance(uncond, Tensor) and states.uncond_hidden is not None:
            rows = uncond.nonzero().squeeze(1)
            states.uncond_hidden = states.uncond_hidden[rows]
            states.uncond_aux = None if states.uncond_aux is None else states.uncond_aux[rows]
        return states

    patched = online_features.teacher_forced_states
    online_features.teacher_forced_states = old  # type: ignore[assignment]
    try:
        yield
    finally:
        online_features.teacher_forced_states = patched


def fit_periods(folder: Path, features: str, steps: int, demo: dict[str, Any]) -> list[float]:
    """Loop periods (s) of `steps` demo training steps reading `folder` with `features`."""
    model, data = demo["model"], demo["data"]
    system = DrafterSystem(target="toy", architecture=model["architecture"], preset=model["preset"],
                           objective=ObjectiveConfig(**model["objective"]),
                           optimizer=OptimizerConfig(**model["optimizer"]), seed=0)  # fmt: skip
    datamodule = DrafterDataModule(train_dir=str(folder), batch_size=data["batch_size"], target="toy",
                                   load_aux=data["load_aux"], load_uncond=data["load_uncond"],
                                   features=features)  # fmt: skip
    timer = TrainingBatchTimer()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=demo["trainer"]["gradient_clip_val"], callbacks=[timer])  # fmt: skip
    trainer.fit(system, datamodule=datamodule)
    return timer.periods  # one on_train_batch_start to the next


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--flop-steps", type=int, default=20, help="steps whose swap draws the FLOPs average")
    parser.add_argument("--repeats", type=int, default=7, help="timed target forwards per path in the FLOPs part")
    parser.add_argument("--steps", type=int, default=30, help="training steps per fit (the first --warmup untimed)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternations offline -> online before -> online")
    parser.add_argument("--extract-count", type=int, default=256, help="captions of each timed extraction")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts {unknown} unknown; choose from {', '.join(PARTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|LeafSpec|on_after_batch_transfer)")
    demo = yaml.safe_load(resolve_config_path("demo").read_text())
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads")

    if "flops" in parts:
        print_flops([flop_row(name, args.flop_steps, args.repeats) for name in FLOP_TARGETS], args.flop_steps)
    if "extract" not in parts and "steps" not in parts:
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="online_bench-"))
    try:
        timings: dict[str, list[float]] = {"tokens": [], "full": []}
        sizes: dict[str, int] = {}
        rounds = args.rounds if "extract" in parts else 1
        for round_index in range(rounds):
            for features in ("tokens", "full") if "extract" in parts else ("full",):
                seconds, size = extract_seconds(args.extract_count, features, scratch / f"{features}-{round_index}")
                timings[features].append(seconds)
                sizes[features] = size
        if "extract" in parts:
            print(f"\nextraction of {args.extract_count} toy captions (configs/extract_toy.yaml), {rounds} rounds:")
            for features in ("tokens", "full"):
                per_sample = sizes[features] / args.extract_count / 1e3
                print(f"  features {features:<6} {statistics.median(timings[features]):6.1f} s   "
                      f"{sizes[features] / 1e6:7.2f} MB ({per_sample:.1f} KB per sample)")  # fmt: skip
            ratio = statistics.median(timings["tokens"]) / statistics.median(timings["full"])
            print(f"  ratio tokens / full: time {ratio:.2f}, bytes {sizes['tokens'] / sizes['full']:.3f}")
        if "steps" not in parts:
            return 0

        folder = scratch / "full-0"
        periods: dict[str, list[float]] = {"offline": [], "online before": [], "online": []}
        for _ in range(args.rounds):
            periods["offline"] += fit_periods(folder, "offline", args.steps, demo)[args.warmup :]
            with old_online_forward():
                periods["online before"] += fit_periods(folder, "online", args.steps, demo)[args.warmup :]
            periods["online"] += fit_periods(folder, "online", args.steps, demo)[args.warmup :]
        batch = demo["data"]["batch_size"]
        print(f"\ntoy training steps (demo recipe, batch {batch}), {len(periods['offline'])} timed steps each "
              "(median):")  # fmt: skip
        for features, values in periods.items():
            median = statistics.median(values)
            print(f"  {features:<14} {median * 1e3:8.1f} ms/step   {1 / median:6.2f} steps/s")
        offline = statistics.median(periods["offline"])
        for features in ("online before", "online"):
            print(f"  ratio {features} / offline step time: {statistics.median(periods[features]) / offline:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
