"""A trained EAGLE-1/EAGLE-3 draft head, wired to its target, as a tree-decoder `Drafter`.

    drafter = EagleDrafter.from_pretrained("runs/demo/version_0/drafter", target)
    drafter = EagleDrafter.from_pretrained("my-org/eagle3-toy", target)   # a Hub repo (python -m training.export)
    result = generate_speculative(target, drafter, prompts, CascadeRule())

The drafter attends only to image elements, exactly as it was trained on extracted features: the
caption reaches it through the target features (row 0 is the last prefix slot's state), so
`prefill` adds nothing to its cache.

Shapes: R rows, T new elements, S cache columns, H drafter hidden size, Df feature width, V image vocabulary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inference.decoding.drafter import DraftOutput, build_draft_attention_mask, tree_attention_mask
from models.eagle import CONFIG_NAME, WEIGHTS_NAME, EagleDraftModel
from models.eagle_fused import FusedDraftStep
from models.kv_cache import KVCache
from models.target import Conditioning, ImageTarget, TargetOutput

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # "org/name", as the Hub spells repo ids


def resolve_drafter_folder(
    name: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """A local drafter folder for `name`: the folder itself, or a Hub repo id's snapshot.

    A `Path`, an existing path, or a string that is not of the form "org/name" is a local folder
    (`EagleDraftModel.from_pretrained` reports what is missing). Otherwise the repo's config.json and
    model.safetensors are fetched with `huggingface_hub.snapshot_download` into the Hub cache; with
    HF_HUB_OFFLINE=1 the cached snapshot is used, and a repo never fetched is an error saying so.
    """
    if isinstance(name, Path) or Path(name).exists() or not REPO_ID.fullmatch(name) or ".." in name:
        return Path(name)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            name, revision=revision, cache_dir=cache_dir, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME]
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        raise FileNotFoundError(
            f"{Path(name) / CONFIG_NAME} not found: a drafter folder holds {CONFIG_NAME} and {WEIGHTS_NAME}; "
            f"as a Hub repo id, {name} could not be fetched either: {error}"
        ) from error
    return Path(folder)  # type: ignore[arg-type]


def check_compatible(model: EagleDraftModel, target: ImageTarget) -> None:
    """Refuse a drafter whose shapes do not fit `target`, naming the field and both values."""
    config = model.config
    problems = []
    if config.vocab_size != target.image_vocab_size:
        problems.append(f"vocab_size {config.vocab_size} vs the target's image vocabulary {target.image_vocab_size}")
    if config.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {config.target_hidden_size} vs the target's hidden size {target.hidden_size}"
        )
    if config.architecture == "eagle3" and config.num_aux_layers != len(target.aux_layer_ids):
        problems.append(
            f"num_aux_layers {config.num_aux_layers} vs the target's {len(target.aux_layer_ids)} aux layers"
        )
    if problems:
        raise ValueError(
            f"drafter built for target {config.target!r} does not fit {target.name!r}: " + "; ".join(problems)
        )


class EagleDrafter:
    """`inference.decoding.drafter.Drafter` over an `EagleDraftModel` and the target's frozen embedding and head."""

    reads_attention_mask = True  # `forward` uses the decoder's attention mask whenever given (no tree_mask then)

    def __init__(self, model: EagleDraftModel, target: ImageTarget) -> None:
        check_compatible(model, target)
        self.model = model.eval()
        self.step = FusedDraftStep(self.model)  # the same computation in fewer ops (models.eagle_fused)
        self._run_step: Callable[..., Tensor] = self.step.run  # (fused weights, inputs...), or its compiled form
        self.target = target
        self.feature_source = "hidden" if model.config.architecture == "eagle1" else "aux"

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        target: ImageTarget,
        *,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
    ) -> EagleDrafter:
        """Load a drafter folder (config.json + model.safetensors) or a Hub repo id onto the target's device.

        `revision` and `cache_dir` apply to Hub repos only (`resolve_drafter_folder`).
        """
        local = resolve_drafter_folder(folder, revision=revision, cache_dir=cache_dir)
        return cls(EagleDraftModel.from_pretrained(local, map_location=target.device), target)

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        config = self.model.config
        weight = self.model.fc.weight
        return KVCache.allocate(1, rows, config.kv_heads, capacity, config.head_dim, weight.dtype, weight.device)

    def prefill(self, conditioning: Conditioning, target_prefix: TargetOutput, cache: KVCache) -> None:
        """Nothing to do: the drafter's context is image elements only (see the module docstring)."""

    @torch.no_grad()
    def forward(
        self,
        features: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        *,
        from_target: bool,
        valid: Tensor | None = None,
        tree_start: int | None = None,
        tree_mask: Tensor | None = None,
        logits_at: Tensor | None = None,
        cfg_scale: float | None = None,
        attention_mask: Tensor | None = None,
        position_encoding: tuple[Tensor, Tensor] | None = None,
    ) -> DraftOutput:
        if attention_mask is not None:  # built by the decoder (a static tree's level), an additive bias
            mask = attention_mask
        elif valid is None and tree_mask is not None and tree_start is not None:  # a tree level: all nodes valid
            mask = tree_attention_mask(cache, tree_start, tree_mask)  # (R, T, S)
        else:
            if valid is None:
                valid = torch.ones_like(tokens, dtype=torch.bool)
            mask = build_draft_attention_mask(cache, valid, tree_start, tree_mask)
        weights = self.step.weights()  # checked once a call: the check walks every parameter (~20 us here)
        hidden = self._run_step(weights, self.target.embed_image_tokens(tokens), features, positions, mask,
                                from_target=from_target, cache=cache, rotary=position_encoding)  # fmt: skip
        # a level under the decoder's whole-tree mask: no one reads these columns' validity before the truncation
        cache.advance(tokens.shape[1] if valid is None else valid, mark_valid=attention_mask is None)
        wanted = hidden  # (R, T', H)
        if logits_at is not None:
            wanted = hidden[torch.arange(hidden.shape[0], device=hidden.device), logits_at][:, None]
        logits, guided = self.step.draft_logits(wanted, self.image_head, cfg_scale, weights)  # (R or B, T', Vd)
        return DraftOutput(self.model.to_image_vocab(logits).float(), hidden, guided)

    def position_encodings(self, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The rotary (cos, sin) of every column of positions (R, L) at once, for `forward`'s
        `position_encoding` when all its elements sit at that column's position (`Drafter`)."""
        return self.step.rotary_per_column(positions)

    def compile(self, **options: Any) -> None:
        """Run the drafter step's tensor part through `torch.compile(step.run, **options)`
        (`inference.decoding.compiled`); the check that rebuilds the fused weights stays eager, outside the graph."""
        self._run_step = torch.compile(self.step.run, **options)

    def image_head(self, hidden: Tensor) -> Tensor:
        weight = self.target.image_head_weight()
        return self.target.image_head(hidden.to(weight.dtype))
