"""Train a drafter: `python training/fit.py --config eagle3_janus.yaml` (or `python -m training.fit ...`).

    python training/fit.py --config demo                          # toy target, CPU, a few minutes
    python training/fit.py --config eagle3_toy --trainer.max_steps 10 --model.objective.ttt_steps 3
    python training/fit.py --config demo --ckpt_path last         # resume the newest run where it stopped
    python training/fit.py --config demo --print_config           # the resolved config

LightningCLI (jsonargparse) reads the YAML's `trainer`, `model` (DrafterSystem), `data`
(data.drafter_data.DrafterDataModule) and `checkpoint` (ModelCheckpoint) sections; any key can be overridden with a
dotted flag, and an unknown key is an error that names it. A bare config name resolves in
`configs/`. The run directory is chosen before anything is written (`training.run_folder`: a new
`version_N` per run, `--ckpt_path last` = the newest run's last.ckpt, an explicit version that holds a
run is an error unless `--overwrite true`). The resolved config is written there as `config.yaml`;
`checkpoints/last.ckpt` every `checkpoint.every_n_train_steps` steps (LastCheckpoint) and the best by
`val/tau_sim` beside it; the drafter is exported as `drafter/` (config.json + model.safetensors) when
training ends.

Before training (unless resuming) the untrained drafter is validated, so the printed summary and
TensorBoard show the simulated acceptance length before and after. Before that, every shard is hashed
against the manifest once (`data.verify`, `data/verify.py`: later fits re-hash only what changed); a
dataset error (a shard that fails, a damaged sample) ends the run with exit code 2 and the message naming it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE as RICH_AVAILABLE

from data.drafter_data import DrafterDataModule, resolve_config_path
from data.errors import DatasetError
from training.callbacks import ProgressLines, StepBoundedProgressBar, gathered_parameters
from training.run_folder import RunFolderError, RunPlan, clear_run, plan_run
from training.system import DrafterSystem


class LastCheckpoint(ModelCheckpoint):
    """`checkpoints/last.ckpt` every N training steps, whether or not a validation has run: the resume point.

    The monitored best-by-metric checkpoint (the `checkpoint` section) waits for its metric; this one
    monitors nothing and keeps no top-k, so a run killed before its first validation still resumes
    from its last interval.
    """

    def __init__(self, every_n_train_steps: int | None = None) -> None:
        super().__init__(monitor=None, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps)


def last_checkpoint_callback(trainer: Any) -> ModelCheckpoint | None:
    """The callback that writes last.ckpt (LastCheckpoint, else any ModelCheckpoint with save_last)."""
    writers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.save_last]
    writers.sort(key=lambda cb: not isinstance(cb, LastCheckpoint))
    return writers[0] if writers else None


class ExportDrafter(Callback):
    """Writes `<run dir>/drafter` when training ends: the drafter alone, self-describing, with its model card.

    It is `python -m training.export` of the final `last.ckpt`, so the run's drafter and a later export of the
    same checkpoint are the same file: under DeepSpeed the float32 master weights consolidated from the ZeRO
    partitions (the live module holds bf16 copies of them), otherwise the module's own weights. Without a
    checkpoint callback the live module is written.
    """

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        checkpoint = last_checkpoint_callback(trainer)
        last: Path | None = None
        if checkpoint is not None and checkpoint.dirpath:
            # ModelCheckpoint writes last.ckpt only on its own schedule; make it the final step for --ckpt_path last
            last = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
            if getattr(pl_module, "last_checkpoint_step", None) != trainer.global_step:
                trainer.save_checkpoint(last)
                checkpoint.last_model_path = str(last)
            trainer.strategy.barrier("export")  # every rank's ZeRO partition is on disk before rank 0 reads them
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank asks
        if last is not None and last.exists():
            if trainer.is_global_zero and log_dir:
                from training.export import export_drafter

                result = export_drafter(last, Path(log_dir) / "drafter", run_dir=log_dir, overwrite=True)
                print(f"exported the drafter to {result.folder} (from {last})")
            return
        with gathered_parameters(pl_module.drafter):  # ZeRO-3: every rank gathers, rank 0 writes
            if trainer.is_global_zero and log_dir:
                path = pl_module.export_drafter(Path(log_dir) / "drafter")
                print(f"exported the drafter to {path}")


def process_rank() -> int:
    """This process's global rank as the launcher set it (RANK, LOCAL_RANK, SLURM_PROCID; 0 when none)."""
    return int(getattr(rank_zero_only, "rank", 0))


def end_process_group() -> None:
    """Destroy the distributed process group a fit started, if any. Left to interpreter exit, gloo's threads can
    outlive it and abort the finished process ("terminate called without an active exception", exit -6)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class ConfigError(ValueError):
    """A config whose settings cannot run together; raised before any target weights load."""


DEEPSPEED_CLASS = "lightning.pytorch.strategies.DeepSpeedStrategy"
CPU_DEEPSPEED_CLASS = "training.deepspeed_cpu.CPUDeepSpeedStrategy"


def deepspeed_strategy_args(strategy: Any) -> dict[str, Any] | None:
    """The init arguments of a DeepSpeed `trainer.strategy` as the config gives it (a registry name such as
    `deepspeed_stage_2`, or `{class_path: ...DeepSpeedStrategy, init_args: {...}}`); None for other strategies."""
    if isinstance(strategy, str):
        if not strategy.startswith("deepspeed"):
            return None
        from lightning.pytorch.strategies import StrategyRegistry

        if strategy not in StrategyRegistry:
            return None
        return dict(StrategyRegistry[strategy]["init_params"])
    class_path = strategy.get("class_path") if hasattr(strategy, "get") else None
    if class_path not in (DEEPSPEED_CLASS, "DeepSpeedStrategy", CPU_DEEPSPEED_CLASS):
        return None
    return dict(strategy.get("init_args") or {})


def check_trainer_settings(config: Any, source: str = "the config") -> None:
    """Refuse trainer settings that cannot run together, naming the key, before any rank loads the target.

    Raises:
        ConfigError: `trainer.gradient_clip_algorithm: value` under DeepSpeed (its engine clips the global
            gradient norm only: Lightning raises in `init_deepspeed`, after every rank has loaded the target).
    """
    strategy = config.get("trainer.strategy")
    if deepspeed_strategy_args(strategy) is None:
        return
    if config.get("trainer.gradient_clip_algorithm") == "value" and config.get("trainer.gradient_clip_val"):
        raise ConfigError(
            f"{source}: trainer.gradient_clip_algorithm: value cannot run with trainer.strategy {strategy!r}: "
            "DeepSpeed clips gradients by their global norm only (its gradient_clipping setting); set "
            "trainer.gradient_clip_algorithm: norm (or remove the key: norm is the default)"
        )


def cpu_deepspeed(config: Any) -> bool:
    """On a CPU accelerator, run a DeepSpeed `trainer.strategy` as `CPUDeepSpeedStrategy` with the same arguments.

    Lightning's `DeepSpeedStrategy` refuses CPU accelerators; `training.deepspeed_cpu` runs the same ZeRO stage,
    precision and clipping on CPU processes with gloo collectives (tests and CPU-only machines). Returns whether
    the strategy was replaced (the saved config.yaml then names the CPU class).
    """
    if config.get("trainer.accelerator") != "cpu":
        return False
    init_args = deepspeed_strategy_args(config.get("trainer.strategy"))
    if init_args is None:
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: no CUDA probing
    config["trainer.strategy"] = Namespace(class_path=CPU_DEEPSPEED_CLASS, init_args=Namespace(**init_args))
    return True


class DrafterCLI(LightningCLI):
    """LightningCLI with a checkpoint section, the target linked into the data section, and --ckpt_path."""

    run_plan: RunPlan | None = None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/tau_sim",
                "checkpoint.mode": "max",
                "checkpoint.save_last": False,  # last.ckpt is LastCheckpoint's, written at every interval
                "checkpoint.save_top_k": 1,
                "checkpoint.filename": "best-{step}",
            }
        )
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.link_arguments("checkpoint.every_n_train_steps", "last_checkpoint.every_n_train_steps")
        parser.link_arguments(
            "data.train_dir", "model.vocab_dir"
        )  # a reduced draft vocabulary counts the training data
        parser.link_arguments("model.target", "data.target")
        parser.link_arguments("model.target_options", "data.target_options")
        parser.add_argument(
            "--ckpt_path", type=str | None, default=None, help="checkpoint to resume; 'last' = the newest run's"
        )
        parser.add_argument("--validate_before", type=bool, default=True, help="validate the untrained drafter first")
        parser.add_argument(
            "--overwrite", type=bool, default=False, help="clear an explicit run folder that holds another run"
        )

    def before_instantiate_classes(self) -> None:
        """Check the trainer settings, then pick the run folder and the checkpoint to resume before the logger or
        any callback writes. A DeepSpeed strategy on a CPU accelerator runs as `CPUDeepSpeedStrategy`."""
        config = self.config
        check_trainer_settings(config, str(config.get("config", ["the config"])[-1]))
        cpu_deepspeed(config)
        if config.get("checkpoint.save_last"):
            raise RunFolderError(
                "checkpoint.save_last: last.ckpt is written by the interval checkpoint (every "
                "checkpoint.every_n_train_steps steps); remove checkpoint.save_last from the config"
            )
        init_args = config.get("trainer.logger.init_args")
        if init_args is None or init_args.get("save_dir") is None:
            if config.get("ckpt_path") == "last":
                raise RunFolderError("--ckpt_path last needs a logger with save_dir (the run folder); pass the path")
            return
        name = init_args.get("name") or ""
        root = Path(init_args.save_dir) / name
        plan = plan_run(root, init_args.get("version"), config.get("ckpt_path"), bool(config.get("overwrite")))
        init_args.version = plan.version
        config.ckpt_path = plan.ckpt_path
        self.run_plan = plan

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer with the config's callbacks, plus the step-bounded rich progress bar unless the config
        disables or chooses a bar, plus plain progress lines when stdout is not a terminal."""
        trainer_config = self.config_init.get("trainer") or {}
        callbacks = list(trainer_config.get("callbacks") or [])  # (given here, kwargs replace the config's list)
        added: list[Callback] = []
        if (
            RICH_AVAILABLE
            and trainer_config.get("enable_progress_bar") is not False
            and not any(isinstance(callback, ProgressBar) for callback in callbacks)
        ):
            added.append(StepBoundedProgressBar())
        if not sys.stdout.isatty():  # CI logs, nohup, SLURM: a bar draws nothing readable there
            added.append(ProgressLines(every_n_steps=trainer_config.get("log_every_n_steps") or 50))
        if added:
            kwargs.setdefault("callbacks", [*callbacks, *added])
        return super().instantiate_trainer(**kwargs)


class ConfigCheckCLI(DrafterCLI):
    """Parses a config and builds model and data, but no Trainer: checks GPU configs on any machine."""

    def before_instantiate_classes(self) -> None:
        """The trainer settings are checked; no run folder is chosen: nothing will be written."""
        check_trainer_settings(self.config, str(self.config.get("config", ["the config"])[-1]))

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
                "init_args": {"save_dir": "runs", "name": "drafter", "version": None, "default_hp_metric": False},
            },
        },
        **kwargs,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli = build_cli(argv)
    except (FileNotFoundError, RunFolderError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    trainer, system, data = cli.trainer, cli.model, cli.datamodule
    ckpt_path = cli.config.get("ckpt_path")
    before: float | None = None
    if cli.run_plan is not None and cli.run_plan.to_clear and process_rank() == 0:
        clear_run(cli.run_plan)  # --overwrite: only now that the config, model, data and trainer are built
        print(f"--overwrite: cleared {', '.join(cli.run_plan.to_clear)} from {cli.run_plan.folder}")
    try:
        if cli.config.get("validate_before") and ckpt_path is None and trainer.limit_val_batches != 0:
            results = trainer.validate(system, datamodule=data, verbose=False)
            before = results[0].get("val/tau_sim") if results else None
        trainer.fit(system, datamodule=data, ckpt_path=ckpt_path)
    except DatasetError as error:  # named by the data layer (shard, key, field); nothing was exported
        print(f"error: {error}", file=sys.stderr)
        end_process_group()
        return 2
    validates = trainer.limit_val_batches != 0 and data.config.num_val_shards + (data.config.val_dir is not None) > 0
    if validates and system.last_validated_step != trainer.global_step:  # the summary reports the final drafter
        trainer.validate(system, datamodule=data, verbose=False)
    log_dir = Path(trainer.log_dir or ".")  # a broadcast under DDP and DeepSpeed: every rank asks
    if trainer.is_global_zero:
        summarize(trainer, before, log_dir)
    end_process_group()
    return 0


def summarize(trainer: Any, before: float | None, log_dir: Path) -> None:
    """Print the simulated acceptance length before and after, and where logs and checkpoints are (rank 0 only:
    `log_dir` is `trainer.log_dir`, read by every rank before)."""
    metrics = trainer.callback_metrics
    after = metrics.get("val/tau_sim")
    after = float(after) if isinstance(after, torch.Tensor) else after
    lines = ["", "training finished:"]
    if after is not None:
        lines.append(
            "  simulated acceptance length (1 + sum_k prod_{i<=k} acc_i, the +1 is the bonus token): "
            + (f"{before:.3f} untrained -> " if before is not None else "")
            + f"{after:.3f} trained"
        )
    lines.append(f"  steps: {trainer.global_step}")
    checkpoint = last_checkpoint_callback(trainer)
    if checkpoint is not None and checkpoint.last_model_path:
        lines.append(f"  checkpoints: {Path(checkpoint.last_model_path).parent}")
    lines.append(f"  drafter: {log_dir / 'drafter'}")
    lines.append(f"  TensorBoard: tensorboard --logdir {log_dir}")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
