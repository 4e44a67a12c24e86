"""The decoding half of LlamaGen's VQ-16 image tokenizer (`vq_ds16_t2i.pt`), written for this project.

    vq = load_vq16_checkpoint("pretrained_models/vq_ds16_t2i.pt")      # strict on the decoder path
    pixels = vq.decode_code(codes, grid=(32, 32))                       # (B, 3, 512, 512) in about [-1, 1]

Parameter names and shapes follow the official `tokenizer/tokenizer_image/vq_model.py`
(FoundationVision/LlamaGen, `VQ_16`), so the official checkpoint's decoder path loads with strict key
checking. Only what turns codes into pixels is built: the codebook (`quantize.embedding`),
`post_quant_conv` and `decoder.*`. The checkpoint's encoder path (`encoder.*`, `quant_conv.*`) and the
training-only usage buffer `quantize.codebook_used` are recognised and skipped; any other extra key,
any missing key and any shape difference is an error naming the keys.

Architecture (VQ-16: ch 128, ch_mult (1, 1, 2, 2, 4), 2 res blocks, z 256, codebook 16384 x 8):

- code -> codebook row, l2-normalised (`codebook_l2_norm`), laid out (B, 8, h, w) row-major;
- `post_quant_conv` (1x1, 8 -> z) -> `decoder.conv_in` (3x3, z -> ch * ch_mult[-1]);
- `decoder.mid.0/1/2`: res block, attention block, res block;
- `decoder.conv_blocks.{i}`, i = 0 .. n-1, walks the levels from the deepest (ch_mult[-1]) to the
  shallowest (ch_mult[0]); each has `res.{0..num_res_blocks}` (the first changes the width, with a
  1x1 `nin_shortcut`), `attn.{j}` after each res block at the deepest level only, and `upsample.conv`
  (nearest x2, then 3x3) on every level but the last;
- `decoder.norm_out` (GroupNorm 32, eps 1e-6), swish, `decoder.conv_out` (3x3, -> 3 channels).

Res block: x + conv2(dropout(swish(norm2(conv1(swish(norm1(x))))))), shortcut through `nin_shortcut`
when the width changes. Attention block: single-head attention over the h*w positions with 1x1 q, k,
v, proj_out and a 1/sqrt(C) scale. Every norm is GroupNorm(32, eps 1e-6), so every width must be a
multiple of 32.

Shapes: B images, G = h * w codes, e codebook dimension, C channels, H x W pixels.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SKIPPED_PREFIXES = ("encoder.", "quant_conv.")
"""Checkpoint keys of the encoding path, which decoding never uses."""
SKIPPED_KEYS = ("quantize.codebook_used",)
"""Training-only buffers of the official quantizer."""


@dataclass(frozen=True, kw_only=True)
class VQ16Config:
    """Decoder-side architecture of a LlamaGen VQ tokenizer (defaults: the official VQ-16)."""

    codebook_size: int = 16384
    """Number of codes V (the GPT's image vocabulary)."""
    codebook_embed_dim: int = 8
    """Width e of a codebook row."""
    codebook_l2_norm: bool = True
    """Whether codebook rows are l2-normalised before decoding (official: True)."""
    z_channels: int = 256
    """Latent width after `post_quant_conv`."""
    ch: int = 128
    """Base channel count."""
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    """Channel multiplier per level; len - 1 upsamplings (5 levels: 16x)."""
    num_res_blocks: int = 2
    """The decoder has num_res_blocks + 1 res blocks per level."""
    out_channels: int = 3
    """Image channels."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", check_decoder_widths(self.ch, self.ch_mult))

    @property
    def downsample(self) -> int:
        """Pixels per code along a side (16 for VQ-16)."""
        return 2 ** (len(self.ch_mult) - 1)


def check_decoder_widths(ch: int, ch_mult: tuple[int, ...]) -> tuple[int, ...]:
    """`ch_mult` as a tuple of ints, after checking that it names levels whose widths GroupNorm(32) accepts."""
    mult = tuple(int(m) for m in ch_mult)
    if not mult:
        raise ValueError("ch_mult must name at least one level")
    widths = [ch * m for m in mult]
    if any(w % 32 for w in widths):
        raise ValueError(f"decoder widths {widths} must be multiples of 32 (GroupNorm with 32 groups)")
    return mult


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


def _swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


class ResBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm + swish before each; 1x1 `nin_shortcut` when the width changes."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = _group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.norm2 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(_swish(self.norm1(x)))
        h = self.conv2(_swish(self.norm2(h)))  # (dropout 0 at inference)
        shortcut = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return shortcut + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the spatial positions, with 1x1 convolutions as projections."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _group_norm(channels)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        batch, channels, height, width = x.shape
        h = self.norm(x)
        q = self.q(h).flatten(2).transpose(1, 2)  # (B, hw, C)
        k = self.k(h).flatten(2)  # (B, C, hw)
        v = self.v(h).flatten(2)  # (B, C, hw)
        weights = torch.softmax(torch.bmm(q, k) * channels**-0.5, dim=2)  # (B, hw_query, hw_key)
        out = torch.bmm(v, weights.transpose(1, 2)).view(batch, channels, height, width)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class DecoderLevel(nn.Module):
    """One resolution of the decoder: res blocks, `attn` blocks after each (where asked), optional `upsample`.

    The res blocks are named `res` (LlamaGen) or `block` (taming, Chameleon's VQGAN): `block_name`.
    """

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, attention: bool, upsample: bool,
                 block_name: str = "res") -> None:  # fmt: skip
        super().__init__()
        self.block_name = block_name
        blocks = nn.ModuleList(ResBlock(in_channels if i == 0 else out_channels, out_channels)
                               for i in range(num_blocks))  # fmt: skip
        self.add_module(block_name, blocks)
        self.attn = nn.ModuleList(AttnBlock(out_channels) for _ in range(num_blocks if attention else 0))
        if upsample:
            self.upsample = Upsample(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        for index, block in enumerate(getattr(self, self.block_name)):
            x = block(x)
            if len(self.attn):
                x = self.attn[index](x)
        return self.upsample(x) if hasattr(self, "upsample") else x


class Decoder(nn.Module):
    """Latent (B, z, h, w) -> pixels (B, 3, h * 2^(n-1), w * 2^(n-1))."""

    def __init__(self, config: VQ16Config) -> None:
        super().__init__()
        mult = config.ch_mult
        levels = len(mult)
        width = config.ch * mult[-1]
        self.conv_in = nn.Conv2d(config.z_channels, width, kernel_size=3, stride=1, padding=1)
        self.mid = nn.ModuleList([ResBlock(width, width), AttnBlock(width), ResBlock(width, width)])
        blocks = []
        for level in reversed(range(levels)):  # deepest first: conv_blocks.0 is ch_mult[-1]
            out = config.ch * mult[level]
            blocks.append(DecoderLevel(width, out, config.num_res_blocks + 1, level == levels - 1, level != 0))
            width = out
        self.conv_blocks = nn.ModuleList(blocks)
        self.norm_out = _group_norm(width)
        self.conv_out = nn.Conv2d(width, config.out_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
        return self.conv_out(_swish(self.norm_out(h)))


class Codebook(nn.Module):
    """The quantizer's codebook (`quantize.embedding`): codes -> latent vectors."""

    def __init__(self, config: VQ16Config) -> None:
        super().__init__()
        self.l2_norm = config.codebook_l2_norm
        self.embedding = nn.Embedding(config.codebook_size, config.codebook_embed_dim)

    def lookup(self, codes: Tensor) -> Tensor:
        """(...,) int64 -> (..., e), l2-normalised rows when the config says so."""
        table = self.embedding.weight
        if self.l2_norm:
            table = F.normalize(table, p=2, dim=-1)
        return table[codes]


class CodeDecoder(nn.Module):
    """Codes -> pixels through a codebook (`quantize`), `post_quant_conv` and a `decoder`, the taming layout.

    Subclasses build the three modules; this class turns raster-order codes into latents and pixels.
    """

    quantize: Any  # a module with `embedding` (nn.Embedding) and `lookup(codes)`
    post_quant_conv: nn.Conv2d
    decoder: nn.Module
    config: Any  # a config with `codebook_size` and `downsample`

    @property
    def num_codes(self) -> int:
        return self.config.codebook_size

    @property
    def downsample(self) -> int:
        return self.config.downsample

    @property
    def codebook(self) -> Tensor:
        """The raw codebook (V, e), as LANTERN's neighbour table reads it (`quantize.embedding.weight`)."""
        return self.quantize.embedding.weight.detach()

    def codes_to_latents(self, codes: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """(B, G) codes in raster order -> (B, e, h, w) latents; grid None means a square h = w = sqrt(G)."""
        batch, count = codes.shape
        if grid is None:
            side = int(round(count**0.5))
            grid = (side, side)
        if grid[0] * grid[1] != count:
            raise ValueError(f"{count} codes per image do not fill a {grid[0]}x{grid[1]} grid")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_codes):
            raise ValueError(f"codes must lie in 0..{self.num_codes - 1}")
        latents = self.quantize.lookup(codes)  # (B, G, e)
        return latents.view(batch, grid[0], grid[1], -1).permute(0, 3, 1, 2).contiguous()

    def decode(self, latents: Tensor) -> Tensor:
        """(B, e, h, w) quantized latents -> (B, 3, H, W) pixels in about [-1, 1] (official `VQModel.decode`)."""
        return self.decoder(self.post_quant_conv(latents))

    def decode_code(self, codes: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """(B, G) codes -> (B, 3, H, W) pixels in about [-1, 1] (official `VQModel.decode_code`)."""
        weight = self.post_quant_conv.weight
        return self.decode(self.codes_to_latents(codes.to(weight.device), grid).to(weight.dtype))


class VQ16Decoder(CodeDecoder):
    """Codebook + `post_quant_conv` + decoder of a LlamaGen VQ tokenizer, keyed as the official checkpoint."""

    def __init__(self, config: VQ16Config | None = None) -> None:
        super().__init__()
        self.config = config or VQ16Config()
        self.quantize = Codebook(self.config)
        self.post_quant_conv = nn.Conv2d(self.config.codebook_embed_dim, self.config.z_channels, kernel_size=1)
        self.decoder = Decoder(self.config)


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """A bare state dict from a torch.save file (weights under "model"/"module"/"state_dict" or bare) or safetensors."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    # Training saves may pickle an argparse.Namespace ("args") next to the weights: allow that type only.
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    for wrapper in ("model", "module", "state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(wrapper), dict):
            return loaded[wrapper]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
    return loaded


def check_decoder_state_dict(
    state: dict[str, Tensor],
    model: nn.Module,
    source: str,
    skipped_prefixes: tuple[str, ...],
    skipped_keys: tuple[str, ...],
    layout: str,
    hint: str,
) -> dict[str, Tensor]:
    """The entries of `state` that `model` loads, after dropping the skipped keys and checking the rest.

    `_orig_mod.` prefixes (torch.compile) are removed first.

    Raises:
        ValueError: naming `source`, the missing keys, the unexpected keys and the keys whose shapes
            differ, with `layout` (what was expected) and `hint` (which settings to check).
    """
    state = {key.removeprefix("_orig_mod."): value for key, value in state.items()}
    expected = model.state_dict()
    kept = {k: v for k, v in state.items() if not (k.startswith(skipped_prefixes) or k in skipped_keys)}
    missing = sorted(set(expected) - set(kept))
    unexpected = sorted(set(kept) - set(expected))
    wrong_shape = sorted(
        f"{k} {tuple(kept[k].shape)} vs {tuple(expected[k].shape)}"
        for k in set(kept) & set(expected)
        if tuple(kept[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or wrong_shape:

        def listed(keys: list[str]) -> str:
            return f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"

        raise ValueError(
            f"{source} does not match {layout}: missing keys {listed(missing)}, unexpected keys "
            f"{listed(unexpected)}, shape mismatches (checkpoint vs model) {listed(wrong_shape)}. {hint}"
        )
    return kept


def check_vq16_state_dict(
    state: dict[str, Tensor], model: VQ16Decoder, source: str = "state dict"
) -> dict[str, Tensor]:
    """The decoder-path entries of an official VQ state dict, after checking them against `model`.

    Encoder-path keys and `quantize.codebook_used` are dropped; `_orig_mod.` prefixes are removed.

    Raises:
        ValueError: naming the missing keys, the unexpected keys and the keys whose shapes differ.
    """
    return check_decoder_state_dict(
        state, model, source, SKIPPED_PREFIXES, SKIPPED_KEYS, f"the VQ-16 decoder layout of {model.config}",
        "Check codebook_size, codebook_embed_dim, ch, ch_mult, z_channels and num_res_blocks against the file.",
    )  # fmt: skip


def load_vq16_checkpoint(path: str | Path, config: VQ16Config | None = None) -> VQ16Decoder:
    """Build a decoder for `config` (default: the official VQ-16) and load an official tokenizer checkpoint.

    Accepts `vq_ds16_t2i.pt` as released (weights under "model") and other `torch.save` wrappers or
    safetensors. The encoder path is skipped; the decoder path must match exactly.

    Raises:
        ValueError: naming the file and the missing, unexpected and mis-shaped keys.
    """
    path = Path(path)
    model = VQ16Decoder(config)
    state = check_vq16_state_dict(_read_state_dict(path), model, source=str(path))
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)
