"""The decoding form of an EAGLE drafter: fused projections, 2-D matmuls, rotary on q, k and v at once.

`FusedDraftStep(model)` computes what `EagleDraftModel.forward` followed by `draft_logits` computes
through a KV cache, in under half the aten ops per call (48 against 116 for the toy's EAGLE-3 head on CPU).
Decoding runs the drafter once per tree level, and on a GPU every eager op is a kernel launch (on this
CPU about 5-10 us each), so the drafter's op count, not its arithmetic, is what a speculative step
pays for it:

- the step works on (rows * elements, width) 2-D tensors from its first line to its last, so every
  projection is one `mm` (`nn.Linear` on a 3-D input dispatches `t`, `view`, `mm` and `_unsafe_view`);
  q, k and v come from one matmul against their concatenated, pre-transposed weights, gate and up
  from another, and the residual additions ride on `addmm`;
- EAGLE-3's two input norms (token embedding, hidden state) run as one norm over a (rows, 2, H) view;
- the rotary angles are position x [-f, f] (f the inverse frequencies): their cosine is [cos, cos] and
  their sine [-sin, sin], so q and k, adjacent in the fused output, are rotated together as
  x cos + roll(x, E/2) sin (one `addcmul`), which equals Llama's x cos + rotate_half(x) sin exactly;
  v's heads ride along with frequency 0 (x cos 0 + roll(x) sin 0 = x exactly), so k | v leaves as
  one block that the cache stores with one copy (`KVCache.write_entries`); the heads are transposed
  once, before q and k | v are split off as views;
- the RMSNorm weights are folded into the projection that follows each norm; on CPU, where `F.rms_norm`
  runs as five ops (pow, mean, add, rsqrt, mul), each norm is three, x / hypot(||x||, sqrt(eps H)),
  whose missing factor sqrt(H) is folded in too (on CUDA `F.rms_norm` is one fused kernel and stays).

The fused weights are copies, rebuilt whenever a parameter of the model changes (optimizer steps
bump `Tensor._version`) or moves, so a drafter that is still training decodes with its current
weights. They double the drafter's weight memory while the step object lives. The training path
(`EagleDraftModel.unroll`) keeps the module form; tests check both against each other.

Shapes: R rows, T new elements, S cache columns, h query heads, g key/value heads, E head width,
H hidden size, I MLP width, Vd draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models.eagle import EagleDraftModel
from models.kv_cache import KVCache


@dataclass(frozen=True)
class FusedWeights:
    """The fused, pre-transposed copies of a drafter's weights (`FusedDraftStep.weights`)."""

    fc: Tensor  # (Df or 2H, H) pre-transposed
    fc_bias: Tensor | None  # (H,)
    qkv: Tensor  # (in, (h + 2g) E), EAGLE-3: rows scaled by the input and hidden norms' weights
    out: Tensor  # (h E, H)
    gate_up: Tensor  # (H, 2 I), rows scaled by the post-attention norm's weight
    down: Tensor  # (I, H)
    lm_head: Tensor | None  # (H, Vd), EAGLE-3, rows scaled by the final norm's weight
    signed_inv_freq: Tensor  # (h + 2g, 1, E) float32: [-f, f] with f the rotary inverse frequencies, 0 for v's heads
    eps: float  # the norms' epsilon
    norm_floor: Tensor | None  # () sqrt(eps H): the norms' three-op form (`_unit_rms`), sqrt(H) folded in
    # above; None = F.rms_norm


class FusedDraftStep:
    """One drafter pass through a KV cache with fused weights; see the module docstring."""

    def __init__(self, model: EagleDraftModel, three_op_norms: bool | None = None) -> None:
        """`three_op_norms`: run the norms in `_unit_rms`'s three-op form; None = where the model's weights
        live on the CPU (on CUDA `F.rms_norm` is one fused kernel)."""
        self.model = model
        self.three_op_norms = three_op_norms
        self._parameters = list(model.parameters())  # walked once: named_modules costs ~0.2 ms a call
        self._weights: FusedWeights | None = None
        self._key: tuple[tuple[int, int], ...] = ()

    def weights(self) -> FusedWeights:
        """The fused copies of the model's current weights (rebuilt when any parameter changed)."""
        key = tuple((p.data_ptr(), p._version) for p in self._parameters)
        if self._weights is None or key != self._key:
            self._weights = self._fuse()
            self._key = key
        return self._weights

    @torch.no_grad()
    def _fuse(self) -> FusedWeights:
        model, config = self.model, self.model.config
        attention, mlp = model.layer.self_attn, model.layer.mlp
        layer, device = model.layer, model.fc.weight.device
        three_op_norms = device.type == "cpu" if self.three_op_norms is None else self.three_op_norms
        norm_gain = config.hidden_size**0.5 if three_op_norms else 1.0  # what the three-op form leaves out
        qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).t()
        if config.architecture == "eagle3":  # (x * w) @ W = x @ (w[:, None] * W): the norms' scale moves into W
            qkv = qkv * (torch.cat([layer.input_layernorm.weight, layer.hidden_norm.weight]) * norm_gain)[:, None]
        exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
        inv_freq = 1.0 / (config.rope_theta**exponents)  # (E/2,)
        return FusedWeights(
            fc=model.fc.weight.t().contiguous(),
            fc_bias=None if model.fc.bias is None else model.fc.bias.detach().clone(),
            qkv=qkv.contiguous(),
            out=attention.o_proj.weight.t().contiguous(),
            gate_up=(
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()
                * (layer.post_attention_layernorm.weight * norm_gain)[:, None]
            ).contiguous(),  # fmt: skip
            down=mlp.down_proj.weight.t().contiguous(),
            lm_head=(model.lm_head.weight.t() * (model.norm.weight * norm_gain)[:, None]).contiguous()
            if config.architecture == "eagle3"
            else None,  # fmt: skip
            signed_inv_freq=torch.cat([-inv_freq, inv_freq])  # (h + 2g, 1, E): zero for the value heads
            .expand(config.num_heads + 2 * config.kv_heads, 1, -1)
            .masked_fill(
                torch.arange(config.num_heads + 2 * config.kv_heads, device=device)[:, None, None]
                >= config.num_heads + config.kv_heads,
                0.0,
            ),
            eps=config.rms_norm_eps,
            norm_floor=torch.tensor((config.rms_norm_eps * config.hidden_size) ** 0.5, device=device)
            if three_op_norms
            else None,  # fmt: skip
        )

    def rotary_per_column(self, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """`run`'s `rotary` for each column of positions (R, L), computed at once: (cos, sin) (R, heads, 1, E)
        per column, for a pass whose elements all sit at that column's position (a tree level)."""
        cos, sin = rotary_tables(positions, self.weights().signed_inv_freq)  # (R, heads, L, E) each
        return list(zip(cos.split(1, dim=2), sin.split(1, dim=2), strict=True))

    def run(
        self,
        w: FusedWeights,
        embeds: Tensor,
        features: Tensor,
        positions: Tensor,
        mask: Tensor,
        *,
        from_target: bool,
        cache: KVCache,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """`EagleDraftModel.forward(..., cache=cache)` with the fused weights `w` (`weights()`): embeds (R, T, H),
        features (R, T, Df) or (R, T, H), positions (R, T), mask (R, T, S) over the keys, bool or the additive
        bias attention makes of one (0 or -inf, in the drafter's dtype) -> the drafter hidden (R, T, H). Writes
        this pass's keys and values into `cache` after its filled columns (the caller advances it). The pure
        tensor part, which `--compile` traces whole: the weights' rebuild check reads parameter versions,
        which would break the graph, so the caller makes it (once per call in `EagleDrafter`). `rotary`: the
        (cos, sin) of `rotary_tables` at `positions`, computed before (once per tree, for all its
        levels), with T or 1 elements when all T share one position; None = computed here."""
        config = self.model.config
        rows, length = positions.shape
        heads, kv_heads, head_dim = config.num_heads, config.kv_heads, config.head_dim
        dtype = w.fc.dtype
        # every projection works on (R * T, width): 2-D matmuls, no reshapes around each one
        embeds = embeds.to(dtype).reshape(rows * length, -1)  # (RT, H)
        features = features.to(dtype).reshape(rows * length, -1)  # (RT, Df) or (RT, H)
        if config.architecture == "eagle1":
            hidden = _project(torch.cat([embeds, features], dim=-1), w.fc, w.fc_bias)  # (RT, H)
            attention_input = hidden
        else:
            hidden = _project(features, w.fc, w.fc_bias) if from_target else features
            # both norms at once: (RT, 2, H) normalised over H, then back to (RT, 2H)
            attention_input = _unit_rms(torch.cat([embeds, hidden], dim=-1).view(rows * length, 2, -1), w)
            attention_input = attention_input.view(rows * length, -1)
        qkv = torch.mm(attention_input, w.qkv).view(rows, length, heads + 2 * kv_heads, head_dim).transpose(1, 2)
        # q and k rotate, v turns by angle 0 (x cos 0 + roll(x) sin 0 = x): then k | v is one block for the cache
        cos, sin = rotary_tables(positions, w.signed_inv_freq) if rotary is None else rotary
        q, kv = _rotate(qkv, cos, sin).split([heads, 2 * kv_heads], dim=1)  # (R, h|2g, T, E)
        keys, values = cache.write_entries(0, kv.to(cache.entries.dtype))  # (R, g, S, E) each
        attended = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], enable_gqa=kv_heads != heads
        )  # (R, h, T, E)
        attended = attended.transpose(1, 2).reshape(rows * length, heads * head_dim)  # (RT, h E)
        h = torch.addmm(hidden, attended, w.out)  # hidden + attention output, (RT, H)
        gate, up = torch.mm(_unit_rms(h, w), w.gate_up).chunk(2, dim=-1)  # (RT, I) each
        return torch.addmm(h, F.silu(gate) * up, w.down).view(rows, length, -1)  # h + MLP, (R, T, H)

    def draft_logits(
        self,
        hidden: Tensor,
        image_head: Callable[[Tensor], Tensor],
        cfg_scale: float | None = None,
        weights: FusedWeights | None = None,
    ) -> tuple[Tensor, bool]:
        """`EagleDraftModel.draft_logits`: (R, T, H) -> (R, T, Vd), and whether CFG was applied.

        With `cfg_scale` and the drafter's own head, which is linear (its norm weight folded in), the
        [cond; uncond] rows are combined before it: head(u + s (c - u)) = head(u) + s (head(c) - head(u)),
        so half the rows go through the widest matmul -> (B, T, Vd), guided. The target's head (EAGLE-1
        without its own) may not be linear (Janus's is an MLP): its logits come back unguided. `weights`: the
        fused weights the caller already checked (`weights()`); None = checked here.
        """
        w = self.weights() if weights is None else weights
        if w.lm_head is None:
            return image_head(hidden), False
        normed = _unit_rms(hidden, w)  # (R, T, H)
        if cfg_scale is None:
            return _project(normed, w.lm_head), False
        cond, uncond = normed.float().chunk(2, dim=0)  # combined in fp32, like logits-space CFG
        return _project(torch.lerp(uncond, cond, cfg_scale).to(normed.dtype), w.lm_head), True


def _project(x: Tensor, weight_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ weight_t (in, out) [+ bias] as one 2-D matmul -> (..., out)."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight_t.shape[1])


def _unit_rms(x: Tensor, w: FusedWeights) -> Tensor:
    """RMSNorm without its weight (folded into the next projection) over the last dim of x (..., H), in fp32
    like `RMSNorm` -> (..., H) in x's dtype. With `w.norm_floor` (CPU) it returns x / sqrt(mean(x^2) + eps)
    divided by sqrt(H), which the next projection's weights carry: x / sqrt(||x||^2 + eps H) is three ops, a
    norm, a hypot and a division (about 9 against 19 us for `F.rms_norm`'s five on this CPU). Without it,
    `F.rms_norm`, one fused kernel on CUDA."""
    if w.norm_floor is None:
        return F.rms_norm(x, (x.shape[-1],), eps=w.eps)
    x_float = x.float()
    return (x_float / torch.hypot(torch.linalg.vector_norm(x_float, dim=-1, keepdim=True), w.norm_floor)).type_as(x)


def rotary_tables(positions: Tensor, signed_inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of every head's rotary angles at positions (R, T) -> (R, heads, T, E) fp32 each.

    With f the inverse frequencies, `signed_inv_freq` (heads, 1, E) is [-f, f] (0 for a head that stays as
    it is) and a = position * [-f, f]: cos(a) = [cos, cos] and sin(a) = [-sin, sin] (cos is even, sin odd).
    """
    angles = positions[:, None, :, None] * signed_inv_freq  # (R, heads, T, E) fp32: int64 x fp32 promotes
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Llama half-split rotary embedding of x (R, heads, T, E), computed in fp32, with `rotary_tables`'
    cos and sin (R, heads, T or 1, E): x cos(a) + roll(x, E/2) sin(a) is x cos + rotate_half(x) sin."""
    x_float = x.float()
    return torch.addcmul(x_float * cos, x_float.roll(x.shape[-1] // 2, dims=-1), sin).type_as(x)
