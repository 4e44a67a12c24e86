"""Lightning overhead benchmark: one `DrafterSystem` training step under a real `lightning.Trainer`
against a plain PyTorch loop over the same drafter and the same batch, measured in the same run.

    python -m inference.training_bench  # toy target, EAGLE-3, B 16, 7 TTT steps, 1 thread
    python -m inference.training_bench --batch-size 4 --steps 30 --warmup 5 --rounds 2
    python -m inference.training_bench --architecture eagle1 --cfg-loss --threads 2

Both sides train the toy target's "toy" drafter preset on one synthetic batch built in memory with
the shapes of an extracted toy batch (tokens (B, 36), hidden (B, 36, 128), aux (B, 36, 384) in
float16, loss_mask, keys; uncond_hidden and uncond_aux with --cfg-loss), so no dataset is needed.

- lightning: `Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
  enable_progress_bar=False, gradient_clip_val=0.5)` fits the DrafterSystem on a DataLoader that
  yields that same batch forever; a Callback times on_train_batch_start -> on_train_batch_end, which
  spans training_step (the objective and its logging), zero_grad, backward, the system's grad-norm
  hook, gradient clipping, AdamW and the LR scheduler, but not data loading.
- plain: `drafter_objective` + `loss.backward()` + `clip_grad_norm_(0.5)` + `AdamW.step()` + the same
  LR schedule + `zero_grad()`, timed around the whole step.

The two alternate in `--rounds` rounds (plain, lightning, plain, lightning, ...), each with its own
warm-up steps, so that a change of load on a shared machine hits both; the medians (and IQRs) pool
the timed steps of every round. The ratio lightning / plain of the median step times is what the
Lightning wrapper (its loop, its `self.log` calls and the system's per-step grad-norm logging) costs
on top of the bare computation: 1.00 = free; the goal is <= 1.10. "Loop period" is the time between
consecutive on_train_batch_start calls, which adds what the window leaves out (fetching the next batch,
logger-connector bookkeeping) and is compared with the same plain step time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset

from models.eagle import count_parameters
from models.registry import shared_target
from models.target import ImageTarget
from training.objective import ObjectiveConfig, drafter_objective
from training.system import DrafterSystem, OptimizerConfig, lr_factor

PROG = "python -m inference.training_bench"

GOAL = 1.10
GRADIENT_CLIP = 0.5
"""The Trainer's gradient_clip_val in every config (norm clipping, Lightning's default algorithm)."""


# ----------------------------------------------------------------------------- inputs


def synthetic_batch(
    target: ImageTarget,
    batch_size: int,
    cfg: bool,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict[str, Any]:
    """A batch shaped like a collated toy extraction (`data.shard_stream.collate_samples`), random values.

    tokens (B, L) int64, hidden (B, L, D), aux (B, L, 3D) and with `cfg` uncond_hidden / uncond_aux, in
    `dtype`; loss_mask (B, L) and sample_mask (B,) all True; lengths (B,); keys, prompt_ids, prompts.
    """
    generator = torch.Generator().manual_seed(seed)
    length = target.geometry.num_tokens
    width = target.hidden_size
    aux_width = width * len(target.aux_layer_ids)

    def features(size: int) -> torch.Tensor:
        return torch.randn(batch_size, length, size, generator=generator).to(dtype)

    batch: dict[str, Any] = {
        "tokens": torch.randint(0, target.image_vocab_size, (batch_size, length), generator=generator),
        "hidden": features(width),
        "aux": features(aux_width),
    }
    if cfg:
        batch["uncond_hidden"] = features(width)
        batch["uncond_aux"] = features(aux_width)
    batch["lengths"] = torch.full((batch_size,), length, dtype=torch.int64)
    batch["loss_mask"] = torch.ones(batch_size, length, dtype=torch.bool)
    batch["sample_mask"] = torch.ones(batch_size, dtype=torch.bool)
    batch["keys"] = [f"{i:09d}" for i in range(batch_size)]
    batch["prompt_ids"] = [f"bench-{i}" for i in range(batch_size)]
    batch["prompts"] = ["a synthetic caption"] * batch_size
    return batch


class RepeatBatch(IterableDataset):
    """Yields the same batch forever: DataLoader(RepeatBatch(batch), batch_size=None) costs next to nothing."""

    def __init__(self, batch: dict[str, Any]) -> None:
        super().__init__()
        self.batch = batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.batch


# ----------------------------------------------------------------------------- timing


class TrainingBatchTimer(Callback):
    """Times each training batch (on_train_batch_start -> on_train_batch_end) and the period between consecutive
    batch starts; with `losses`, records every batch's loss too. (The decoder's per-phase timer is
    `inference.measure.bench.DecodePhaseTimer`.)"""

    def __init__(self, losses: list[float] | None = None) -> None:
        self.durations: list[float] = []
        self.periods: list[float] = []
        self.losses = losses
        self._start: float | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._start is not None:
            self.periods.append(now - self._start)
        self._start = now

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._start is not None
        self.durations.append(time.perf_counter() - self._start)
        if self.losses is not None:
            self.losses.append(float(outputs["loss"]))


@dataclass
class Samples:
    """Timed seconds per step of one side, pooled over rounds."""

    steps: list[float] = field(default_factory=list)
    periods: list[float] = field(default_factory=list)


def summary(values: list[float]) -> tuple[float, float, float]:
    """(median, q1, q3) of `values` (inclusive quartiles; one value gives that value thrice)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


def lightning_steps(
    system: DrafterSystem, batch: dict[str, Any], warmup: int, steps: int, losses: list[float] | None = None
) -> tuple[list[float], list[float]]:
    """Fit `system` for warmup + steps steps on the repeated batch; the timed steps' windows and periods.

    With `losses`, every step's loss is appended to it (after the timed window).
    """
    timer = TrainingBatchTimer(losses)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=GRADIENT_CLIP,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    loader = DataLoader(RepeatBatch(batch), batch_size=None, num_workers=0)
    with contextlib.redirect_stdout(io.StringIO()):  # DrafterSystem.on_fit_start's banner, once per round
        trainer.fit(system, train_dataloaders=loader)
    if len(timer.durations) != warmup + steps:
        raise RuntimeError(f"the Trainer ran {len(timer.durations)} steps, expected {warmup + steps}")
    return timer.durations[warmup:], timer.periods[warmup:]  # periods[i] ends at batch i + 1's start


def plain_steps(
    system: DrafterSystem, batch: dict[str, Any], warmup: int, steps: int, losses: list[float] | None = None
) -> list[float]:
    """The same step in plain PyTorch on the same drafter and target; seconds of the timed steps.

    With `losses`, every step's loss is appended to it (after the timed step).
    """
    model, target, objective = system.drafter, system.frozen_target, system.objective
    assert target is not None, "setup('fit') loads the target"
    config = system.optimizer_config
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    total = config.total_steps or warmup + steps
    schedule = functools.partial(
        lr_factor, warmup=config.warmup_steps, total=total, schedule=config.schedule, min_ratio=config.min_lr_ratio
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    seconds = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(system.seed * 1_000_003 + step * 1009)  # as DrafterSystem
        out = drafter_objective(model, target, batch, objective, training=True, generator=generator)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, GRADIENT_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        if losses is not None:
            losses.append(float(out.loss))
    return seconds[warmup:]


# ----------------------------------------------------------------------------- main


def objective_for(architecture: str, ttt_steps: int | None, cfg_loss: bool) -> ObjectiveConfig:
    """EAGLE-3's recipe (configs/eagle3_toy.yaml) or EAGLE-1's (configs/eagle1_toy.yaml)."""
    cfg_weight = 1.0 if cfg_loss else 0.0
    if architecture == "eagle1":
        steps = 1 if ttt_steps is None else ttt_steps
        return ObjectiveConfig(
            ttt_steps=steps, eval_steps=max(steps, 5), ce_weight=0.1, feature_weight=1.0, noise_std=0.2,
            cfg_loss_weight=cfg_weight,
        )  # fmt: skip
    steps = 7 if ttt_steps is None else ttt_steps
    return ObjectiveConfig(ttt_steps=steps, eval_steps=steps, cfg_loss_weight=cfg_weight)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch (configs/demo.yaml: 16)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each side per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each side before each round's timing")
    parser.add_argument("--rounds", type=int, default=2, help="alternations plain -> lightning (pooled)")
    parser.add_argument("--architecture", choices=("eagle3", "eagle1"), default="eagle3")
    parser.add_argument("--ttt-steps", type=int, default=None, help="unrolled steps (default: eagle3 7, eagle1 1)")
    parser.add_argument("--cfg-loss", action="store_true", help="cfg_loss_weight 1: both CFG branches, uncond_* fields")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--target", default="toy", help="registry name of the target (its drafter preset too)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be >= 0")
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "GPU available: False ..." banners
    for message in (r".*does not have many workers", r".*no `val_dataloader`", r".*LeafSpec.*is deprecated"):
        warnings.filterwarnings("ignore", message=message)  # expected here: one in-memory batch, no validation

    objective = objective_for(args.architecture, args.ttt_steps, args.cfg_loss)
    system = DrafterSystem(
        target=args.target, architecture=args.architecture, preset=args.target, objective=objective,
        optimizer=OptimizerConfig(lr=1e-4), seed=args.seed,
    )  # fmt: skip
    system.setup("fit")  # loads the shared target, so plain rounds can run before the first fit
    target = shared_target(args.target)
    batch = synthetic_batch(target, args.batch_size, cfg=args.cfg_loss, seed=args.seed)

    print(f"torch {torch.__version__}, lightning {L.__version__}, python {sys.version.split()[0]}")
    threads, interop = torch.get_num_threads(), torch.get_num_interop_threads()
    print(f"threads: torch {threads} (--threads {args.threads}), interop {interop}")
    shapes = ", ".join(
        f"{k} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in batch.items() if torch.is_tensor(v)
    )
    print(f"batch: {shapes}")
    print(
        f"drafter: {args.architecture} preset {args.target!r}, {count_parameters(system.drafter) / 1e6:.2f} M "
        f"parameters; ttt_steps {objective.ttt_steps}, cfg_loss_weight {objective.cfg_loss_weight}, "
        f"gradient clip {GRADIENT_CLIP} (norm)"
    )
    print(f"schedule: {args.rounds} rounds x (plain, lightning), each {args.warmup} warm-up + {args.steps} timed steps")

    plain, lightning = Samples(), Samples()
    for round_index in range(args.rounds):
        plain.steps += plain_steps(system, batch, args.warmup, args.steps)
        steps, periods = lightning_steps(system, batch, args.warmup, args.steps)
        lightning.steps += steps
        lightning.periods += periods
        if torch.get_num_threads() != args.threads:
            print(f"note: torch threads changed to {torch.get_num_threads()} in round {round_index}; reset")
            torch.set_num_threads(args.threads)
        print(
            f"  round {round_index}: plain {statistics.median(plain.steps[-args.steps :]) * 1e3:.2f} ms, "
            f"lightning {statistics.median(steps) * 1e3:.2f} ms"
        )

    rows = [("plain", plain.steps), ("lightning", lightning.steps), ("lightning loop period", lightning.periods)]
    print(f"\nper training step over {len(plain.steps)} timed steps each (median, IQR = q1 .. q3):")
    for name, values in rows:
        median, q1, q3 = summary(values)
        print(f"  {name:<22} {median * 1e3:8.2f} ms   IQR {q1 * 1e3:.2f} .. {q3 * 1e3:.2f} ms ({(q3 - q1) * 1e3:.2f})")
    base = summary(plain.steps)[0]
    ratio = summary(lightning.steps)[0] / base
    verdict = "within" if ratio <= GOAL else "ABOVE"
    print(f"ratio lightning / plain: {ratio:.3f} ({verdict} the goal <= {GOAL:.2f})")
    if lightning.periods:
        print(f"ratio lightning loop period / plain: {summary(lightning.periods)[0] / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
