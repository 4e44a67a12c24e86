"""Janus-Pro (DeepSeek) behind the `ImageTarget` interface, wrapping transformers' `JanusForConditionalGeneration`.

    target = JanusTarget.from_pretrained("deepseek-community/Janus-Pro-7B")   # or a local folder
    conditioning = target.condition(["a red fox in the snow"])               # [cond; uncond] rows

Only the image-generation path of the model is used:

- input: an image token goes through `generation_embeddings` (16384 x 8) then `generation_aligner`
  (Linear -> GELU -> Linear to the LLM width), transformers' `prepare_embeddings_for_image_generation`,
  the original repo's `gen_aligner(gen_embed(ids))`;
- output: `generation_head` (`proj_out` -> GELU -> `vision_head`, the original `gen_head`) over the
  language model's post-norm last hidden state; the text `lm_head` is never used;
- prompt: the official "deepseek" format `<|User|>: {prompt}\\n\\n<|Assistant|>:` tokenized without
  special tokens, then BOS in front and `<begin_of_image>` (BOI) behind, as the original sampler's
  `tokenizer.encode(sft_format + image_start_tag)` builds it;
- CFG: the unconditional row of a prompt is the same row with every token except BOS and BOI
  replaced by the pad token (original `tokens[i, 1:-1] = pad_id`; transformers masks by value,
  which is the same for real prompts); the pad tokens that replace the prompt are attended to;
- sampling: guidance 5, temperature 1, no top-k / top-p (official `generation_inference.py`);
- geometry: `vision_config.num_image_tokens` tokens (576 = 24 x 24 for the real model), raster
  order, decoded by the model's VQ decoder (`vqmodel.decode`) to
  `num_patches * 2 ** (len(channel_multiplier) - 1)` pixels a side (384 for the real model).

Prefix layout: every prompt is left-padded to a fixed `max_prompt_tokens` = C slots (padded slots
invalid), and the prefix uses positions 0 .. C-1 in every row, so image token j sits at position
C + j whatever the prompt length. Rotary attention depends on position differences only, so this
equals the unpadded prompt at 0 .. n-1 (and it is exactly what transformers' own image `generate`
does with a left-padded batch: positions `arange` over the padded length).

Design choice: we run the language model's decoder layers ourselves, but with transformers' own
modules. `run_decoder` (`models.transformers_decoder.run_decoder_layers`) calls each `LlamaDecoderLayer` in turn with
(a) `position_embeddings` from the model's own `rotary_emb` at our explicit positions, (b) a 4-D
additive float mask (R, 1, T, S) built from the cache's `column_valid`, the new tokens' validity and
the optional tree mask (every token always sees itself), and (c) a tiny adapter in place of
transformers' `Cache` whose `update()` writes into our `KVCache` and returns every key/value so far.
Keys are stored after rotary, so `KVCache.keep_columns` / `truncate` / `compact` may move or drop
columns freely. This keeps transformers' attention math, RMSNorm, MLP and rotary variants (whatever
the Llama config says) while the positions, the mask and the cache stay ours, and it gives the
EAGLE-3 streams directly (the residual stream entering layer i, transformers' `hidden_states[i]`).
Driving `LlamaModel` with a `DynamicCache` instead was rejected: its cache has no notion of invalid
or rearranged columns, and its hidden-state capture does not fit per-step aux recording. The
additive 4-D mask needs the "sdpa" or "eager" attention implementation (flash-attention ignores
such masks), which the constructor checks.

Shapes: B prompts, R rows (2B with CFG), T new tokens, C prompt slots, S cached + new columns,
D hidden size, V image vocabulary (VQ codebook), G image tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import Tensor

from models.target import ImageGeometry, SamplingDefaults, resolve_aux_layer_ids
from models.transformers_decoder import TransformersDecoderTarget, check_attention_implementation, placement

if TYPE_CHECKING:
    from transformers import JanusForConditionalGeneration, PreTrainedConfig

JANUS_SAMPLING = SamplingDefaults(cfg_scale=5.0, temperature=1.0, top_k=None, top_p=None)
"""Official Janus-Pro image sampling: cfg_weight 5, temperature 1, no truncation."""
PROMPT_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
"""The "deepseek" SFT format with an empty system prompt and an open assistant turn."""
BOI_TOKEN = "<begin_of_image>"
DEFAULT_HUB_ID = "deepseek-community/Janus-Pro-7B"
"""The transformers-format conversion (the 1B one, deepseek-community/Janus-Pro-1B, is used in its docs)."""


class JanusTarget(TransformersDecoderTarget):
    """Janus-Pro's image generation through our KV cache, positions and tree masks."""

    family = "janus"

    def __init__(
        self,
        model: JanusForConditionalGeneration,
        tokenizer: Any,
        name: str = "janus-pro-7b",
        sampling: SamplingDefaults = JANUS_SAMPLING,
        max_prompt_tokens: int = 128,
        aux_layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        """Wrap a loaded model and its tokenizer.

        Args:
            model: a `JanusForConditionalGeneration` (any size; real or tiny random).
            tokenizer: its tokenizer (callable like a transformers tokenizer, with `bos_token_id`,
                `pad_token_id` and a `<begin_of_image>` token); ids fall back to the model's
                generation config where the tokenizer lacks them.
            name: the target's name.
            sampling: the sampling defaults (official: CFG 5, temperature 1).
            max_prompt_tokens: C, the prompt slots every row is left-padded to (BOS and BOI included).
            aux_layer_ids: residual streams for EAGLE-3 (index i = input of layer i, transformers'
                `hidden_states[i]`; i = num_layers is the post-norm output); None = (2, L // 2, L - 3).
        """
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.sampling = sampling
        language_model = model.model.language_model
        self.language_model = language_model
        text_config: PreTrainedConfig = language_model.config  # the Llama config it was built from
        check_attention_implementation(text_config)
        self._text_config = text_config
        vq_config: Any = model.config.vq_config
        vision_config: Any = model.config.vision_config
        self._vq_config = vq_config
        self._aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, text_config.num_hidden_layers)
        if max_prompt_tokens < 2:
            raise ValueError(f"max_prompt_tokens must leave room for BOS and BOI, got {max_prompt_tokens}")
        self._prefix_length = int(max_prompt_tokens)
        self.bos_id, self.boi_id, self.pad_id = self._special_ids(model, tokenizer)

        num_tokens = vision_config.num_image_tokens
        side = math.isqrt(num_tokens)
        patches = vq_config.num_patches
        if side * side != num_tokens or side != patches:
            raise ValueError(
                f"vision_config.num_image_tokens={num_tokens} must be the square of vq_config.num_patches={patches} "
                "(the VQ decoder's latent grid)"
            )
        pixels = patches * 2 ** (len(vq_config.channel_multiplier) - 1)
        self.geometry = ImageGeometry(grid=(side, side), image_size=(pixels, pixels))

    def to(self, device: torch.device | str) -> Self:
        """Move the whole model to `device`: the language model, the generation embedding, aligner and head, the
        VQ model (decoder and codebook) and the vision tower; the float32 rotary frequencies stay float32."""
        self.model.to(device)  # type: ignore[arg-type]  # transformers wraps `to`: mypy sees no self
        return self

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        path: str = DEFAULT_HUB_ID,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> JanusTarget:
        """Load a transformers-format Janus(-Pro) checkpoint and its tokenizer from a local folder or hub id.

        Args:
            path: folder with `config.json`, the weights and the tokenizer files, or a hub id.
            dtype: weights' dtype; None = bfloat16 on GPU, float32 on CPU.
            device: None = the CPU (the trainer passes its root device, scripts `process_device()`).
            **kwargs: passed to `JanusTarget` (name, sampling, max_prompt_tokens, aux_layer_ids).
        """
        from transformers import AutoTokenizer, JanusForConditionalGeneration

        device, dtype = placement(device, dtype)
        model = JanusForConditionalGeneration.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(path)
        # weights load on the CPU first (device_map needs accelerate); the ignore: transformers wraps `to` with
        # functools.wraps(nn.Module.to), which mypy reads as a function missing its self
        model.to(device)  # type: ignore[arg-type]
        return cls(model, tokenizer, **kwargs)

    @staticmethod
    def _special_ids(model: JanusForConditionalGeneration, tokenizer: Any) -> tuple[int, int, int]:
        """BOS, BOI and pad ids: from the tokenizer, else from the generation config; both must agree."""
        generation = getattr(model, "generation_config", None)
        extra = (getattr(generation, "generation_kwargs", None) or {}) if generation is not None else {}
        from_config = {
            "bos": getattr(generation, "bos_token_id", None),
            "boi": extra.get("boi_token_id"),
            "pad": getattr(generation, "pad_token_id", None),
        }
        boi = tokenizer.convert_tokens_to_ids(BOI_TOKEN)
        if boi is None or boi == getattr(tokenizer, "unk_token_id", None):
            boi = None
        from_tokenizer = {"bos": tokenizer.bos_token_id, "boi": boi, "pad": tokenizer.pad_token_id}
        ids = {}
        for key in ("bos", "boi", "pad"):
            a, b = from_tokenizer[key], from_config[key]
            if a is not None and b is not None and int(a) != int(b):
                raise ValueError(f"the tokenizer's {key} id {a} differs from the generation config's {b}")
            value = a if a is not None else b
            if value is None:
                raise ValueError(f"neither the tokenizer nor the generation config gives the {key} token id")
            ids[key] = int(value)
        return ids["bos"], ids["boi"], ids["pad"]

    # ------------------------------------------------------------------ sizes

    @property
    def hidden_size(self) -> int:
        return self._text_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self._text_config.num_hidden_layers

    @property
    def image_vocab_size(self) -> int:
        return self._vq_config.num_embeddings

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self._aux_layer_ids

    @property
    def prefix_length(self) -> int:
        return self._prefix_length

    @property
    def num_kv_heads(self) -> int:
        return self._text_config.num_key_value_heads or self._text_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        config = self._text_config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    # ------------------------------------------------------------------ conditioning

    def prompt_text(self, prompt: str) -> str:
        """The official prompt string before BOS / BOI are added."""
        return PROMPT_TEMPLATE.format(prompt=prompt)

    def prompt_ids(self, prompts: list[str], cfg: bool = True) -> tuple[Tensor, Tensor]:
        """Token ids of the prefix rows, left-padded to C: (R, C) int64 ids and (R, C) bool validity.

        Rows are [cond; uncond]: conditional row b = BOS + format(prompt b) + BOI; its unconditional
        row keeps BOS and BOI and has pad tokens in between (attended to, as in the official sampler).
        """
        length = self.prefix_length
        ids = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), length, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            body = self.tokenizer(self.prompt_text(prompt), add_special_tokens=False)["input_ids"]
            tokens = [self.bos_id, *body, self.boi_id]
            if len(tokens) > length:
                raise ValueError(
                    f"prompt {row} takes {len(tokens)} tokens with its template, more than max_prompt_tokens="
                    f"{length}; shorten it or build the target with a larger max_prompt_tokens: {prompt[:80]!r}"
                )
            ids[row, length - len(tokens) :] = torch.tensor(tokens)
            valid[row, length - len(tokens) :] = True
        if cfg:
            uncond = ids.clone()
            inner = valid.clone()
            inner[:, -1] = False  # BOI is always the last slot
            first = valid.float().argmax(1)  # BOS: the first valid slot
            inner[torch.arange(len(prompts)), first] = False
            uncond[inner] = self.pad_id
            ids, valid = torch.cat([ids, uncond]), torch.cat([valid, valid])
        return ids, valid

    # ------------------------------------------------------------------ image vocabulary

    def image_positions(self, token_index: Tensor) -> Tensor:
        return token_index + self.prefix_length

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        return self.model.prepare_embeddings_for_image_generation(tokens)

    def latent_table(self) -> Tensor:
        """(V, 8) the generation VQ-16's codebook (`model.vqmodel.quantize.embedding.weight`, the original's
        `gen_vision_model`; raw, as LANTERN reads LlamaGen's). Not `generation_embeddings`: that is the LM's
        own learned input table (see `lm_embedding_table`)."""
        return self.model.model.vqmodel.quantize.embedding.weight.detach()

    # lm_embedding_table: the default, `generation_aligner(generation_embeddings(v))` for every v, (V, D): Janus
    # has no LM embedding row for an image token, its input is this aligned vector (a new tensor each call)

    def image_head(self, hidden: Tensor) -> Tensor:
        return self.model.model.generation_head(hidden)

    def image_head_weight(self) -> Tensor:
        return self.model.model.generation_head.vision_head.weight

    @torch.no_grad()
    def decode_images(self, tokens: Tensor) -> Tensor:
        """(B, G) codes -> (B, H, W, 3) uint8 on the CPU, as the original: clip((x + 1) / 2 * 255) then truncate."""
        pixels = self.model.model.vqmodel.decode(tokens.to(self.device))  # (B, 3, H, W) in about [-1, 1]
        pixels = ((pixels.float() + 1) / 2 * 255).clamp(0, 255).to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu()
