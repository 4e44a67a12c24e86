"""Train a drafter: `python training/fit.py --config eagle3_janus.yaml` (or `python -m training.fit ...`).

    python training/fit.py --config demo                          # toy target, CPU, a few minutes
    python training/fit.py --config eagle3_toy --trainer.max_steps 10 --model.objective.ttt_steps 3
    python training/fit.py --config demo --ckpt_path last         # resume exactly where it stopped
    python training/fit.py --config demo --print_config           # the resolved config

LightningCLI (jsonargparse) reads the YAML's `trainer`, `model` (DrafterSystem), `data`
(DrafterDataModule) and `checkpoint` (ModelCheckpoint) sections; any key can be overridden with a
dotted flag, and an unknown key is an error that names it. A bare config name resolves in
`configs/`. The resolved config is written into the run directory as `config.yaml`; the drafter
is exported there as `drafter/` (config.json + model.safetensors) when training ends.

Before training (unless resuming) the untrained drafter is validated, so the printed summary and
TensorBoard show the simulated acceptance length before and after.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from training.system import DrafterDataModule, DrafterSystem, resolve_config_path


class ExportDrafter(Callback):
    """Writes `<run dir>/drafter` (the drafter alone, self-describing) when training ends."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        checkpoint = trainer.checkpoint_callback
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_last and checkpoint.dirpath:
            # ModelCheckpoint writes last.ckpt only on its own schedule; make it the final step for --ckpt_path last
            last = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
            if getattr(pl_module, "last_checkpoint_step", None) != trainer.global_step:
                trainer.save_checkpoint(last)
                checkpoint.last_model_path = str(last)
        if trainer.is_global_zero and trainer.log_dir:
            path = pl_module.export_drafter(Path(trainer.log_dir) / "drafter")
            print(f"exported the drafter to {path}")


class DrafterCLI(LightningCLI):
    """LightningCLI with a checkpoint section, the target linked into the data section, and --ckpt_path."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/tau_sim",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": 1,
                "checkpoint.filename": "best-{step}",
            }
        )
        parser.link_arguments("model.target", "data.target")
        parser.link_arguments("model.target_options", "data.target_options")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume; 'last' = newest")
        parser.add_argument("--validate_before", type=bool, default=True, help="validate the untrained drafter first")


class ConfigCheckCLI(DrafterCLI):
    """Parses a config and builds model and data, but no Trainer: checks GPU configs on any machine."""

    def instantiate_classes(self) -> None:
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        self.config_init = instantiate(self.config)
        self.model = self.config_init["model"]
        self.datamodule = self.config_init["data"]


def check_config(argv: list[str]) -> ConfigCheckCLI:
    """Parse and validate a config (and overrides) without building a Trainer or loading the target."""
    return ConfigCheckCLI(
        DrafterSystem, DrafterDataModule, args=resolve_config_names(argv), run=False, save_config_callback=None
    )


def resolve_config_names(argv: list[str]) -> list[str]:
    """`--config demo` / `--config=demo` -> the file in configs/ (a path that exists is kept)."""
    resolved = list(argv)
    for i, arg in enumerate(resolved):
        if arg == "--config" and i + 1 < len(resolved):
            resolved[i + 1] = str(resolve_config_path(resolved[i + 1]))
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + str(resolve_config_path(arg.split("=", 1)[1]))
    return resolved


def build_cli(argv: list[str], **kwargs: Any) -> DrafterCLI:
    """Parse `argv` and instantiate trainer, model and data (nothing heavy: the target loads in setup)."""
    saved_argv = sys.argv  # LightningCLI warns when both `args` and sys.argv hold arguments; DDP relaunches
    sys.argv = sys.argv[:1]  # read sys.argv later, so it is restored right after parsing
    try:
        return _build_cli(argv, **kwargs)
    finally:
        sys.argv = saved_argv


def _build_cli(argv: list[str], **kwargs: Any) -> DrafterCLI:
    return DrafterCLI(
        DrafterSystem,
        DrafterDataModule,
        args=resolve_config_names(argv),
        run=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "callbacks": [LearningRateMonitor(logging_interval="step"), ExportDrafter()],
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": "drafter", "version": "", "default_hp_metric": False},
            },
        },
        **kwargs,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli = build_cli(argv)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    trainer, system, data = cli.trainer, cli.model, cli.datamodule
    ckpt_path = cli.config.get("ckpt_path")
    before: float | None = None
    if cli.config.get("validate_before") and ckpt_path is None and trainer.limit_val_batches != 0:
        data.prepare_data()
        results = trainer.validate(system, datamodule=data, verbose=False)
        before = results[0].get("val/tau_sim") if results else None
    trainer.fit(system, datamodule=data, ckpt_path=ckpt_path)
    validates = trainer.limit_val_batches != 0 and data.config.num_val_shards + (data.config.val_dir is not None) > 0
    if validates and system.last_validated_step != trainer.global_step:  # the summary reports the final drafter
        trainer.validate(system, datamodule=data, verbose=False)
    if trainer.is_global_zero:
        summarize(trainer, before)
    return 0


def summarize(trainer: Any, before: float | None) -> None:
    """Print the simulated acceptance length before and after, and where logs and checkpoints are."""
    metrics = trainer.callback_metrics
    after = metrics.get("val/tau_sim")
    after = float(after) if isinstance(after, torch.Tensor) else after
    log_dir = Path(trainer.log_dir or ".")
    lines = ["", "training finished:"]
    if after is not None:
        lines.append(
            "  simulated acceptance length (1 + sum_k prod_{i<=k} acc_i, the +1 is the bonus token): "
            + (f"{before:.3f} untrained -> " if before is not None else "")
            + f"{after:.3f} trained"
        )
    lines.append(f"  steps: {trainer.global_step}")
    if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.last_model_path:
        lines.append(f"  checkpoints: {Path(trainer.checkpoint_callback.last_model_path).parent}")
    lines.append(f"  drafter: {log_dir / 'drafter'}")
    lines.append(f"  TensorBoard: tensorboard --logdir {log_dir}")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
