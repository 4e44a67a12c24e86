"""LlamaGen text-to-image GPT (Sun et al., 2024), written for this project.

Parameter names and shapes follow the official `autoregressive/models/gpt.py` (FoundationVision/
LlamaGen), so an official t2i checkpoint (`t2i_XL_stage1_256.pt`, `t2i_XL_stage2_512.pt`) loads
with strict key checking through `load_llamagen_checkpoint`. Behaviour that a faithful port must
keep:

- the caption (T5 features, `caption_dim` wide, `cls_token_num` slots, left-padded) goes through
  `cls_embedding.cap_proj`, an MLP without biases; CFG's unconditional row replaces the caption by
  the learned buffer `cls_embedding.uncond_embedding`;
- 2D rotary embedding over the image grid: the first half of each head rotates by the row index,
  the second half by the column index, interleaved pairs; the caption positions get cos = sin = 0,
  which zeroes q and k of every caption token (their keys score 0 against every query, and caption
  information flows through values and the residual stream only);
- padded caption columns are masked for every row, and every token may attend to itself;
- no biases; RMSNorm in fp32; SwiGLU feed-forward; the image-token logits come from `output`.

The forward runs over new tokens only, with an explicit `KVCache`, explicit positions (indices
into the rotary table: caption slot i is position i, image token j is position cls_token_num + j)
and an optional tree attention mask among the new tokens.

Shapes: B rows, T new tokens, S cached + new tokens, D model width, H heads, E head size,
V image vocabulary, C caption slots, F caption feature width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.kv_cache import KVCache
from models.target import resolve_aux_layer_ids


@dataclass(kw_only=True)
class LlamaGenConfig:
    """Architecture of a LlamaGen t2i GPT."""

    dim: int = 1280
    """Model width D."""
    num_layers: int = 36
    """Number of decoder layers."""
    num_heads: int = 20
    """Attention heads; head size is dim // num_heads and must be divisible by 4 for 2D RoPE."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads."""
    multiple_of: int = 256
    """The feed-forward width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Optional factor on the feed-forward width before rounding."""
    rope_base: float = 10000.0
    """Rotary base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    vocab_size: int = 16384
    """Image vocabulary V (the VQ codebook size)."""
    caption_dim: int = 2048
    """Width F of the caption features (FLAN-T5-XL: 2048)."""
    cls_token_num: int = 120
    """Caption slots C before the image tokens."""
    grid_size: int = 32
    """Side of the square image-token grid (512 px / 16 = 32)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """Residual streams recorded for EAGLE-3 (index i is the input of layer i, as in transformers'
    hidden_states); None means (2, num_layers // 2, num_layers - 3)."""
    extra: dict = field(default_factory=dict)
    """Free-form notes (not used by the model)."""

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} must be divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head size {self.head_dim} must be divisible by 4 for the 2D rotary embedding")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.kv_heads}")
        self.aux_layer_ids = resolve_aux_layer_ids(self.aux_layer_ids, self.num_layers)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of

    @property
    def num_image_tokens(self) -> int:
        return self.grid_size**2


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # the unit norm in x's dtype (F.rms_norm computes half precision in fp32, one fused kernel on CUDA),
        # then the weight, as LlamaGen does: bit-identical to x.float() * rsqrt(mean(x^2) + eps), cast back
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight


def build_rotary_table_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int) -> Tensor:
    """Rotary (cos, sin) per position: zeros for the caption slots, then the image grid row-major.

    Returns:
        (C + grid_size**2, head_dim // 2, 2) float32.
    """
    quarter = head_dim // 4
    inv_freq = 1.0 / (base ** (torch.arange(0, quarter, dtype=torch.float32) * 2 / (head_dim // 2)))  # (E/4,)
    angle = torch.outer(torch.arange(grid_size, dtype=torch.float32), inv_freq)  # (grid, E/4)
    row_angle = angle[:, None, :].expand(grid_size, grid_size, quarter)
    col_angle = angle[None, :, :].expand(grid_size, grid_size, quarter)
    grid_angle = torch.cat([row_angle, col_angle], dim=-1).flatten(0, 1)  # (grid^2, E/2)
    table = torch.stack([grid_angle.cos(), grid_angle.sin()], dim=-1)  # (grid^2, E/2, 2)
    return torch.cat([torch.zeros(cls_token_num, head_dim // 2, 2), table])


def apply_rotary(x: Tensor, rotary: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]). x: (B, T, H, E); rotary: (B, T, E/2, 2)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, E/2, 2)
    cos, sin = rotary[:, :, None, :, 0], rotary[:, :, None, :, 1]
    rotated = torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1
    )
    return rotated.flatten(-2).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Multi-head attention with a fused qkv projection, 2D rotary and an explicit KV cache."""

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, config.head_dim
        self.wqkv = nn.Linear(config.dim, (config.num_heads + 2 * config.kv_heads) * config.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, rotary: Tensor, mask: Tensor, cache: KVCache | None, layer: int) -> Tensor:
        batch, length, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.view(batch, length, self.num_heads, self.head_dim), rotary).transpose(1, 2)  # (B,H,T,E)
        k = apply_rotary(k.view(batch, length, self.kv_heads, self.head_dim), rotary).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.write(layer, k, v)  # (B, H_kv, S, E)
        if self.kv_heads != self.num_heads:
            k = k.repeat_interleave(self.num_heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # (B, H, T, E)
        return self.wo(out.transpose(1, 2).reshape(batch, length, q_size))


class TransformerBlock(nn.Module):
    """Pre-norm decoder layer: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, rotary: Tensor, mask: Tensor, cache: KVCache | None, layer: int) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rotary, mask, cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


class CaptionMLP(nn.Module):
    """fc1 -> GELU(tanh) -> fc2, no biases."""

    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Projects caption features to the model width; holds the learned unconditional caption."""

    uncond_embedding: Tensor  # (C, F), a registered buffer

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(config.caption_dim, config.dim)
        uncond = torch.randn(config.cls_token_num, config.caption_dim) / config.caption_dim**0.5
        self.register_buffer("uncond_embedding", uncond)  # (C, F)

    def forward(self, caption_features: Tensor) -> Tensor:
        """(B, C, F) -> (B, C, D)."""
        return self.cap_proj(caption_features)


class LlamaGenTransformer(nn.Module):
    """The LlamaGen t2i GPT: caption slots then image tokens, 2D RoPE, image-vocabulary head."""

    rotary_table: Tensor  # (C + grid^2, E/2, 2), a non-persistent buffer

    def __init__(self, config: LlamaGenConfig) -> None:
        super().__init__()
        self.config = config
        self.cls_embedding = CaptionEmbedder(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        table = build_rotary_table_2d(config.grid_size, config.head_dim, config.rope_base, config.cls_token_num)
        self.register_buffer("rotary_table", table, persistent=False)  # (C + grid^2, E/2, 2)
        self.apply(_init_weights)

    def embed_captions(self, caption_features: Tensor) -> Tensor:
        """Caption features (B, C, F) -> caption-slot inputs (B, C, D)."""
        return self.cls_embedding(caption_features)

    def unconditional_captions(self, batch: int) -> Tensor:
        """The learned unconditional caption features for CFG, (B, C, F)."""
        return self.cls_embedding.uncond_embedding.expand(batch, -1, -1)

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        tree_mask: Tensor | None = None,
        new_valid: Tensor | None = None,
        return_aux: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Run T new tokens through the decoder.

        Args:
            inputs_embeds: (B, T, D) caption-slot inputs and/or image-token embeddings.
            positions: (T,) or (B, T) int64 indices into the rotary table.
            cache: KV cache holding earlier tokens; these tokens are written after them.
            tree_mask: (T, T) or (B, T, T) bool, which new tokens each new token may attend to;
                None means causal. Each token always attends to itself.
            new_valid: (B, T) bool, whether later tokens may attend to each new token
                (False for padded caption slots); None means all valid.
            return_aux: also return the residual streams named by `config.aux_layer_ids`.

        Returns:
            (hidden, aux): the last layer's post-norm hidden state (B, T, D), and the auxiliary
            streams concatenated as (B, T, len(aux_layer_ids) * D) or None.
        """
        batch, length, _ = inputs_embeds.shape
        if new_valid is None:
            new_valid = torch.ones(batch, length, dtype=torch.bool, device=inputs_embeds.device)
        mask = build_attention_mask(new_valid, cache, tree_mask)  # (B, T, S)
        if positions.dim() == 1:
            positions = positions.expand(batch, length)
        rotary = self.rotary_table[positions]  # (B, T, E/2, 2)
        aux_ids = self.config.aux_layer_ids or ()
        streams: dict[int, Tensor] = {}  # residual stream entering layer i (i = L: the last layer's output)
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            if return_aux and index in aux_ids:
                streams[index] = x
            x = layer(x, rotary, mask, cache, index)
        streams[self.config.num_layers] = x
        if cache is not None:
            cache.advance(new_valid)
        aux = torch.cat([streams[i] for i in aux_ids], dim=-1) if return_aux else None
        return self.norm(x), aux

    def allocate_cache(self, rows: int, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache for `rows` rows of up to `capacity` tokens on this model's device."""
        weight = self.output.weight
        return KVCache.allocate(
            self.config.num_layers, rows, self.config.kv_heads, capacity, self.config.head_dim,
            dtype=dtype or weight.dtype, device=weight.device,
        )  # fmt: skip


def build_attention_mask(new_valid: Tensor, cache: KVCache | None, tree_mask: Tensor | None) -> Tensor:
    """Boolean attention mask of T new tokens over all S = cached + new columns.

    A new token attends to every valid cached column, to the new tokens allowed by `tree_mask`
    (causal when None) that are valid, and always to itself (so padded rows are never empty).

    Returns:
        (B, T, S) bool.
    """
    batch, length = new_valid.shape
    device = new_valid.device
    if tree_mask is None:
        tree_mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if tree_mask.dim() == 2:
        tree_mask = tree_mask.expand(batch, length, length)
    eye = torch.eye(length, dtype=torch.bool, device=device)
    new_block = (tree_mask & new_valid[:, None, :]) | eye  # (B, T, T)
    if cache is None or cache.length == 0:
        return new_block
    cached = cache.column_valid[:, None, : cache.length].expand(batch, length, cache.length)  # (B, T, S - T)
    return torch.cat([cached, new_block], dim=-1)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


LLAMAGEN_PRESETS: dict[str, LlamaGenConfig] = {
    # Official t2i GPT-XL: 36 layers, width 1280, 20 heads, 120 T5-XL caption slots, 16384 codes.
    "t2i-XL-stage1": LlamaGenConfig(grid_size=16),
    "t2i-XL-stage2": LlamaGenConfig(grid_size=32),
    # Shapes only, for tests of the key layout.
    "tiny": LlamaGenConfig(
        dim=64,
        num_layers=2,
        num_heads=4,
        vocab_size=64,
        caption_dim=32,
        cls_token_num=8,
        grid_size=4,
        multiple_of=32,
        aux_layer_ids=(0, 1, 2),
    ),  # fmt: skip
}


def load_llamagen_checkpoint(path: str | Path, config: LlamaGenConfig) -> LlamaGenTransformer:
    """Build a model for `config` and load an official LlamaGen checkpoint with strict key checking.

    Accepts the official `torch.save` dicts (weights under "model", "module" or "state_dict", or a
    bare state dict) and safetensors files.

    Raises:
        ValueError: naming the file and the missing and unexpected keys, when they do not match.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: dict[str, Tensor] = load_file(str(path))
    else:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        for wrapper in ("model", "module", "state_dict"):
            if isinstance(loaded, dict) and isinstance(loaded.get(wrapper), dict):
                loaded = loaded[wrapper]
                break
        state = loaded
    model = LlamaGenTransformer(config)
    state = {key.removeprefix("_orig_mod."): value for key, value in state.items()}
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the LlamaGen layout of {config}: missing keys {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}. Check the preset (dim, num_layers, caption_dim) "
            "against the checkpoint."
        )
    model.load_state_dict(state, strict=True)
    return model
