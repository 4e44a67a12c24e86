"""Online against offline features, side by side in one run: extraction time and training steps per second.

    python -m training.bench_online                      # the demo's recipe on the toy target, 2 rounds of 30 steps
    python -m training.bench_online --steps 50 --rounds 3 --extract-count 256

1. Time to a dataset: the same extraction recipe (configs/extract_toy.yaml, `--extract-count`
   captions) run with `features: tokens` and with `features: full`, alternately, into fresh folders;
   the token-only one is what a new user waits for before the first online training step.
2. Training: the demo's drafter, objective, optimizer and batch size (configs/demo.yaml) under a real
   Lightning Trainer, reading one full-feature dataset offline (the stored states) and online (the
   tokens, with the target recomputing the states in `on_after_batch_transfer`). Rounds alternate
   offline, online, ... so that a change of load hits both; each fit's first `--warmup` steps are
   not timed. The step time is the loop period (one on_train_batch_start to the next), so it covers
   reading the batch, the online forward, the drafter step and the optimizer.

Prints the medians, steps per second and the ratio online / offline (1.30 or less: the demo can
default to online features).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

from data.drafter_data import DrafterDataModule, resolve_config_path
from data.extract import load_config, run_extraction
from models.registry import shared_target
from training.bench import StepTimer
from training.objective import ObjectiveConfig
from training.system import DrafterSystem, OptimizerConfig


def extract_seconds(count: int, features: str, folder: Path) -> tuple[float, int]:
    """(wall seconds, bytes written) of the toy recipe for `count` captions in `features` mode."""
    config = load_config(resolve_config_path("extract_toy"), [f"out_dir={folder}", f"prompts.count={count}",
                                                              f"features={features}"])  # fmt: skip
    start = time.perf_counter()
    manifest = run_extraction(config, shared_target("toy"), rank=0, world_size=1, progress=False)
    assert manifest is not None
    return time.perf_counter() - start, sum(info.num_bytes for info in manifest.shards)


def fit_periods(folder: Path, features: str, steps: int, demo: dict[str, Any]) -> list[float]:
    """Loop periods (s) of `steps` demo training steps reading `folder` with `features`."""
    model, data = demo["model"], demo["data"]
    system = DrafterSystem(target="toy", architecture=model["architecture"], preset=model["preset"],
                           objective=ObjectiveConfig(**model["objective"]),
                           optimizer=OptimizerConfig(**model["optimizer"]), seed=0)  # fmt: skip
    datamodule = DrafterDataModule(train_dir=str(folder), batch_size=data["batch_size"], target="toy",
                                   load_aux=data["load_aux"], load_uncond=data["load_uncond"],
                                   features=features)  # fmt: skip
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=demo["trainer"]["gradient_clip_val"], callbacks=[timer])  # fmt: skip
    trainer.fit(system, datamodule=datamodule)
    return timer.periods  # one on_train_batch_start to the next


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per fit (the first --warmup untimed)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternations offline -> online")
    parser.add_argument("--extract-count", type=int, default=256, help="captions of each timed extraction")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|LeafSpec|on_after_batch_transfer)")
    demo = yaml.safe_load(resolve_config_path("demo").read_text())
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads")

    scratch = Path(tempfile.mkdtemp(prefix="bench_online-"))
    try:
        timings: dict[str, list[float]] = {"tokens": [], "full": []}
        sizes: dict[str, int] = {}
        for round_index in range(args.rounds):
            for features in ("tokens", "full"):
                seconds, size = extract_seconds(args.extract_count, features, scratch / f"{features}-{round_index}")
                timings[features].append(seconds)
                sizes[features] = size
        print(f"\nextraction of {args.extract_count} toy captions (configs/extract_toy.yaml), {args.rounds} rounds:")
        for features in ("tokens", "full"):
            per_sample = sizes[features] / args.extract_count / 1e3
            print(f"  features {features:<6} {statistics.median(timings[features]):6.1f} s   "
                  f"{sizes[features] / 1e6:7.2f} MB ({per_sample:.1f} KB per sample)")  # fmt: skip
        ratio = statistics.median(timings["tokens"]) / statistics.median(timings["full"])
        print(f"  ratio tokens / full: time {ratio:.2f}, bytes {sizes['tokens'] / sizes['full']:.3f}")

        folder = scratch / "full-0"
        periods: dict[str, list[float]] = {"offline": [], "online": []}
        for _ in range(args.rounds):
            for features in ("offline", "online"):
                periods[features] += fit_periods(folder, features, args.steps, demo)[args.warmup :]
        batch = demo["data"]["batch_size"]
        print(f"\ntraining steps (demo recipe, batch {batch}), {len(periods['offline'])} timed steps each (median):")
        for features, values in periods.items():
            median = statistics.median(values)
            print(f"  {features:<8} {median * 1e3:8.1f} ms/step   {1 / median:6.2f} steps/s")
        ratio = statistics.median(periods["online"]) / statistics.median(periods["offline"])
        print(f"  ratio online / offline step time: {ratio:.2f} ({'within' if ratio <= 1.3 else 'above'} 1.30)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
