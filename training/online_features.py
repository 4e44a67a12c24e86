"""Online features: the frozen target recomputes a batch's states from its tokens before the drafter step.

    python training/fit.py --config demo --data.features online      # token-only or full datasets alike

With `data.features: online` the DataModule reads only the image tokens and the prompt of each sample
and lists the streams the objective needs in `batch["online_fields"]` (hidden, and as configured aux,
uncond_hidden, uncond_aux). `DrafterSystem.on_after_batch_transfer` then runs
`models.target.teacher_forced_states`: one teacher-forced forward of the target over [cond; uncond]
rows, the same computation extraction records, so the streams equal the stored ones up to the
storage dtype (tests/test_training_online.py measures it on every target family).

The target is the one `DrafterSystem` already holds for its embedding and head (`shared_target`: one
copy per process, also serving `DecodeValidation`): frozen, in eval mode, in its own dtype, never a
submodule, so no optimizer, checkpoint, export or ZeRO partitioning ever sees it. Its forward runs
under no_grad and asks for no logits (the objective applies the head to the rows it reads).

Shapes: B samples, L tokens (the batch's longest sample), D hidden size.
"""

from __future__ import annotations

from typing import Any

from models.target import ImageTarget, teacher_forced_states

ONLINE_FIELDS = ("hidden", "aux", "uncond_hidden", "uncond_aux")


def fill_online_features(target: ImageTarget, batch: dict[str, Any]) -> dict[str, Any]:
    """Add the streams named in `batch["online_fields"]` to `batch` (in place, and returned); others pass as they are.

    Args:
        target: the frozen target, on the batch's device.
        batch: a DataModule batch: tokens (B, L) int64, prompts (B strings, "" for padding rows),
            online_fields (names from ONLINE_FIELDS).

    Returns:
        The batch with hidden (B, L, D) and the other named streams, in the target's dtype. Padding
        rows get states too (from an empty prompt); their loss_mask is all False.
    """
    names = batch.get("online_fields")
    if not names:
        return batch
    unknown = sorted(set(names) - set(ONLINE_FIELDS))
    if unknown or "hidden" not in names:
        raise ValueError(f"online_fields {names} must include 'hidden' and name only {ONLINE_FIELDS}")
    aux, uncond = "aux" in names or "uncond_aux" in names, "uncond_hidden" in names or "uncond_aux" in names
    states = teacher_forced_states(target, list(batch["prompts"]), batch["tokens"], aux=aux, uncond=uncond)
    computed = states.fields()
    for name in names:
        if name not in computed:
            raise ValueError(f"target {target.name!r} computed no {name!r} stream for online features")
        batch[name] = computed[name]
    return batch
