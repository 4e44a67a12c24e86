"""Lumina-mGPT (Chameleon backbone) behind `ImageTarget`, over transformers' `ChameleonForConditionalGeneration`.

    target = LuminaTarget.from_pretrained("Alpha-VLLM/Lumina-mGPT-7B-768")   # or a local folder
    conditioning = target.condition(["a red fox in the snow"])                 # [cond; uncond] rows

The image sequence, its vocabulary, geometry and layout rule: `models.lumina_layout`.

Proximity tables (`ImageTarget.latent_table` / `lm_embedding_table`, read by LANTERN and GSD):
`latent_table()` is Chameleon's VQGAN codebook (8192 x 256) followed by two rows for the layout tokens,
which have no code: `layout_rows` puts them farther from every code (and from each other) than any two codes
are apart, so LANTERN never pools a layout token with a code. The codebook is the decoding VQGAN's (our
`models.chameleon_vqgan` port of `vqgan_path`), else transformers' `model.vqmodel` quantizer where the
checkpoint held it (Lumina-mGPT deletes the VQ model before fine-tuning, so its released checkpoints most
likely do not: `from_pretrained` records whether they did). `lm_embedding_table()` is
`embed_tokens.weight[token_ids]`, the rows of GSD's table (the LM's input embeddings by Chameleon id).

Prefix and CFG (upstream `LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor`):
the conditional row is BOS + the prompt turn + the image header; the model itself emits the header
upstream, we force it (it is fixed by the resolution in the prompt; LANTERN checks generated data
starts with exactly these three tokens). The unconditional context is upstream's
`input_ids[:, index_of(<racm3:break>):]`: the header alone, no BOS and no text, run in its own cache
from position 0. Rows are [cond; uncond]; every row is left-padded to C = `max_prompt_tokens` slots
(padded slots invalid) at positions 0 .. C-1, so image token j sits at C + j in every row. Chameleon
uses 1D rotary attention (QK-norm is applied before rotary, position-free), which depends on position
differences only, so this equals upstream's separate uncond context at positions 0, 1, 2, 3 + j.
Upstream guides raw logits (`s * (cond - uncond) + uncond`, then the layout mask); our `combine_cfg`
is the same formula over the V columns.

Logits: transformers' `ChameleonForConditionalGeneration.forward` sets every image-token logit to
`finfo.min`; we never use it. `image_head` is the LM head restricted to the V rows,
`hidden @ lm_head.weight[token_ids].T`, over the post-norm last hidden state.

Running the layers: as in `models/janus.py`, `models.transformers_decoder` calls each of transformers' own
`ChameleonDecoderLayer`s (or `ChameleonSwinDecoderLayer`s) with the model's `rotary_emb` at our
explicit positions, a 4-D additive mask from our cache validity and tree mask, and a `Cache`
stand-in that writes keys/values (stored after rotary) into our `KVCache`. Needs "sdpa" or "eager".

VQ decoding: transformers 5.24's `ChameleonVQVAE` has an encoder and quantizer only, **no decoder**
(Lumina-mGPT decodes with Meta's `vqgan.ckpt`, shipped with the gated Chameleon release under its own
licence, not in the Lumina-mGPT checkpoint). `decode_images` uses either `vqgan_path=` (that file,
loaded on first use into our `models.chameleon_vqgan.ChameleonVQGANDecoder`, float32 on the target's
device, as upstream) or an injected `vq_decoder` callable, (B, rows, cols) int64 VQ codes ->
(B, 3, H, W) pixels in about [-1, 1]; with neither it raises `NotImplementedError` naming the options.

Shapes: B prompts, R rows (2B with CFG), T new tokens, C prompt slots, S cached + new columns,
D hidden size, V image vocabulary (K codes + 2 layout tokens), G image tokens (with the EOL column).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor

from models.lumina_layout import (
    END_OF_LINE,
    END_OF_TURN,
    IMAGE_END,
    IMAGE_START,
    PROMPT_TEMPLATE,
    SIZE_PATCH_CODES,
    SIZE_TOKEN,
    layout_rows,
)
from models.target import ImageGeometry, SamplingDefaults, resolve_aux_layer_ids
from models.transformers_decoder import TransformersDecoderTarget, check_attention_implementation, placement

if TYPE_CHECKING:
    from transformers import ChameleonForConditionalGeneration

    from models.chameleon_vqgan import ChameleonVQGANConfig

LUMINA_SAMPLING = SamplingDefaults(cfg_scale=3.0, temperature=1.0, top_k=2000, top_p=None)
"""Upstream `create_logits_processor` defaults: cfg 3.0, image top-k 2000, temperature 1."""
DEFAULT_HUB_ID = "Alpha-VLLM/Lumina-mGPT-7B-768"
VQ_CODEBOOK_KEY = "model.vqmodel.quantize.embedding.weight"
"""transformers' key of the Chameleon VQGAN codebook inside a Chameleon checkpoint."""
DEFAULT_GRID = (48, 48)  # 768 px / 16


class LuminaTarget(TransformersDecoderTarget):
    """Lumina-mGPT's image generation through our KV cache, positions and tree masks (see the module docstring)."""

    family = "lumina"

    def __init__(
        self,
        model: ChameleonForConditionalGeneration,
        tokenizer: Any,
        name: str = "lumina-mgpt-7b",
        sampling: SamplingDefaults = LUMINA_SAMPLING,
        grid: tuple[int, int] = DEFAULT_GRID,
        max_prompt_tokens: int = 160,
        aux_layer_ids: tuple[int, ...] | None = None,
        vq_decoder: Callable[[Tensor], Tensor] | None = None,
        vqgan_path: str | Path | None = None,
        vqgan_config: ChameleonVQGANConfig | dict | str | Path | None = None,
        vq_codebook_loaded: bool = True,
    ) -> None:
        """Wrap a loaded model and its tokenizer.

        Args:
            model: a `ChameleonForConditionalGeneration` (real Lumina-mGPT or tiny random) whose
                `config.vocabulary_map` names the image codes and the layout tokens.
            tokenizer: its tokenizer (callable like a transformers tokenizer); BOS falls back to the config's.
            name: the target's name.
            sampling: the sampling defaults (upstream: CFG 3, temperature 1, top-k 2000).
            grid: (rows, cols) of VQ codes, both even (upstream size tokens count 2-code grids); 48 x 48 = 768 px.
            max_prompt_tokens: C, the slots every row is left-padded to (BOS, turn and 3 header tokens included).
            aux_layer_ids: residual streams for EAGLE-3 (index i = input of layer i, transformers'
                `hidden_states[i]`; i = num_layers is the post-norm output); None = (2, L // 2, L - 3).
            vq_decoder: (B, rows, cols) VQ codes -> (B, 3, H, W) pixels in about [-1, 1]; None = use
                `vqgan_path`, or none available (transformers' `ChameleonVQVAE` has no decoder).
            vqgan_path: Meta Chameleon's `vqgan.ckpt` (separately licensed; a bare state dict or safetensors
                also works), loaded by `load_vq_decoder` on the first `decode_images`; excludes `vq_decoder`.
            vqgan_config: its architecture (`ChameleonVQGANConfig`, its fields, or the release's
                `vqgan.yaml`); None = the Chameleon VQGAN.
            vq_codebook_loaded: whether `model.model.vqmodel`'s codebook holds trained weights (a checkpoint
                without them leaves transformers' random init); `from_pretrained` reads it off the checkpoint.
                False: `latent_table` needs `vqgan_path`.
        """
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.sampling = sampling
        if vq_decoder is not None and vqgan_path is not None:
            raise ValueError("pass either vq_decoder= or vqgan_path=, not both")
        if vqgan_path is not None and not Path(vqgan_path).is_file():
            raise FileNotFoundError(f"vqgan_path {str(vqgan_path)!r} is not a file (Meta Chameleon's vqgan.ckpt)")
        self.vq_decoder = vq_decoder
        self.vqgan_path = Path(vqgan_path) if vqgan_path is not None else None
        self.vqgan_config = vqgan_config
        self.vq_codebook_loaded = vq_codebook_loaded
        base_model = model.model  # ChameleonModel: the decoder stack and the image vocabulary mapping
        self.language_model = base_model
        config = model.config
        check_attention_implementation(config)
        self._config = config
        self._aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, config.num_hidden_layers)

        rows, cols = (int(n) for n in grid)
        if rows < 1 or cols < 1 or rows % SIZE_PATCH_CODES or cols % SIZE_PATCH_CODES:
            raise ValueError(f"grid must be positive and even (size tokens count 2-code grids), got {grid}")
        self.rows, self.cols = rows, cols

        # ---- the image vocabulary: K codes in VQ order, then end-of-line, then end-of-image
        vocab = dict(config.vocabulary_map or {})
        mapping = base_model.vocabulary_mapping
        img2bpe = mapping.img2bpe
        codes = len(img2bpe)
        if sorted(img2bpe) != list(range(codes)):
            raise ValueError("the vocabulary map's IMGIMG tokens must name the VQ codes 0 .. K-1 exactly once")

        def token(name_: str) -> int:
            if name_ not in vocab:
                raise ValueError(f"config.vocabulary_map lacks {name_!r}, which Lumina-mGPT's image layout needs")
            return int(vocab[name_])

        self.num_codes = codes
        self.eol_id, self.eoi_id, self.boi_id = token(END_OF_LINE), token(IMAGE_END), token(IMAGE_START)
        self.eot_id = token(END_OF_TURN)
        self.eol_index, self.eoi_index = codes, codes + 1
        ids = [img2bpe[k] for k in range(codes)] + [self.eol_id, self.eoi_id]
        self.token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        """(V,) Chameleon token id of every interface index."""
        inverse = torch.full((config.vocab_size,), -1, dtype=torch.long)
        inverse[torch.tensor(ids)] = torch.arange(len(ids))
        self.interface_index = inverse.to(self.device)
        """(vocab_size,) interface index of every Chameleon id, -1 outside V."""
        self.header_ids = (
            self.boi_id,
            token(SIZE_TOKEN.format(8800 + rows // SIZE_PATCH_CODES)),
            token(SIZE_TOKEN.format(8800 + cols // SIZE_PATCH_CODES)),
        )
        """<racm3:break>, rows size token, cols size token: the forced start of the image span."""

        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            bos = getattr(config, "bos_token_id", None)
        if bos is None:
            raise ValueError("neither the tokenizer nor the config gives the BOS token id")
        self.bos_id = int(bos)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.bos_id)  # padded slots are never attended to
        if max_prompt_tokens < 1 + 1 + len(self.header_ids):
            raise ValueError(
                f"max_prompt_tokens must leave room for BOS, the turn end and the header, got {max_prompt_tokens}"
            )
        self._prefix_length = int(max_prompt_tokens)

        vq_config: Any = config.vq_config
        downsample = 2 ** (len(vq_config.channel_multiplier) - 1)
        self.geometry = ImageGeometry(grid=(rows, cols + 1), image_size=(rows * downsample, cols * downsample))
        self.pixel_size = (rows * 16, cols * 16)
        """(H, W) in the prompt text: 16 px per code as upstream (768 x 768 for 48 x 48), whatever the tiny VQ."""

    def to(self, device: torch.device | str) -> Self:
        """Move the Chameleon model (decoder, head, VQ codebook), the VQ decoder when it is a module (a VQGAN loaded
        later lands on the target's device then) and the two id tables (`token_ids`, `interface_index`) to `device`."""
        self.model.to(device)  # type: ignore[arg-type]  # transformers wraps `to`: mypy sees no self
        if isinstance(self.vq_decoder, torch.nn.Module):
            self.vq_decoder.to(device)
        self.token_ids = self.token_ids.to(device)
        self.interface_index = self.interface_index.to(device)
        return self

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        path: str = DEFAULT_HUB_ID,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> LuminaTarget:
        """Load a transformers-format Lumina-mGPT (Chameleon) checkpoint and its tokenizer.

        Args:
            path: folder with `config.json`, the weights and the tokenizer files, or a hub id.
            dtype: weights' dtype; None = bfloat16 on GPU, float32 on CPU.
            device: None = the CPU (the trainer passes its root device, scripts `process_device()`).
            **kwargs: passed to `LuminaTarget` (name, sampling, grid, max_prompt_tokens, aux_layer_ids,
                vq_decoder, vqgan_path, vqgan_config); `vqgan_path=".../vqgan.ckpt"` enables `decode_images`
                (and `latent_table` when the checkpoint holds no VQ codebook, whose absence is recorded here).
        """
        from transformers import AutoTokenizer, ChameleonForConditionalGeneration

        device, dtype = placement(device, dtype)
        loaded: Any = ChameleonForConditionalGeneration.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True
        )
        model, info = loaded  # (model, {"missing_keys": [...], ...})
        kwargs.setdefault("vq_codebook_loaded", VQ_CODEBOOK_KEY not in info["missing_keys"])
        tokenizer = AutoTokenizer.from_pretrained(path)
        model.to(device)  # type: ignore[arg-type]  # transformers wraps `to` with functools.wraps: mypy sees no self
        return cls(model, tokenizer, **kwargs)

    # ------------------------------------------------------------------ sizes

    @property
    def hidden_size(self) -> int:
        return self._config.hidden_size

    @property
    def num_layers(self) -> int:
        return self._config.num_hidden_layers

    @property
    def image_vocab_size(self) -> int:
        return self.num_codes + 2

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self._aux_layer_ids

    @property
    def prefix_length(self) -> int:
        return self._prefix_length

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_key_value_heads or self._config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self._config.hidden_size // self._config.num_attention_heads

    # ------------------------------------------------------------------ conditioning

    def prompt_text(self, prompt: str) -> str:
        """The human turn's text (without BOS and the end-of-turn token)."""
        height, width = self.pixel_size
        return PROMPT_TEMPLATE.format(width=width, height=height, prompt=prompt)

    def prompt_ids(self, prompts: list[str], cfg: bool = True) -> tuple[Tensor, Tensor]:
        """Token ids of the prefix rows, left-padded to C: (R, C) int64 ids and (R, C) bool validity.

        Conditional row b = BOS + text(prompt b) + <reserved08706> + header; its unconditional row is
        the header alone (upstream's separate context from `<racm3:break>` on).
        """
        length = self.prefix_length
        header = list(self.header_ids)
        encode = self.tokenizer
        rows = [
            [self.bos_id, *encode(self.prompt_text(p), add_special_tokens=False)["input_ids"], self.eot_id, *header]
            for p in prompts
        ]
        if cfg:
            rows += [header] * len(prompts)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(rows), length, dtype=torch.bool)
        for row, tokens in enumerate(rows):
            if len(tokens) > length:
                raise ValueError(
                    f"prompt {row} takes {len(tokens)} tokens with its template, more than max_prompt_tokens="
                    f"{length}; shorten it or build the target with a larger max_prompt_tokens: "
                    f"{prompts[row % len(prompts)][:80]!r}"
                )
            ids[row, length - len(tokens) :] = torch.tensor(tokens)
            valid[row, length - len(tokens) :] = True
        return ids, valid

    # ------------------------------------------------------------------ image vocabulary

    def image_positions(self, token_index: Tensor) -> Tensor:
        return token_index + self.prefix_length

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        return self.language_model.embed_tokens(self.token_ids.to(tokens.device)[tokens])

    def image_head(self, hidden: Tensor) -> Tensor:
        """LM-head rows of the V tokens over the post-norm hidden state (transformers' image-token masking skipped)."""
        head = self.model.lm_head
        index = self.token_ids.to(head.weight.device)
        bias = head.bias[index] if head.bias is not None else None
        return F.linear(hidden, head.weight[index], bias)

    def image_head_weight(self) -> Tensor:
        return self.model.lm_head.weight

    def lm_embedding_table(self) -> Tensor:
        """(V, D) the Chameleon input embeddings of the V tokens, `embed_tokens.weight[token_ids]`: the rows of GSD's
        table (the authors index the LM's embedding table by Chameleon id; every image id is below 10,000)."""
        weight = self.model.model.embed_tokens.weight.detach()  # (vocab_size, D)
        return weight[self.token_ids.to(weight.device)]

    def latent_table(self) -> Tensor:
        """(V, e) float32 = (K + 2, 256) for the real model: Chameleon's VQGAN codebook, then the end-of-line and
        end-of-image rows (`layout_rows`: far from every code and from each other).

        The codebook is the decoding VQGAN's `quantize.embedding.weight` (`vqgan_path`'s, loaded once by
        `load_vq_decoder`, or an injected `ChameleonVQGANDecoder`), else transformers' `model.vqmodel.quantize`
        (the same vqgan.ckpt quantizer, converted into the checkpoint) when it was loaded.

        Raises:
            NotImplementedError: neither source holds trained weights; load the target with `vqgan_path`.
            ValueError: the codebook's size is not the vocabulary map's K.
        """
        codebook = self.vq_codebook()  # (K, e)
        return torch.cat([codebook.float(), layout_rows(codebook, 2)])

    def vq_codebook(self) -> Tensor:
        """(K, e) the VQGAN codebook `latent_table` starts with, the module's own parameter (detached)."""
        from models.chameleon_vqgan import ChameleonVQGANDecoder

        decoder = self.load_vq_decoder() if self.vqgan_path is not None else self.vq_decoder
        if isinstance(decoder, ChameleonVQGANDecoder):
            codebook = decoder.quantize.embedding.weight
        elif self.vq_codebook_loaded:
            codebook = self.model.model.vqmodel.quantize.embedding.weight
        else:
            raise NotImplementedError(
                f"target {self.name!r}: its checkpoint holds no VQ codebook ({VQ_CODEBOOK_KEY} was missing, so "
                "transformers left it random) and no VQGAN was given; load the target with "
                "vqgan_path='.../vqgan.ckpt' (Meta Chameleon's VQGAN) for LANTERN's latent table"
            )
        if codebook.shape[0] != self.num_codes:
            raise ValueError(
                f"target {self.name!r}: a VQ codebook of {codebook.shape[0]} codes does not fit the vocabulary map's "
                f"{self.num_codes} image codes"
            )
        return codebook.detach()

    def to_chameleon_ids(self, tokens: Tensor) -> Tensor:
        """Interface indices (any shape) -> Chameleon token ids."""
        return self.token_ids.to(tokens.device)[tokens]

    def from_chameleon_ids(self, ids: Tensor) -> Tensor:
        """Chameleon token ids (any shape) -> interface indices; raises for ids outside V."""
        index = self.interface_index.to(ids.device)[ids]
        if (index < 0).any():
            raise ValueError(f"token ids outside the image vocabulary: {ids[index < 0].unique()[:8].tolist()}")
        return index

    def chameleon_ids(self, tokens: Tensor) -> Tensor:
        """(B, G) image tokens -> (B, 3 + G + 1) upstream image span: header, codes with EOLs, end-of-image."""
        batch = tokens.shape[0]
        header = torch.tensor(self.header_ids, device=tokens.device).expand(batch, -1)
        end = torch.full((batch, 1), self.eoi_id, dtype=torch.long, device=tokens.device)
        return torch.cat([header, self.to_chameleon_ids(tokens), end], dim=1)

    # ------------------------------------------------------------------ layout rule

    def layout_mask(self, token_index: Tensor, check: bool = True) -> Tensor:
        """Allowed V entries of image token `token_index` (0 .. G), (...,) -> (..., V) bool.

        Upstream `MultiModalLogitsProcessor`: at a row end (index % (cols + 1) == cols) only end-of-line,
        at index G (after the last row) only end-of-image, elsewhere only the K codes. Not applied by
        `forward`; the decoders apply it through `constrain_logits` (see the module docstring).
        `check=False` skips the index range check (a host sync), as the decoders' hook does.
        """
        token_index = torch.as_tensor(token_index, device=self.token_ids.device)
        if check and ((token_index < 0).any() or (token_index > self.geometry.num_tokens).any()):
            raise ValueError(f"image token indices must lie in 0..{self.geometry.num_tokens}")
        vocab = torch.arange(self.image_vocab_size, device=token_index.device)
        index = token_index[..., None]
        row_end = (index % (self.cols + 1) == self.cols) & (index < self.geometry.num_tokens)
        last = index == self.geometry.num_tokens
        code = vocab < self.num_codes
        return torch.where(row_end, vocab == self.eol_index, torch.where(last, vocab == self.eoi_index, code))

    def apply_layout(self, logits: Tensor, token_index: Tensor, check: bool = True) -> Tensor:
        """`logits` (..., V) with the entries `layout_mask(token_index)` forbids set to -inf."""
        return logits.masked_fill(~self.layout_mask(token_index, check).to(logits.device), float("-inf"))

    def constrain_logits(self, logits: Tensor, token_index: Tensor) -> Tensor:
        """The layout rule as the decoders' hook: guided logits (B, ..., V) at indices (B, ...), which the
        decoders clamp to the image, so the range check (a host sync per call) is skipped."""
        return self.apply_layout(logits, token_index, check=False)

    # ------------------------------------------------------------------ decoding

    def image_codes(self, tokens: Tensor) -> Tensor:
        """(B, G) image tokens -> (B, rows, cols) VQ codes: the end-of-line column dropped (as upstream, unchecked)."""
        grid = tokens.reshape(tokens.shape[0], self.rows, self.cols + 1)[..., : self.cols]
        if (grid >= self.num_codes).any() or (grid < 0).any():
            raise ValueError("an image token at a code slot is not a VQ code (a layout token where a code belongs)")
        return grid

    def load_vq_decoder(self) -> Callable[[Tensor], Tensor]:
        """The VQ decoder `decode_images` uses: the injected one, else the VQGAN of `vqgan_path`, loaded once.

        Raises:
            NotImplementedError: when neither `vq_decoder` nor `vqgan_path` was given.
            ValueError: when the VQGAN's codebook size or downsampling factor does not fit this target.
        """
        if self.vq_decoder is not None:
            return self.vq_decoder
        if self.vqgan_path is None:
            raise NotImplementedError(
                "no VQ decoder: Lumina-mGPT decodes with Meta Chameleon's VQGAN (vqgan.ckpt, separately licensed, "
                "not in the Lumina-mGPT checkpoint and transformers' ChameleonVQVAE has no decoder); load the target "
                "with vqgan_path='.../vqgan.ckpt' (LuminaTarget, LuminaTarget.from_pretrained or "
                "load_target('lumina-mgpt-7b', vqgan_path=...)), or pass a vq_decoder= callable"
            )
        from models.chameleon_vqgan import load_chameleon_vqgan

        vqgan = load_chameleon_vqgan(self.vqgan_path, self.vqgan_config)
        downsample = self.geometry.image_size[0] // self.rows
        if vqgan.num_codes != self.num_codes or vqgan.downsample != downsample:
            raise ValueError(
                f"{self.vqgan_path}: a VQGAN of {vqgan.num_codes} codes and downsampling {vqgan.downsample} does not "
                f"fit this target ({self.num_codes} image codes in the vocabulary map, downsampling {downsample} "
                "from config.vq_config)"
            )
        self.vq_decoder = vqgan.to(self.device)  # float32, as upstream's ImageTokenizer
        return self.vq_decoder

    @torch.no_grad()
    def decode_images(self, tokens: Tensor) -> Tensor:
        """(B, G) tokens -> (B, H, W, 3) uint8 on the CPU, as upstream: clamp to [-1, 1], (x + 1) / 2 * 255, floor.

        Decodes with `vq_decoder` or the VQGAN of `vqgan_path` (see `load_vq_decoder`, which raises without either).
        """
        decoder = self.load_vq_decoder()
        pixels = decoder(self.image_codes(tokens.to(self.device)))  # (B, 3, H, W)
        pixels = ((pixels.float().clamp(-1, 1) + 1) / 2 * 255).to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu()
