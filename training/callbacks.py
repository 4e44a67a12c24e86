"""Real acceptance length during training: decode held-out prompts with the drafter being trained.

    callbacks: [{class_path: training.callbacks.DecodeValidation, init_args: {num_prompts: 8}}]

At every validation (and so whenever ModelCheckpoint evaluates), `DecodeValidation` loads the
current drafter weights into the tree decoder, generates images for K held-out prompts with AR
sampling and with each configured rule (same prompts, same seeds), and logs

    decode/tau_<rule>              accepted draft tokens + 1 per target forward (the +1 is the bonus token)
    decode/target_forwards_<rule>  target forwards per image (AR: one per token)
    decode/fidelity_<rule>, decode/fidelity_ar   prompt fidelity read back from the pixels (embedded worlds)
    decode/grid                    an image grid: one row per method (AR first), one column per prompt

Under DDP the prompts are split across ranks and the sums all-reduced; under DeepSpeed ZeRO-3 the
drafter's parameters are gathered first. The frozen target is the system's plain attribute, never
wrapped by the strategy. Its cost (prompts x (rules + AR) decodes) is printed once and logged as
decode/seconds; `every_n_validations: 0` switches it off. ModelCheckpoint can monitor
`decode/tau_cascade` (peers found that loss keeps falling after tau peaks).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar

from inference.decoding.autoregressive import generate_ar
from inference.decoding.eagle import EagleDrafter
from inference.decoding.generate import build_rule, image_grid
from inference.decoding.rules import RULES
from inference.decoding.speculative import DecoderConfig, generate_speculative
from models.target import ImageTarget
from models.worlds import embedded_world


def gathered_parameters(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Under DeepSpeed ZeRO-3 (parameters sharded across ranks) gather `module`'s full parameters for
    reading; a collective, so every rank must enter it. A no-op for unsharded modules."""
    parameters = list(module.parameters())
    if parameters and hasattr(parameters[0], "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
    return contextlib.nullcontext()


def held_out_prompts(target: ImageTarget, count: int, seed: int) -> list[str]:
    """K prompts the drafter never trained on: the held-out captions of the target's embedded world (toy,
    texture; the toy's for the tiny LlamaGen-family test targets), else PartiPrompts."""
    from data.prompts import PromptSetConfig, load_prompts

    world = embedded_world(target.name)
    if world is not None:
        source = PromptSetConfig(source=world.name, split="heldout", count=count, seed=seed)
    elif target.family == "llamagen" and target.name.startswith(("toy", "tiny")):
        source = PromptSetConfig(source="toy", split="heldout", count=count, seed=seed)
    else:
        source = PromptSetConfig(source="parti", count=count, seed=seed)
    return [prompt.text for prompt in load_prompts(source)]


class DecodeValidation(Callback):
    """Decode held-out prompts with the current drafter at validation; log tau per rule, fidelity and a grid.

    Args:
        rules: verification rules to run (`inference.decoding.rules.RULES`; built by
            `inference.decoding.generate.build_rule`).
        num_prompts: K held-out prompts per evaluation, split across ranks.
        every_n_validations: run at every n-th validation (0 = off); always after the last training step.
        tree: "static" (the target's default static tree, sampled drafts: the decoder's default), "dynamic" (EAGLE-2:
            top_k, depth, total_tokens, deterministic drafts) or "dynamic-sampled".
        top_k, depth, total_tokens: the dynamic trees.
        seed: fixes prompts and sampling, so evaluations differ only by the drafter.
        log_images: add the image grid to TensorBoard.
    """

    def __init__(
        self,
        rules: list[str] | None = None,
        num_prompts: int = 8,
        every_n_validations: int = 1,
        tree: str = "static",
        top_k: int = 8,
        depth: int = 5,
        total_tokens: int = 40,
        seed: int = 0,
        log_images: bool = True,
    ) -> None:
        super().__init__()
        self.rules = list(rules or ["exact", "cascade"])
        unknown = [name for name in self.rules if name not in RULES]
        if unknown:  # checked when the run starts, not after its first training interval
            raise ValueError(f"DecodeValidation rules {unknown} are unknown; known rules: {', '.join(RULES)}")
        self.num_prompts = num_prompts
        self.every_n_validations = every_n_validations
        self.decoder = DecoderConfig(tree=tree, top_k=top_k, depth=depth, total_tokens=total_tokens)
        self.seed = seed
        self.log_images = log_images
        self._validations = 0
        self._announced = False
        self._reader: Any = None
        self._no_reader = False  # the target's world ships no reader: warned once, fidelity left out
        self._warned_no_decoder = False

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or self.every_n_validations <= 0:
            return
        self._validations += 1
        last = trainer.global_step >= (trainer.max_steps if trainer.max_steps > 0 else float("inf"))
        if (self._validations - 1) % self.every_n_validations and not last:
            return
        for key, value in self.evaluate(trainer, pl_module).items():
            pl_module.log(key, value, rank_zero_only=True)

    @torch.no_grad()
    def evaluate(self, trainer: Any, pl_module: Any) -> dict[str, float]:
        """Decode on every rank (a collective: all ranks must call it); returns the reduced metrics."""
        target: ImageTarget = pl_module.frozen_target
        rules = {name: build_rule(name, target) for name in self.rules}
        prompts = held_out_prompts(target, self.num_prompts, self.seed)
        rank, world = trainer.global_rank, trainer.world_size
        mine = prompts[rank::world]  # (K / W) prompts on this rank
        started = time.perf_counter()
        reader = self._scene_reader(target)
        # every rank reduces the same keys, also a rank left without prompts (more ranks than prompts)
        sums = {"count": float(len(mine)), "target_forwards_ar": 0.0}
        for name in rules:
            sums.update({f"tau_{name}": 0.0, f"steps_{name}": 0.0, f"target_forwards_{name}": 0.0})
        if reader is not None:
            sums.update({f"fidelity_{name}": 0.0 for name in ["ar", *rules]})
        rows: list[np.ndarray] = []
        tokens: list[torch.Tensor] = []  # per method (AR first): (K / W, G) image tokens
        with gathered_parameters(pl_module.drafter), _eval_mode(pl_module.drafter):  # ZeRO-3: every rank
            if mine:
                drafter = EagleDrafter(pl_module.drafter, target)
                ar = generate_ar(target, mine, generator=self._generator(target, rank))
                sums["target_forwards_ar"] = float(ar.target_forwards) * len(mine)
                tokens.append(ar.tokens)
                for name, rule in rules.items():
                    result = generate_speculative(
                        target, drafter, mine, rule, self.decoder, generator=self._generator(target, rank)
                    )
                    steps, plus_one = result.tally()
                    sums[f"tau_{name}"] = plus_one
                    sums[f"steps_{name}"] = float(steps)
                    sums[f"target_forwards_{name}"] = float(result.target_forwards) * len(mine)
                    tokens.append(result.tokens)
        if mine:
            images = self._decode(target, tokens) if (self.log_images or reader is not None) else None
            if images is not None:
                if reader is not None:
                    for name, pictures in zip(["ar", *rules], images, strict=True):
                        sums[f"fidelity_{name}"] = reader.fidelity(torch.as_tensor(pictures), mine) * len(mine)
                rows = [np.asarray(pictures) for pictures in images]
        seconds = time.perf_counter() - started
        totals = self._all_reduce(trainer, sums)
        count = max(totals["count"], 1.0)
        metrics = {"decode/seconds": seconds}
        for name in ["ar", *rules]:
            if name != "ar":
                metrics[f"decode/tau_{name}"] = totals[f"tau_{name}"] / max(totals[f"steps_{name}"], 1.0)
            metrics[f"decode/target_forwards_{name}"] = totals[f"target_forwards_{name}"] / count
            if f"fidelity_{name}" in totals:
                metrics[f"decode/fidelity_{name}"] = totals[f"fidelity_{name}"] / count
        if trainer.is_global_zero:
            if not self._announced:
                print(
                    f"decode validation: {len(prompts)} prompts x ({len(rules)} rules + AR) in {seconds:.1f} s "
                    f"per evaluation on rank 0 (DecodeValidation.every_n_validations: 0 turns it off)"
                )
                self._announced = True
            if self.log_images and rows:
                self._log_grid(trainer, rows)
        return metrics

    # ------------------------------------------------------------------------- helpers

    def _decode(self, target: ImageTarget, tokens: list[torch.Tensor]) -> list[Any] | None:
        """Pixels per method, or None (said once) for a target loaded without its image decoder."""
        try:
            return [target.decode_images(method_tokens) for method_tokens in tokens]
        except NotImplementedError as error:  # e.g. Lumina-mGPT without vqgan_path: tau is still measured
            if not self._warned_no_decoder:
                warnings.warn(f"DecodeValidation logs tau without images: {error}", stacklevel=2)
                self._warned_no_decoder = True
            return None

    def _generator(self, target: ImageTarget, rank: int) -> torch.Generator:
        generator = torch.Generator(device=target.device)
        generator.manual_seed(self.seed * 7919 + rank)
        return generator

    @staticmethod
    def _all_reduce(trainer: Any, sums: dict[str, float]) -> dict[str, float]:
        if trainer.world_size == 1:
            return sums
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=trainer.strategy.root_device)
        values = trainer.strategy.reduce(values, reduce_op="sum")
        return dict(zip(keys, values.tolist(), strict=True))

    def _scene_reader(self, target: ImageTarget) -> Any:
        """The scene reader of the target's embedded world (fidelity); None for targets no reader can read."""
        world = embedded_world(target.name)
        if self._reader is None and world is not None and not self._no_reader:
            try:
                self._reader = world.scene_reader()
            except FileNotFoundError as error:  # a world whose reader is not shipped yet: decode without fidelity
                warnings.warn(f"DecodeValidation logs no decode/fidelity_*: {error}", stacklevel=2)
                self._no_reader = True
        return self._reader

    def _log_grid(self, trainer: Any, rows: list[np.ndarray]) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_image"):
            return
        columns = rows[0].shape[0]
        grid = image_grid(np.concatenate(rows), columns=columns, scale=2)  # rows: AR, then each rule
        experiment.add_image("decode/grid", np.asarray(grid), global_step=trainer.global_step, dataformats="HWC")


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module):  # type: ignore[no-untyped-def]
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


class StepBoundedProgressBar(RichProgressBar):
    """Lightning's rich progress bar, without "Epoch 6/-2" when training is bounded by max_steps.

    A run bounded by `max_steps` has `max_epochs = -1`, which the rich bar prints as the last epoch
    `-2`; such runs show the epoch alone (the bar itself counts the steps).
    """

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)


class ProgressLines(Callback):
    """A plain line every `every_n_steps` training steps, for logs that are not a terminal (CI, nohup, SLURM).

    A progress bar draws nothing useful into a file; this prints, on global rank 0,

        step 200/1200  loss 3.2140  tau_sim 1.512  2.13 steps/s  7 min 49 s left

    where tau_sim is the latest validation's simulated acceptance length (- before the first), steps/s
    counts this run's steps since training started, and the time left is (max_steps - step) / rate.
    It reads the loss from the host once per line, never in between.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        super().__init__()
        self.every_n_steps = max(1, every_n_steps)
        self._start: tuple[float, int] | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not trainer.is_global_zero or self._start is None:
            return
        seconds, first = time.perf_counter() - self._start[0], self._start[1]
        rate = (step - first) / seconds if seconds > 0 else 0.0
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        tau = trainer.callback_metrics.get("val/tau_sim")
        parts = [f"step {step}/{total}" if total else f"step {step}", f"loss {float(loss):.4f}"]
        parts.append(f"tau_sim {float(tau):.3f}" if tau is not None else "tau_sim -")
        parts.append(f"{rate:.2f} steps/s")
        if total and rate > 0:
            left = int((total - step) / rate)
            parts.append(f"{left // 60} min {left % 60} s left")
        print("  ".join(parts), flush=True)
