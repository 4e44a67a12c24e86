"""The layers of an EAGLE drafter: rotary embedding, attention with a KV cache and a tree mask, SwiGLU MLP.

`models.eagle.EagleDraftModel` stacks them (one `DraftLayer` for EAGLE-1 and EAGLE-3).

Shapes: R rows, T new elements, S cache columns, H heads, Dh head width, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.drafter_config import DrafterConfig
from models.kv_cache import KVCache
from models.llamagen import RMSNorm

# ----------------------------------------------------------------------------- layers


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Llama (half-split) rotary tables for explicit positions: (R, T) -> cos, sin (R, 1, T, E)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (R, T, E/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (R, 1, T, E)
    return angles.cos(), angles.sin()


def apply_rotary_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (R, heads, T, E) rotated by (cos, sin): x cos + rotate_half(x) sin."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated * sin).type_as(x)


class DraftAttention(nn.Module):
    """Multi-head attention over an explicit key set: the KV cache (decoding) or earlier TTT steps (training)."""

    def __init__(self, config: DrafterConfig, input_size: int) -> None:
        super().__init__()
        self.config = config
        heads, kv_heads, head_dim = config.num_heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(input_size, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        mask: Tensor,
        cache: KVCache | None = None,
        past: tuple[list[Tensor], list[Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (R, T, in), positions (R, T), mask (R, T, S) over the keys -> (R, T, H) and this call's k, v.

        Keys are `cache`'s filled columns plus the new ones (S = cache.length + T), or the blocks in
        `past` followed by the new ones (S = (len(past) + 1) T), or the new ones alone.
        """
        rows, length, _ = x.shape
        config = self.config
        q = self.q_proj(x).view(rows, length, config.num_heads, config.head_dim).transpose(1, 2)  # (R, h, T, E)
        k = self.k_proj(x).view(rows, length, config.kv_heads, config.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(rows, length, config.kv_heads, config.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(positions, config.head_dim, config.rope_theta)
        q, k = apply_rotary_half(q, cos, sin), apply_rotary_half(k, cos, sin)
        if cache is not None:
            keys, values = cache.write(0, k.to(cache.entries.dtype), v.to(cache.entries.dtype))
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        elif past is not None:
            keys, values = torch.cat([*past[0], k], dim=2), torch.cat([*past[1], v], dim=2)
        else:
            keys, values = k, v
        if config.kv_heads != config.num_heads:
            repeat = config.num_heads // config.kv_heads
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])  # (R, h, T, E)
        return self.o_proj(out.transpose(1, 2).reshape(rows, length, -1)), k, v


class DraftMLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The drafter's one decoder layer (EAGLE-1: no input norm; EAGLE-3: attention over 2H inputs)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.eagle3 = config.architecture == "eagle3"
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if self.eagle3:
            self.input_layernorm = RMSNorm(hidden, eps)
            self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = DraftAttention(config, 2 * hidden if self.eagle3 else hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = DraftMLP(config)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        mask: Tensor,
        cache: KVCache | None = None,
        past: tuple[list[Tensor], list[Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """embeds (R, T, H) token embeddings (EAGLE-3 only), hidden (R, T, H) -> out (R, T, H), k, v."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1) if self.eagle3 else hidden
        attended, k, v = self.self_attn(x, positions, mask, cache, past)
        h = hidden + attended
        return h + self.mlp(self.post_attention_layernorm(h)), k, v
