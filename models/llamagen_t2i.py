"""LlamaGen text-to-image XL (FoundationVision/LlamaGen) behind the `ImageTarget` interface.

    target = LlamaGenT2ITarget.from_pretrained(                    # upstream's pretrained_models/ layout
        "pretrained_models/t2i_XL_stage2_512.pt", "pretrained_models/vq_ds16_t2i.pt",
        "pretrained_models/t5-ckpt/flan-t5-xl")
    target = load_target("llamagen-xl", preset="t2i-XL-stage1")   # files from $LLAMAGEN_DIR or the hub
    conditioning = target.condition(["a red fox in the snow"])    # [cond; uncond] rows

Three pieces, each loaded from its own official file:

- caption features: the FLAN-T5-XL encoder (transformers' `T5EncoderModel` + its tokenizer). As
  upstream's `T5Embedder.get_text_embeddings`: the caption is cleaned (`clean_caption`, our plain-text
  equivalent of upstream's cleaning, applied twice;
  `clean_captions=False` gives upstream's `lower().strip()` instead), tokenized with
  `max_length=120, padding="max_length", truncation=True, add_special_tokens=True` (EOS appended,
  right padding), encoded with the attention mask, and `last_hidden_state` taken. Then as
  `sample_t2i.py` (left padding on): each row is rotated so its n valid tokens end the 120 slots
  (`cat([emb[n:], emb[:n]])`), the mask flipped, and padded slots zeroed (`emb * mask`);
- the GPT: `models.llamagen.LlamaGenTransformer` (presets `t2i-XL-stage1`: 16x16 tokens / 256 px,
  `t2i-XL-stage2`: 32x32 / 512 px), caption slots at positions 0..119, image token j at 120 + j of the
  2D rotary table; CFG rows are [cond; uncond] halves, the unconditional row holds the learned
  `uncond_embedding` with its conditional row's caption mask (upstream `generate`);
- pixels: `models.vq16.VQ16Decoder` (`vq_ds16_t2i.pt`), always in fp32 as upstream, converted to
  uint8 as upstream's evaluation sampler: `clamp(127.5 x + 128, 0, 255)` then truncation.

Sampling presets: "official" (`sample_t2i.py`: CFG 7.5, temperature 1, top-k 1000, top-p 1.0) and
"lantern" = "cascade" (LANTERN's `generate_images.py` and every CASCADE dev run: CFG 3.0,
temperature 1, top-k 2000, top-p 1.0). Logits come out in fp32 (upstream `output(h).float()`).

Precision as upstream (`--precision bf16`): GPT and T5 in `dtype`, the VQ decoder in fp32, and the
2D rotary table kept in fp32 (upstream keeps `freqs_cis` a plain fp32 attribute, so casting the
model leaves it alone; our module holds it as a buffer, which the constructor restores to fp32).

Shapes: B prompts, R rows (2B with CFG), T new tokens, C caption slots (120), F caption width
(2048), D GPT width, V image vocabulary (16384), G image tokens.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import unicodedata
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import Tensor

from models.kv_cache import KVCache
from models.llamagen import LLAMAGEN_PRESETS, LlamaGenConfig, LlamaGenTransformer, build_rotary_table_2d
from models.target import Conditioning, DecoderTarget, ImageGeometry, SamplingDefaults, TargetOutput
from models.transformers_decoder import placement
from models.vq16 import VQ16Config, VQ16Decoder

if TYPE_CHECKING:
    from transformers import T5EncoderModel

OFFICIAL_SAMPLING = SamplingDefaults(cfg_scale=7.5, temperature=1.0, top_k=1000, top_p=1.0)
"""Upstream `sample_t2i.py` / `sample_t2i_ddp.py` defaults."""
LANTERN_SAMPLING = SamplingDefaults(cfg_scale=3.0, temperature=1.0, top_k=2000, top_p=1.0)
"""LANTERN `generate_images.py` defaults, used by every CASCADE dev run (docs/method.md, section "Recipes")."""
SAMPLING_PRESETS: dict[str, SamplingDefaults] = {
    "official": OFFICIAL_SAMPLING,
    "lantern": LANTERN_SAMPLING,
    "cascade": LANTERN_SAMPLING,
}
HUB_REPO = "peizesun/llamagen_t2i"
"""Hub repo of the official t2i files (GPT checkpoints and the VQ tokenizer)."""
GPT_FILES = {"t2i-XL-stage1": "t2i_XL_stage1_256.pt", "t2i-XL-stage2": "t2i_XL_stage2_512.pt"}
VQ_FILE = "vq_ds16_t2i.pt"
T5_HUB_ID = "google/flan-t5-xl"
T5_SUBDIR = "t5-ckpt/flan-t5-xl"
"""Where upstream's samplers find FLAN-T5-XL: `--t5-path pretrained_models/t5-ckpt --t5-model-type flan-t5-xl`."""
DEFAULT_DIR_ENV = "LLAMAGEN_DIR"
"""Environment variable naming the folder of the official files (default `pretrained_models`, upstream's)."""


# ----------------------------------------------------------------------------- caption cleaning
# Upstream lower-cases and cleans every caption twice (T5Embedder.clean_caption) with a long rule set
# aimed at web-scraped alt text (HTML, mojibake, shop spam, file names, CJK). Our prompt sets (PartiPrompts,
# COCO captions, the toy grammar) are plain text, for which its effect reduces to what `clean_caption`
# does below; captions with HTML or web junk can tokenize differently from upstream (see the docstring).

_URL = re.compile(r"\b(?:https?://|www\.)\S+", re.IGNORECASE)
_GLUED_PUNCTUATION = re.compile(r"([^\d\s][,./])(?=\w)")  # "a cat,sitting" -> "a cat, sitting"
_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u00ab": '"', "\u00bb": '"', "\u2018": "'", "\u2019": "'"})


def clean_caption(caption: str) -> str:
    """Plain-text caption cleaning with upstream's visible effects: lower case, URLs dropped, HTML entities
    and tags removed, typographic quotes straightened, a space after punctuation glued to a word,
    whitespace collapsed. Upstream's extra rules for scraped web captions are not reproduced."""
    text = unicodedata.normalize("NFC", html.unescape(str(caption))).lower()
    text = re.sub(r"</?[a-z][^<>]*>", " ", _URL.sub(" ", text))
    text = _GLUED_PUNCTUATION.sub(r"\1 ", text.translate(_QUOTES))
    return " ".join(text.split())


def preprocess_caption(caption: str, clean: bool = True) -> str:
    """Upstream `T5Embedder.text_preprocessing`: clean twice, or only lower-case and strip."""
    return clean_caption(clean_caption(caption)) if clean else caption.lower().strip()


def left_pad_features(features: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Upstream's left padding of right-padded T5 features: valid tokens to the end, padding zeroed.

    Row b with n valid tokens becomes cat([emb[n:], emb[:n]]) (slot j holds emb[(j + n) % C]), its
    mask is flipped, and features are multiplied by the new mask.

    Args:
        features: (B, C, F) T5 `last_hidden_state` of right-padded tokens.
        mask: (B, C) the tokenizer's attention mask (1 for the leading valid tokens).

    Returns:
        (B, C, F) left-padded features with zeros at padded slots, and the (B, C) bool mask.
    """
    length = features.shape[1]
    count = mask.long().sum(1, keepdim=True)  # (B, 1)
    index = (torch.arange(length, device=features.device)[None] + count) % length  # (B, C)
    rotated = features.gather(1, index[..., None].expand_as(features))
    valid = mask.flip(-1).bool()
    return rotated * valid[..., None].to(rotated.dtype), valid


# ----------------------------------------------------------------------------- the target


class LlamaGenT2ITarget(DecoderTarget):
    """LlamaGen t2i: FLAN-T5 caption features -> LlamaGen GPT over VQ-16 codes -> VQ-16 decoder."""

    family = "llamagen"

    def __init__(
        self,
        gpt: LlamaGenTransformer,
        vq: VQ16Decoder,
        text_encoder: T5EncoderModel,
        tokenizer: Any,
        name: str = "llamagen-xl",
        sampling: SamplingDefaults | str = "official",
        clean_captions: bool = True,
        aux_layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        """Wrap loaded modules (real or tiny random).

        Args:
            gpt: the LlamaGen t2i GPT; its `cls_token_num` is the tokenizer's max length C.
            vq: the VQ-16 decoder; its codebook size must equal the GPT's vocabulary.
            text_encoder: a `T5EncoderModel` whose `d_model` equals the GPT's `caption_dim`.
            tokenizer: its tokenizer (callable like a transformers tokenizer; appends EOS, pads right).
            name: the target's name.
            sampling: a `SamplingDefaults` or a preset name in `SAMPLING_PRESETS` ("official", "lantern", "cascade").
            clean_captions: upstream's caption cleaning (True) or only lower-case + strip (False).
            aux_layer_ids: residual streams for EAGLE-3 (index i = input of layer i); None keeps the GPT
                config's, by default (2, L // 2, L - 3).
        """
        config = gpt.config
        if aux_layer_ids is not None:
            config = replace(config, aux_layer_ids=tuple(aux_layer_ids))  # validated by LlamaGenConfig
            gpt.config = config
        if vq.num_codes != config.vocab_size:
            raise ValueError(f"VQ codebook has {vq.num_codes} codes but the GPT's vocabulary is {config.vocab_size}")
        width = getattr(text_encoder.config, "d_model", None)
        if width != config.caption_dim:
            raise ValueError(f"T5 width d_model={width} differs from the GPT's caption_dim={config.caption_dim}")
        if isinstance(sampling, str):
            if sampling not in SAMPLING_PRESETS:
                raise ValueError(f"unknown sampling preset {sampling!r}; known: {', '.join(SAMPLING_PRESETS)}")
            sampling = SAMPLING_PRESETS[sampling]
        self.gpt = gpt.eval().requires_grad_(False)
        self.vq = vq.float().eval().requires_grad_(False)
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.sampling = sampling
        self.clean_captions = clean_captions
        self._keep_rotary_fp32()
        side, pixels = config.grid_size, config.grid_size * vq.downsample
        self.geometry = ImageGeometry(grid=(side, side), image_size=(pixels, pixels))

    def _keep_rotary_fp32(self) -> None:
        """Upstream applies rotary embeddings from an fp32 table whatever the model dtype; restore ours."""
        table = self.gpt.rotary_table
        if table.dtype != torch.float32:
            config = self.gpt.config
            fresh = build_rotary_table_2d(config.grid_size, config.head_dim, config.rope_base, config.cls_token_num)
            self.gpt.rotary_table = fresh.to(table.device)

    def to(self, device: torch.device | str) -> Self:
        """Move the GPT (its float32 rotary table stays float32), the T5 caption encoder and the float32 VQ decoder
        (codebook included) to `device`."""
        self.gpt.to(device)
        self.vq.to(device)
        self.text_encoder.to(device)  # type: ignore[arg-type]  # transformers wraps `to`: mypy sees no self
        return self

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        gpt_checkpoint: str | Path | None = None,
        vq_checkpoint: str | Path | None = None,
        t5_path: str | Path | None = None,
        preset: str | LlamaGenConfig | dict | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        *,
        vq_config: VQ16Config | dict | None = None,
        folder: str | Path | None = None,
        **kwargs: Any,
    ) -> LlamaGenT2ITarget:
        """Load the official files: GPT checkpoint, VQ tokenizer checkpoint and FLAN-T5-XL.

        Args:
            gpt_checkpoint: `t2i_XL_stage{1_256,2_512}.pt` (or any file `load_llamagen_checkpoint` reads);
                None = the preset's official file in `folder`, else fetched from the hub repo `HUB_REPO`.
            vq_checkpoint: `vq_ds16_t2i.pt`; None = `folder/vq_ds16_t2i.pt`, else fetched from `HUB_REPO`.
            t5_path: a local FLAN-T5-XL folder or a hub id; None = `folder/t5-ckpt/flan-t5-xl` when it
                exists, else `google/flan-t5-xl`.
            preset: a `LLAMAGEN_PRESETS` name ("t2i-XL-stage1": 256 px, "t2i-XL-stage2": 512 px), a
                `LlamaGenConfig` or its fields as a dict; None = read from the checkpoint's file name
                (stage1 / _256 or stage2 / _512), or stage 2 when no checkpoint is named.
            dtype: GPT and T5 dtype (the VQ decoder stays fp32); None = bfloat16 on GPU (upstream
                `--precision bf16`), float32 on CPU.
            device: None = the CPU (the trainer passes its root device, scripts `process_device()`).
            vq_config: the VQ architecture (`VQ16Config` or its fields); None = the official VQ-16.
            folder: where the official files lie; None = $LLAMAGEN_DIR, else `pretrained_models`.
            **kwargs: passed to `LlamaGenT2ITarget` (name, sampling, clean_captions, aux_layer_ids).
        """
        from transformers import AutoTokenizer, T5EncoderModel

        from models.llamagen import load_llamagen_checkpoint
        from models.vq16 import load_vq16_checkpoint

        device, torch_dtype = placement(device, dtype)
        folder = Path(folder or os.environ.get(DEFAULT_DIR_ENV) or "pretrained_models")
        config = resolve_preset(preset, gpt_checkpoint)
        if gpt_checkpoint is None:
            preset_name = preset if isinstance(preset, str) else "t2i-XL-stage2" if preset is None else None
            if preset_name not in GPT_FILES:
                raise ValueError("name gpt_checkpoint: only the official presets have default files")
            gpt_checkpoint = GPT_FILES[preset_name]
        if isinstance(vq_config, dict):
            vq_config = VQ16Config(**vq_config)
        if t5_path is None:
            t5_path = folder / T5_SUBDIR if (folder / T5_SUBDIR).is_dir() else T5_HUB_ID

        with torch.serialization.safe_globals([argparse.Namespace]):  # training saves pickle their args too
            gpt = load_llamagen_checkpoint(resolve_file(gpt_checkpoint, folder), config)
        gpt.to(device=device, dtype=torch_dtype)
        vq = load_vq16_checkpoint(resolve_file(vq_checkpoint or VQ_FILE, folder), vq_config).to(device)
        text_encoder = T5EncoderModel.from_pretrained(str(t5_path), dtype=torch_dtype).to(device)  # type: ignore[arg-type]
        tokenizer = AutoTokenizer.from_pretrained(str(t5_path))
        return cls(gpt, vq, text_encoder, tokenizer, **kwargs)

    # ------------------------------------------------------------------ sizes

    @property
    def hidden_size(self) -> int:
        return self.gpt.config.dim

    @property
    def num_layers(self) -> int:
        return self.gpt.config.num_layers

    @property
    def image_vocab_size(self) -> int:
        return self.gpt.config.vocab_size

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.gpt.config.aux_layer_ids or ())

    @property
    def prefix_length(self) -> int:
        return self.gpt.config.cls_token_num

    # ------------------------------------------------------------------ conditioning

    @torch.no_grad()
    def caption_features(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Upstream's caption features: (B, C, F) left-padded T5 states (zeros at padding) and (B, C) bool validity."""
        texts = [preprocess_caption(prompt, self.clean_captions) for prompt in prompts]
        length = self.prefix_length
        batch = self.tokenizer(texts, max_length=length, padding="max_length", truncation=True,
                               return_attention_mask=True, add_special_tokens=True, return_tensors="pt")  # fmt: skip
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if ids.shape[1] != length:
            raise ValueError(f"the tokenizer returned {ids.shape[1]} tokens per caption, expected {length}")
        encoder_device = self.text_encoder.device
        states = self.text_encoder(input_ids=ids.to(encoder_device), attention_mask=mask.to(encoder_device))
        features, valid = left_pad_features(states.last_hidden_state, mask.to(encoder_device))
        weight = self.gpt.cls_embedding.cap_proj.fc1.weight
        return features.to(device=weight.device, dtype=weight.dtype), valid.to(weight.device)

    @torch.no_grad()
    def condition(self, prompts: list[str], cfg: bool = True) -> Conditioning:
        features, valid = self.caption_features(prompts)  # (B, C, F), (B, C)
        if cfg:  # upstream: uncond = zeros_like(cond) + uncond_embedding, masked like its conditional row
            features = torch.cat([features, self.gpt.unconditional_captions(len(prompts)).to(features.dtype)])
            valid = torch.cat([valid, valid])
        positions = torch.arange(self.prefix_length, device=features.device)
        return Conditioning(self.gpt.embed_captions(features), valid, positions, len(prompts), cfg)

    # ------------------------------------------------------------------ running

    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        return self.gpt.allocate_cache(rows, capacity)

    def run_decoder(self, inputs: Tensor, positions: Tensor, cache: KVCache | None, tree_mask: Tensor | None,
                    new_valid: Tensor | None, return_aux: bool,
                    logits_at: Tensor | None = None) -> TargetOutput:  # fmt: skip
        hidden, aux = self.gpt(inputs, positions, cache, tree_mask, new_valid, return_aux)
        return self.output(hidden, aux, logits_at)

    # ------------------------------------------------------------------ image vocabulary

    def image_positions(self, token_index: Tensor) -> Tensor:
        return token_index + self.prefix_length

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        return self.gpt.tok_embeddings(tokens)

    def latent_table(self) -> Tensor:
        """(V, 8) the VQ-16 codebook (`vq.quantize.embedding.weight`, raw: LANTERN reads it unnormalised)."""
        return self.vq.codebook

    def lm_embedding_table(self) -> Tensor:
        """(V, D) the GPT's input embedding table (`tok_embeddings.weight`): LM ids are the image codes."""
        return self.gpt.tok_embeddings.weight.detach()

    def image_head(self, hidden: Tensor) -> Tensor:
        return self.gpt.output(hidden).float()  # upstream: logits = self.output(h).float()

    def image_head_weight(self) -> Tensor:
        return self.gpt.output.weight

    @torch.no_grad()
    def decode_images(self, tokens: Tensor) -> Tensor:
        """(B, G) codes -> (B, H, W, 3) uint8 on the CPU, as upstream's sampler: clamp(127.5 x + 128, 0, 255)."""
        pixels = self.vq.decode_code(tokens, self.geometry.grid)  # (B, 3, H, W) in about [-1, 1]
        return (127.5 * pixels.float() + 128.0).clamp(0, 255).permute(0, 2, 3, 1).to("cpu", torch.uint8)


# ----------------------------------------------------------------------------- file resolution


def resolve_preset(preset: str | LlamaGenConfig | dict | None, gpt_checkpoint: str | Path | None) -> LlamaGenConfig:
    """The GPT architecture: a preset name, a config, its fields, or read from the checkpoint's file name."""
    if isinstance(preset, LlamaGenConfig):
        return preset
    if isinstance(preset, dict):
        return LlamaGenConfig(**preset)
    if preset is None:
        if gpt_checkpoint is None:
            preset = "t2i-XL-stage2"
        else:
            stem = Path(gpt_checkpoint).name.lower()
            stage1, stage2 = ("stage1" in stem or "_256" in stem), ("stage2" in stem or "_512" in stem)
            if stage1 == stage2:
                raise ValueError(
                    f"cannot tell the stage of {gpt_checkpoint} from its name; pass preset='t2i-XL-stage1' "
                    "(256 px, 16x16 tokens) or preset='t2i-XL-stage2' (512 px, 32x32 tokens)"
                )
            preset = "t2i-XL-stage1" if stage1 else "t2i-XL-stage2"
    if preset not in LLAMAGEN_PRESETS:
        raise ValueError(f"unknown LlamaGen preset {preset!r}; known: {', '.join(LLAMAGEN_PRESETS)}")
    return replace(LLAMAGEN_PRESETS[preset])  # a copy: the target may set aux_layer_ids on it


def resolve_file(path: str | Path, folder: Path, download: Callable[[str], str] | None = None) -> Path:
    """A local file for `path`: as given, else inside `folder`, else (a bare file name) from the hub repo."""
    path = Path(path)
    for candidate in (path, folder / path):
        if candidate.is_file():
            return candidate
    if path.parent != Path("."):
        raise FileNotFoundError(f"{path} does not exist")
    try:
        if download is None:
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(HUB_REPO, path.name))
        return Path(download(path.name))
    except Exception as error:  # offline, unknown file, no network
        raise FileNotFoundError(
            f"{path.name} is neither in {folder} (set ${DEFAULT_DIR_ENV} or pass the path) nor fetchable "
            f"from the hub repo {HUB_REPO}: {error}"
        ) from error
