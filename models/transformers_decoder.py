"""Driving a transformers decoder stack with our KV cache, explicit positions and tree masks.

The Janus-Pro and Lumina-mGPT targets keep transformers' own decoder layers (attention, norms, MLP,
rotary) and run them one by one: the attention mask is our boolean mask over cache columns and new
tokens (`models.llamagen.build_attention_mask`), made additive; the layers' cache is `KVCacheWriter`,
which writes rotated keys into a `KVCache`, so the tree decoder may rearrange committed columns.

Shapes: R rows, T new tokens, S cache columns, D hidden size.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from models.kv_cache import KVCache
from models.llamagen import build_attention_mask
from models.target import Conditioning, DecoderTarget, TargetOutput


class DecoderStack(Protocol):
    """What we drive of a transformers base model (`LlamaModel`, `ChameleonModel`): its four parts.

    Read-only properties, so any module that has these submodules matches, whatever their concrete classes.
    """

    @property
    def embed_tokens(self) -> nn.Module: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Module: ...

    @property
    def rotary_emb(self) -> nn.Module: ...


class KVCacheWriter:
    """Stands in for transformers' `Cache` inside an attention layer: writes new keys/values into a `KVCache`."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """(R, H, T, E) new keys/values -> all keys/values of the row so far, (R, H, length + T, E)."""
        return self.cache.write(layer_idx, key_states, value_states)


def run_decoder_layers(
    language_model: DecoderStack,
    inputs: Tensor,
    positions: Tensor,
    cache: KVCache | None,
    tree_mask: Tensor | None,
    new_valid: Tensor | None,
    num_layers: int,
    aux_layer_ids: tuple[int, ...] = (),
) -> tuple[Tensor, Tensor | None]:
    """Run T new inputs through a transformers decoder (`layers`, `norm`, `rotary_emb`) over `cache`.

    Args:
        inputs: (R, T, D) input embeddings; positions: (T,) or (R, T) position ids.
        cache: the KV cache the new keys/values are written to and read with; None = the inputs are the whole
            sequence (no cache read or written).
        tree_mask: (T, T) or (R, T, T) bool among the new tokens, None = causal.
        new_valid: (R, T) bool, False for padding; None = all valid.
        aux_layer_ids: residual streams to return (index i = input of layer i, transformers'
            `hidden_states[i]`; i = num_layers is the post-norm output); () returns no aux.

    Returns:
        the post-norm hidden state (R, T, D) and the aux streams concatenated (R, T, len(ids) D) or None.
    """
    rows, length, _ = inputs.shape
    if new_valid is None:
        new_valid = torch.ones(rows, length, dtype=torch.bool, device=inputs.device)
    if positions.dim() == 1:
        positions = positions.expand(rows, length)
    allowed = build_attention_mask(new_valid, cache, tree_mask)  # (R, T, S) bool
    mask = torch.zeros(allowed.shape, dtype=inputs.dtype, device=inputs.device)
    mask = mask.masked_fill(~allowed, torch.finfo(inputs.dtype).min)[:, None]  # (R, 1, T, S) additive
    position_embeddings = language_model.rotary_emb(inputs, position_ids=positions)
    writer = None if cache is None else KVCacheWriter(cache)
    streams: dict[int, Tensor] = {}
    x = inputs
    for index, layer in enumerate(language_model.layers[:num_layers]):
        if index in aux_layer_ids:
            streams[index] = x
        out = layer(x, attention_mask=mask, position_ids=positions, cache=writer,
                    position_embeddings=position_embeddings)  # fmt: skip
        x = out[0] if isinstance(out, tuple) else out  # Chameleon layers return (hidden_states,)
    if cache is not None:
        cache.advance(new_valid)
    hidden = language_model.norm(x)
    streams[num_layers] = hidden  # transformers' hidden_states[L] is the post-norm output
    aux = torch.cat([streams[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return hidden, aux


SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that honour our additive 4-D tree/validity masks (flash-attention ignores them)."""


def check_attention_implementation(config: Any) -> None:
    """Refuse a transformers config whose attention implementation would ignore our 4-D masks."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} ignores our 4-D tree/validity masks; "
            f"load the model with attn_implementation one of {SUPPORTED_ATTENTION}"
        )


class TransformersDecoderTarget(DecoderTarget):
    """A target over a transformers language model (`language_model`: embed_tokens, layers, norm, rotary_emb).

    Subclasses set `language_model` and `_aux_layer_ids`, give `num_kv_heads` and `head_dim`, and implement
    `prompt_ids(prompts, cfg) -> (ids (R, C), valid (R, C))`, the image embedding and the image head.
    """

    language_model: DecoderStack
    _aux_layer_ids: tuple[int, ...]

    @property
    @abstractmethod
    def num_kv_heads(self) -> int:
        """Key/value heads per attention layer (the cache's head count)."""

    @property
    @abstractmethod
    def head_dim(self) -> int:
        """Width of one attention head (the cache's last dimension)."""

    def prompt_ids(self, prompts: list[str], cfg: bool) -> tuple[Tensor, Tensor]:
        """Token ids (R, C) of the [cond; uncond] prefix rows and which slots are valid (R, C)."""
        raise NotImplementedError

    @torch.no_grad()
    def condition(self, prompts: list[str], cfg: bool = True) -> Conditioning:
        ids, valid = self.prompt_ids(prompts, cfg)
        device = self.device
        ids, valid = ids.to(device), valid.to(device)
        embeds = self.language_model.embed_tokens(ids)
        positions = torch.arange(self.prefix_length, device=device)
        return Conditioning(embeds, valid, positions, len(prompts), cfg)

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        weight = self.image_head_weight()
        return KVCache.allocate(
            self.num_layers, rows, self.num_kv_heads, capacity, self.head_dim, dtype=weight.dtype, device=weight.device
        )

    def run_decoder(self, inputs: Tensor, positions: Tensor, cache: KVCache | None, tree_mask: Tensor | None,
                    new_valid: Tensor | None, return_aux: bool,
                    logits_at: Tensor | None = None) -> TargetOutput:  # fmt: skip
        aux_ids = self._aux_layer_ids if return_aux else ()
        hidden, aux = run_decoder_layers(
            self.language_model, inputs, positions, cache, tree_mask, new_valid, self.num_layers, aux_ids
        )
        return self.output(hidden, aux, logits_at)


def placement(device: torch.device | str | None, dtype: torch.dtype | str | None) -> tuple[torch.device, torch.dtype]:
    """Where and in what precision a target loads.

    device None = the CPU: a target goes to an accelerator only when its caller says which one. The
    Lightning path passes the trainer's root device (`DrafterSystem.setup` and `DrafterDataModule` through
    `models.registry.shared_target`: cuda:<local rank> as the strategy's cluster environment knows it, under
    torchrun and `srun` alike); scripts run outside Lightning pass `process_device()`. dtype None = bfloat16
    on GPU, float32 elsewhere; a string names a torch dtype ("bfloat16").
    """
    resolved = torch.device(device if device is not None else "cpu")
    named = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return resolved, named or (torch.bfloat16 if resolved.type == "cuda" else torch.float32)


LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
"""Where launchers put a process's rank on its node: torchrun's LOCAL_RANK, then srun's SLURM_LOCALID."""


def process_device() -> torch.device:
    """This process's GPU for a script launched outside Lightning (one process per GPU), else the CPU.

    cuda:<local rank> when CUDA is available, the local rank read from torchrun's LOCAL_RANK or srun's
    SLURM_LOCALID (0 when neither is set); the CPU otherwise. Training never calls this: a Lightning run
    places its target on the strategy's root device.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    for variable in LOCAL_RANK_VARIABLES:
        value = os.environ.get(variable)
        if value is not None and value.strip():
            return torch.device("cuda", int(value))
    return torch.device("cuda", 0)
