"""The drafter LightningModule: a thin system around drafter + frozen target.

    system = DrafterSystem(target="toy", architecture="eagle3", preset="toy")
    data = DrafterDataModule(train_dir="outputs/shards/toy", target="toy", num_val_shards=1)  # data.drafter_data
    Trainer(max_steps=200).fit(system, datamodule=data)

A reduced draft vocabulary (`drafter.draft_vocab_size` < the image vocabulary) is counted on the
dataset given as `vocab_dir` (fit.py links it to `data.train_dir`); the module never reaches into the
trainer's data module for it.

The drafter (`models.eagle.EagleDraftModel`) is built in `configure_model` from its config alone,
so checkpoints load without the target, and strategies that shard parameters (DeepSpeed ZeRO-3)
see it at the right time. The target is loaded in `setup` and kept outside the module tree
(`self.frozen_target` is a plain attribute): the strategy never wraps, trains or saves it. It is
loaded straight onto the trainer's root device (`trainer.strategy.root_device`: cuda:<local rank> as
the strategy's cluster environment reads it, under torchrun, srun or a single process; Lightning runs
`setup` before it moves the module, so the strategy's device is the one to ask), never from
environment variables; `target_options.device` may name that same device, nothing else. With
`data.features: online` it also computes each batch's states from its tokens before the step
(`on_after_batch_transfer`, `training.online_features`).

Every step's randomness (input noise, branch choice) comes from a generator seeded by
(seed, global step, micro-batch within the step, rank), so a run resumed from a checkpoint draws exactly
what an uninterrupted run draws, and the micro-batches of an accumulated step draw differently.

Logged: train/loss, train/ce_k, train/acc_k, train/tau_sim, train/convergent_fraction,
train/tokens_per_s, train/grad_norm, lr (LearningRateMonitor), val/loss, val/acc_k, val/tau_sim.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import grad_norm
from torch import Tensor

from inference.decoding.eagle import check_compatible
from models.eagle import EagleDraftModel, count_parameters, drafter_preset
from models.registry import shared_target, target_device
from models.target import ImageTarget
from training.objective import ObjectiveConfig, ObjectiveOutput, drafter_objective
from training.online_features import fill_step_features
from training.vocab import build_vocab_map

SCHEDULES = ("cosine", "linear", "constant")

# Lightning warns whenever a LightningModule overrides on_after_batch_transfer and a DataModule is passed, even
# when the DataModule leaves the hook alone (ours do): the module's hook is the one that runs, as intended here.
warnings.filterwarnings("ignore", message=r"You have overridden `on_after_batch_transfer` in `LightningModule`")


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW with linear warmup, then cosine or linear decay to min_lr_ratio x lr (docs/method.md, section
    "Recipes")."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    """cosine | linear | constant (after warmup)."""
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    """Steps of the schedule; None = the trainer's estimated stepping batches."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError(f"optimizer.lr must be > 0 and warmup_steps >= 0, got {self.lr}, {self.warmup_steps}")


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1 - min_ratio) * shape


class DrafterSystem(L.LightningModule):
    """Trains an EAGLE-1/EAGLE-3 drafter on extracted target features.

    Args:
        target: registry name of the target (`models.registry`); its embedding and head stay frozen.
        target_options: keyword arguments of its loader (janus-pro-7b: path, dtype, device, ...).
        architecture: eagle1 | eagle3.
        preset: drafter shape preset (`models.eagle.drafter_preset`): tiny, toy, texture, llamagen-xl, janus-pro-7b, ...
        drafter: overrides of DrafterConfig fields (e.g. draft_vocab_size, num_heads).
        objective: the loss recipe.
        optimizer: AdamW and its schedule.
        seed: seeds the weights and every step's noise.
        vocab_dir: the dataset whose token counts choose a reduced draft vocabulary (the training data;
            fit.py links data.train_dir); needed only when draft_vocab_size < the image vocabulary.
    """

    def __init__(
        self,
        target: str = "toy",
        target_options: dict[str, Any] | None = None,
        architecture: str = "eagle3",
        preset: str = "toy",
        drafter: dict[str, Any] | None = None,
        objective: ObjectiveConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        seed: int = 0,
        vocab_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.vocab_dir = vocab_dir
        self.target_name = target
        self.target_options = dict(target_options or {})
        self.drafter_config = drafter_preset(preset, architecture, **(drafter or {}))
        self.objective = objective or ObjectiveConfig()
        self.optimizer_config = optimizer or OptimizerConfig()
        self.seed = seed
        self.save_hyperparameters(
            {
                "target": target,
                "target_options": self.target_options,
                "drafter": asdict(self.drafter_config),
                "objective": asdict(self.objective),
                "optimizer": asdict(self.optimizer_config),
                "seed": seed,
            }
        )
        self.model: EagleDraftModel | None = None
        self.frozen_target: ImageTarget | None = None
        self._vocab_key: str | None = None
        self._last_batch_start: float | None = None
        self.last_validated_step: int | None = None
        self.last_checkpoint_step: int | None = None  # global step of the newest checkpoint written
        self._grad_norm_pending = False  # DeepSpeed: log the engine's gradient norm after this step

    # ------------------------------------------------------------------------- building

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = EagleDraftModel(self.drafter_config)

    @property
    def drafter(self) -> EagleDraftModel:
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return self.model

    def target_placement(self) -> torch.device | None:
        """The device this process's target goes to: the trainer's root device (`trainer.strategy.root_device`,
        the local rank's GPU under DDP and DeepSpeed, whichever launcher started the process), reconciled with
        `target_options.device` (`models.registry.target_device`); without a trainer, the options' device or None
        (the CPU).

        Raises:
            ValueError: when `target_options.device` names another device than the trainer's.
        """
        root = self._trainer.strategy.root_device if self._trainer is not None else None
        return target_device(self.target_options, root)

    def setup(self, stage: str) -> None:
        target = shared_target(self.target_name, self.target_options, device=self.target_placement())
        check_compatible(self.drafter, target)
        width = target.embed_image_tokens(torch.zeros(1, dtype=torch.long, device=target.device)).shape[-1]
        if width != self.drafter_config.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.drafter_config.hidden_size} != the target's embedding width {width}"
            )
        self.frozen_target = target
        config = self.drafter_config
        if config.draft_vocab != config.vocab_size and stage == "fit":
            self._prepare_vocab_map()

    def _prepare_vocab_map(self) -> None:
        """Build the reduced vocabulary from `vocab_dir` (fresh runs; a resumed run's key is checked on load)."""
        if self.vocab_dir is None:
            raise ValueError(
                f"drafter.draft_vocab_size={self.drafter_config.draft_vocab} < the image vocabulary "
                f"{self.drafter_config.vocab_size}: the reduced vocabulary is counted on the training data, so pass "
                "DrafterSystem(vocab_dir=<train_dir>) (training/fit.py links data.train_dir to it)"
            )
        d2t, t2d, key, coverage = build_vocab_map(self.vocab_dir, self.drafter_config.draft_vocab)
        self.drafter.set_vocab_map(d2t.to(self.drafter.d2t.device), t2d.to(self.drafter.t2d.device))
        self._vocab_key = key
        self.drafter_config = replace(self.drafter_config, vocab_map_key=key)
        self.drafter.config = self.drafter_config
        print(f"draft vocabulary: {self.drafter_config.draft_vocab} tokens cover {coverage:.1%} of {self.vocab_dir}")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["drafter_config"] = asdict(self.drafter.config)
        self.last_checkpoint_step = self.global_step

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("drafter_config", {}).get("vocab_map_key", "")
        current = self._vocab_key
        if saved and current and saved != current:
            raise ValueError(
                f"the checkpoint's draft vocabulary was counted on another dataset (key {saved[:12]}), not the "
                f"training data configured now (key {current[:12]}); train a new drafter for this data"
            )

    def on_fit_start(self) -> None:
        if self.frozen_target is not None and self.frozen_target.device != self.device:
            # set up before a trainer was attached (setup places it on the root device otherwise): one move
            self.frozen_target = self.frozen_target.to(self.device)
        if self.global_rank == 0:
            print(
                f"drafter: {self.drafter_config.architecture}, {count_parameters(self.drafter) / 1e6:.2f} M trainable "
                f"parameters, for target {self.target_name!r}"
            )

    # ------------------------------------------------------------------------- steps

    def _generator(self, micro_batch: int = 0) -> torch.Generator:
        """The step's random state: a function of (seed, optimizer step, micro-batch within the step, rank), so each
        micro-batch of an accumulated step and each rank draw their own noise and swaps, and a resumed run draws
        what an uninterrupted one does."""
        key = [self.seed, self.global_step, micro_batch, self.global_rank]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0] >> 1))
        return generator

    def _micro_batch(self, batch_idx: int) -> int:
        """Index of `batch_idx` within its optimizer step (0 .. accumulate_grad_batches - 1)."""
        accumulate = getattr(self.trainer, "accumulate_grad_batches", 1) if self._trainer is not None else 1
        return batch_idx % max(1, int(accumulate))

    def _transferred_micro_batch(self) -> int:
        """The micro-batch index of the training batch being moved to the device: Lightning transfers it before
        counting it, so its `training_step` will see batch_idx = the epoch loop's batch_idx + 1."""
        return self._micro_batch(self.trainer.fit_loop.epoch_loop.batch_idx + 1)

    def compute(self, batch: dict[str, Any], training: bool, micro_batch: int = 0) -> ObjectiveOutput:
        assert self.frozen_target is not None, "setup() loads the target"
        generator = self._generator(micro_batch) if training else None
        return drafter_objective(
            self.drafter, self.frozen_target, batch, self.objective, training=training, generator=generator
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Online features (`data.features: online`): the frozen target computes the batch's states from its tokens."""
        if isinstance(batch, dict) and batch.get("online_fields"):
            assert self.frozen_target is not None, "setup() loads the target"
            training = self._trainer is not None and self.trainer.training  # the swap mask: compute()'s generator
            generator = self._generator(self._transferred_micro_batch()) if training else None
            batch = fill_step_features(self.frozen_target, batch, self.objective, training, generator)
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        self._step_seconds = None if self._last_batch_start is None else now - self._last_batch_start
        self._last_batch_start = now

    def _logging_step(self) -> bool:
        """Whether this training step's values reach the logger (Lightning logs every log_every_n_steps)."""
        every = getattr(self.trainer, "log_every_n_steps", 1)  # set by Trainer.__init__ (not in its stubs)
        return (self.global_step + 1) % max(1, every) == 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        out = self.compute(batch, training=True, micro_batch=self._micro_batch(batch_idx))
        self._check_finite(out.loss, batch)
        size = len(batch["keys"])
        self.log("train/loss", out.loss.detach(), prog_bar=True, batch_size=size)
        if self._logging_step():  # the per-step metrics cost ~0.5 ms per self.log call: only when logged
            self._log_output("train", out, size)
            if self._step_seconds:
                self.log("train/tokens_per_s", out.tokens / self._step_seconds, batch_size=size)
        return out.loss

    def _check_finite(self, loss: Tensor, batch: dict[str, Any]) -> None:
        """Stop the run (every rank, before any export) at a NaN/Inf loss, naming the step and the batch's keys.

        One host read per step, which the progress bar's loss display pays anyway; under DDP the
        decision is reduced so all ranks stop together instead of waiting in the next all-reduce.
        """
        finite = bool(torch.isfinite(loss.detach()))
        if self._trainer is not None:
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            keys = ", ".join(str(key) for key in batch["keys"])
            raise FloatingPointError(
                f"the training loss is not finite ({float(loss.detach()):g} on this rank) at global step "
                f"{self.global_step}, batch {keys}; nothing was exported. Check these samples with "
                "`python -m data.extract --validate <train_dir>`, or lower optimizer.lr / raise gradient clipping"
            )

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = self.compute(batch, training=False)
        self._log_output("val", out, len(batch["keys"]))

    def _log_output(self, stage: str, out: ObjectiveOutput, size: int) -> None:
        on_step = stage == "train"
        logs: dict[str, Tensor] = {f"{stage}/tau_sim": out.tau}
        if stage != "train":
            logs[f"{stage}/loss"] = out.loss.detach()
        for name, values in (("ce", out.ce), ("feature", out.feature), ("cfg_ce", out.cfg_ce), ("acc", out.accuracy)):
            logs.update({f"{stage}/{name}_{k}": value for k, value in enumerate(values)})
        if out.convergent_fraction is not None:
            logs[f"{stage}/convergent_fraction"] = out.convergent_fraction
        self.log_dict(logs, on_step=on_step, on_epoch=not on_step, sync_dist=not on_step, batch_size=size)
        if stage != "train":
            self.log(f"{stage}/tau", out.tau, prog_bar=True, batch_size=size, sync_dist=True, logger=False)

    def on_validation_epoch_end(self) -> None:
        self.last_validated_step = self.global_step

    def _deepspeed_engine(self) -> Any:
        """The DeepSpeed engine when the strategy is DeepSpeed, else None."""
        if self._trainer is None:
            return None
        return getattr(self.trainer.strategy, "deepspeed_engine", None)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """train/grad_norm: the global L2 norm of the gradient the optimizer applies (before clipping).

        Single process and DDP: the parameters' (all-reduced) `.grad`. DeepSpeed ZeRO keeps gradients in its
        partitions and leaves `.grad` empty: there the engine's own global norm, read after its step
        (`on_train_batch_end`)."""
        self._grad_norm_pending = self._logging_step() and self._deepspeed_engine() is not None
        if not self._logging_step() or self._grad_norm_pending:
            return
        norms = grad_norm(self.drafter, norm_type=2)
        if norms:
            self.log("train/grad_norm", norms["grad_2.0_norm_total"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._grad_norm_pending:
            return
        self._grad_norm_pending = False
        norm = self._deepspeed_engine().get_global_grad_norm()  # computed over every rank's partition in its step
        if norm is not None:
            self.log("train/grad_norm", float(norm), rank_zero_only=True)

    # ------------------------------------------------------------------------- optimizer

    def configure_optimizers(self) -> Any:
        config = self.optimizer_config
        parameters = [p for p in self.drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        total = config.total_steps or int(self.trainer.estimated_stepping_batches)
        schedule = functools.partial(
            lr_factor, warmup=config.warmup_steps, total=total, schedule=config.schedule, min_ratio=config.min_lr_ratio
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------- export

    def export_drafter(self, folder: str | Path) -> Path:
        """Write the drafter alone (config.json + model.safetensors), loadable by
        `inference.decoding.eagle.EagleDrafter`."""
        return self.drafter.save_pretrained(folder)
