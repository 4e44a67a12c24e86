"""Online features: the frozen target recomputes a batch's states from its tokens before the drafter step.

    python training/fit.py --config demo --data.features online      # token-only or full datasets alike

With `data.features: online` the DataModule reads only the image tokens and the prompt of each sample
and lists the streams the objective needs in `batch["online_fields"]` (hidden, and as configured aux,
uncond_hidden, uncond_aux). `DrafterSystem.on_after_batch_transfer` then runs
`models.target.teacher_forced_states`, the computation extraction records, so the streams equal the
stored ones up to the storage dtype (tests/test_training_online.py measures it on every target family).

The forward does only the work the step reads. Its rows are the B conditional rows and the
unconditional rows of the samples whose unconditional states the objective reads
(`training.objective.uncond_samples_read`): every sample where both branches train or evaluate
(`cfg_loss_weight` > 0, validation), the samples swapped to their unconditional branch in a training
step with `uncond_rate` > 0 (the swap is drawn before the forward, from the step's generator, and
passed on as `batch["uncond_swap"]`), none otherwise. The unconditional streams keep their (B, L, .)
shape; the rows of samples not computed hold NaN, so a reader that was not meant to see them fails
loudly (`DrafterSystem` stops at a non-finite loss) instead of training on made-up states.

The target is the one `DrafterSystem` already holds for its embedding and head (`shared_target`: one
copy per process, also serving `DecodeValidation`): frozen, in eval mode, in its own dtype, never a
submodule, so no optimizer, checkpoint, export or ZeRO partitioning ever sees it. Its forward runs
under no_grad and asks for no logits (the objective applies the head to the rows it reads).

Shapes: B samples, L tokens (the batch's longest sample), D hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.target import ImageTarget, teacher_forced_states
from training.objective import ObjectiveConfig, draw_uncond_swap, uncond_samples_read

ONLINE_FIELDS = ("hidden", "aux", "uncond_hidden", "uncond_aux")


def fill_online_features(
    target: ImageTarget, batch: dict[str, Any], uncond_samples: Tensor | None = None
) -> dict[str, Any]:
    """Add the streams named in `batch["online_fields"]` to `batch` (in place, and returned); others pass as they are.

    Args:
        target: the frozen target, on the batch's device.
        batch: a DataModule batch: tokens (B, L) int64, prompts (B strings, "" for padding rows),
            online_fields (names from ONLINE_FIELDS).
        uncond_samples: (B,) bool, the samples whose unconditional streams are computed; None = every sample.

    Returns:
        The batch with hidden (B, L, D) and the other named streams, in the target's dtype. Padding
        rows get states too (from an empty prompt); their loss_mask is all False. Unconditional streams
        are NaN in the rows of samples `uncond_samples` leaves out.
    """
    names = batch.get("online_fields")
    if not names:
        return batch
    unknown = sorted(set(names) - set(ONLINE_FIELDS))
    if unknown or "hidden" not in names:
        raise ValueError(f"online_fields {names} must include 'hidden' and name only {ONLINE_FIELDS}")
    aux, uncond = "aux" in names or "uncond_aux" in names, "uncond_hidden" in names or "uncond_aux" in names
    some: bool | Tensor = uncond
    if uncond and uncond_samples is not None:
        some = uncond_samples.to(device=target.device, dtype=torch.bool)
    states = teacher_forced_states(target, list(batch["prompts"]), batch["tokens"], aux=aux, uncond=some)
    computed = states.fields()
    if isinstance(some, Tensor):  # S rows -> B rows, NaN where not computed
        for name in ("uncond_hidden", "uncond_aux"):
            if name in computed:
                rows = computed[name]
                full = rows.new_full((some.shape[0], *rows.shape[1:]), float("nan"))
                computed[name] = full.index_copy_(0, some.nonzero().squeeze(1), rows)
    for name in names:
        if name not in computed:
            raise ValueError(f"target {target.name!r} computed no {name!r} stream for online features")
        batch[name] = computed[name]
    return batch


def fill_step_features(
    target: ImageTarget,
    batch: dict[str, Any],
    objective: ObjectiveConfig,
    training: bool,
    generator: torch.Generator | None,
) -> dict[str, Any]:
    """`fill_online_features` for one step of `objective`: unconditional rows only for the samples it reads.

    A training step with uncond_rate > 0 draws its swap mask first (`draw_uncond_swap`, from the step's
    `generator`, seeded as the objective's) and stores it as batch["uncond_swap"], which the objective then
    uses. Batches without online fields pass unchanged.
    """
    if not batch.get("online_fields"):
        return batch
    rows = batch["tokens"].shape[0]
    swap = draw_uncond_swap(objective, rows, generator) if training else None
    if swap is not None:
        batch["uncond_swap"] = swap.to(batch["tokens"].device)
    return fill_online_features(target, batch, uncond_samples_read(objective, rows, training, swap))
