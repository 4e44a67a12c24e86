"""Train the tiny EAGLE-3 drafter with Lightning on CPU under one strategy and record its loss curve.

    python tests/scripts/fit_distributed.py --strategy single --data DIR --out OUT.json [--steps 3]
    python tests/scripts/fit_distributed.py --strategy ddp --data DIR --out OUT.json
    python tests/scripts/fit_distributed.py --strategy deepspeed_stage_2 --data DIR --out OUT.json
    python tests/scripts/fit_distributed.py --strategy ddp --features online --data DIR --out OUT.json

The run is made comparable across strategies: the dataset (tests/scripts/extract_tiny.py, the tiny
random target "tiny-toy") must hold exactly 2 b samples, `single` trains batches of 2 b on one
process and `ddp` / `deepspeed_stage_2` batches of b on each of 2 processes, so every optimizer step
(one epoch = one batch per rank) sees all 2 b samples, whatever order the shuffle puts them in.
Every sample has the same length, so the mean of the per-rank mean losses is the global mean loss,
and averaging gradients across ranks gives the single-process gradient. The objective draws nothing
at random (no input noise, no unconditional swaps), so the three curves must agree to float
rounding.

Rank 0 writes OUT.json: "strategy", "world_size", "batch_size", "steps", "losses" (per step,
averaged across ranks), "grad_norms" (per step, of the reduced gradient the optimizer applied),
"optimizer" (the class that stepped), "zero_stage", "fit_s" and "checkpoint": a checkpoint saved
after training (`trainer.save_checkpoint`: a .ckpt file, or a DeepSpeed folder under DeepSpeed) is
converted with `training.convert` into a drafter folder, and "checkpoint" says whether its weights
equal the live drafter's, with the largest difference. Lightning relaunches this script for rank 1
(DDP and DeepSpeed), which is why distributed training is tested through a script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny target

import lightning as L  # noqa: E402
import torch  # noqa: E402
from conftest import build_tiny_toy_target  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, Strategy  # noqa: E402

from data.drafter_data import DrafterDataModule  # noqa: E402
from data.shards import load_manifest  # noqa: E402
from models import registry  # noqa: E402
from models.eagle import EagleDraftModel  # noqa: E402
from training.callbacks import DecodeValidation  # noqa: E402
from training.convert import convert_checkpoint  # noqa: E402
from training.deepspeed_cpu import CPUDeepSpeedStrategy  # noqa: E402
from training.fit import end_process_group  # noqa: E402
from training.objective import ObjectiveConfig  # noqa: E402
from training.system import DrafterSystem, OptimizerConfig  # noqa: E402

STRATEGIES = ("single", "ddp", "deepspeed_stage_2")
TARGET = "tiny-toy"


class LossRecorder(Callback):
    """Each training step's loss, averaged across ranks, and the norm of the gradient the optimizer applied.

    The loss reduction is a collective: every rank runs it. The gradient norm is rank 0's view of the
    gradient after the strategy's reduction: the parameters' `.grad` (single process, DDP), or the
    norm DeepSpeed's ZeRO optimizer computed over its gradient partitions (there `.grad` stays empty).
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self._grad_norm: float | None = None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad.detach().double() for p in pl_module.parameters() if p.grad is not None]
        self._grad_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))) if grads else None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach().float().clone()
        if trainer.world_size > 1:
            loss = trainer.strategy.reduce(loss, reduce_op="mean")
        self.losses.append(float(loss))
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        norm = engine.get_global_grad_norm() if engine is not None else self._grad_norm
        self.grad_norms.append(float("nan") if norm is None else float(norm))
        self._grad_norm = None


def build_strategy(name: str, batch_size: int) -> tuple[Strategy | str, int]:
    """(Lightning strategy, number of processes) for a strategy name of this script."""
    if name == "single":
        return "auto", 1
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo"), 2
    if name == "deepspeed_stage_2":  # the batch size is given so that Lightning does not probe the loader for it
        return CPUDeepSpeedStrategy(stage=2, logging_batch_size_per_gpu=batch_size), 2
    raise ValueError(f"unknown strategy {name!r}; known: {STRATEGIES}")


def check_checkpoint(trainer: L.Trainer, system: DrafterSystem, folder: Path, deepspeed: bool) -> dict[str, Any]:
    """Save a checkpoint (all ranks), convert it on rank 0 and compare the drafter folder with the live weights."""
    path = folder / ("deepspeed.ckpt" if deepspeed else "last.ckpt")
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()  # every rank's ZeRO partition is on disk before rank 0 reads them
    if not trainer.is_global_zero:
        return {}
    drafter_dir = convert_checkpoint(path, folder / "drafter")
    converted = EagleDraftModel.from_pretrained(drafter_dir).state_dict()
    live = {key: value.detach().cpu() for key, value in system.drafter.state_dict().items()}
    same_keys = sorted(converted) == sorted(live)
    diffs = [float((converted[k].double() - live[k].double()).abs().max()) for k in live if k in converted]
    return {
        "path": str(path),
        "is_dir": path.is_dir(),
        "layout": sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.is_dir() else [],
        "drafter_dir": str(drafter_dir),
        "same_keys": same_keys,
        "equal": same_keys and all(torch.equal(converted[k], live[k]) for k in live),
        "max_abs_diff": max(diffs, default=0.0),
        "num_tensors": len(live),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument(
        "--data", required=True, help="a tiny-toy dataset of 2 b samples (tests/scripts/extract_tiny.py)"
    )
    parser.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--features", choices=("offline", "online"), default="offline",
                        help="online: the target recomputes the states from the tokens")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry.TARGET_LOADERS[TARGET] = lambda **kwargs: build_tiny_toy_target()

    num_samples = load_manifest(args.data).num_samples
    if num_samples % 2:
        raise SystemExit(f"{args.data} holds {num_samples} samples: an even number 2 b is needed")
    half = num_samples // 2
    strategy, devices = build_strategy(args.strategy, half)
    batch_size = num_samples // devices  # one batch per rank per epoch, so each step sees all the samples

    system = DrafterSystem(
        target=TARGET,
        architecture="eagle3",
        preset="tiny",
        objective=ObjectiveConfig(ttt_steps=3, noise_std=0.0, uncond_rate=0.0, cfg_loss_weight=1.0),
        optimizer=OptimizerConfig(lr=args.lr, schedule="cosine"),  # a decaying lr: the scheduler must step
        seed=0,
    )
    data = DrafterDataModule(
        train_dir=args.data,
        batch_size=batch_size,
        target=TARGET,
        load_aux=True,
        load_uncond=True,
        shuffle_buffer=4,
        features=args.features,
    )
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.fit(system, datamodule=data)
    fit_s = time.perf_counter() - start
    out = Path(args.out)
    folder = out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = check_checkpoint(trainer, system, folder, deepspeed=args.strategy.startswith("deepspeed"))
    # real decoding with the trained drafter: 3 prompts split 2 + 1 over two ranks, sums all-reduced
    decoder = DecodeValidation(rules=["exact", "cascade"], num_prompts=3, top_k=2, depth=3, total_tokens=6)
    decode = decoder.evaluate(trainer, system)
    if trainer.is_global_zero:
        result = {
            "strategy": args.strategy,
            "features": args.features,
            "world_size": trainer.world_size,
            "batch_size": batch_size,
            "steps": trainer.global_step,
            "losses": recorder.losses,
            "grad_norms": recorder.grad_norms,
            "optimizer": type(trainer.optimizers[0]).__name__,  # DeepSpeedZeroOptimizer under ZeRO 1-2
            "zero_stage": (getattr(trainer.strategy, "config", None) or {}).get("zero_optimization", {}).get("stage"),
            "fit_s": fit_s,
            "checkpoint": checkpoint,
            "decode": decode,
        }
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: result[k] for k in ("strategy", "losses", "grad_norms", "fit_s")}))
    end_process_group()


if __name__ == "__main__":
    main()
