"""The decoding half of Meta Chameleon's VQGAN image tokenizer (`vqgan.ckpt`), written for this project.

    vq = load_chameleon_vqgan("chameleon/tokenizer/vqgan.ckpt")     # strict on the decoder path
    pixels = vq.decode_code(codes, grid=(48, 48))                    # (B, 3, 768, 768) in about [-1, 1]

Lumina-mGPT decodes its image tokens with this model (`lumina_mgpt/model/chameleon_vae_ori/vqgan.py`,
a trimmed copy of taming-transformers' `VQModel`); the weights come with the gated Meta Chameleon
release under the Chameleon licence, separately from the language model. Parameter names and shapes
follow taming's `VQModel`, so the released checkpoint's decoder path loads with strict key checking.
Only what turns codes into pixels is built: the codebook (`quantize.embedding`), `post_quant_conv`
and `decoder.*`. The encoder path (`encoder.*`, `quant_conv.*`) and the training-only loss modules
(`loss.*`: discriminator, LPIPS) are recognised and skipped; any other extra key, any missing key and
any shape difference is an error naming the keys.

Architecture (`vqgan.yaml`: ch 128, ch_mult (1, 1, 2, 2, 4), 2 res blocks, attn_resolutions [],
z 256, embed_dim 256, codebook 8192 x 256, resolution 512):

- code -> codebook row (taming `VectorQuantizer2.get_codebook_entry`: a plain lookup, *no*
  l2 normalisation), laid out (B, 256, h, w) row-major;
- `post_quant_conv` (1x1, embed_dim -> z) -> `decoder.conv_in` (3x3, z -> ch * ch_mult[-1]);
- `decoder.mid.block_1`, `decoder.mid.attn_1`, `decoder.mid.block_2`: res block, attention, res block;
- `decoder.up.{i}` is indexed by *resolution level* (taming builds it with `up.insert(0, ...)`):
  `up.{n-1}` (ch * ch_mult[-1]) runs first and `up.0` (ch * ch_mult[0]) last. Level i has
  `block.{0..num_res_blocks}` (the first changes the width, with a 1x1 `nin_shortcut` when it
  differs), `attn.{j}` after block j only when the level's resolution (resolution / 2^i) is in
  attn_resolutions (never for Chameleon), and `upsample.conv` (nearest x2, then 3x3) when i > 0;
- `decoder.norm_out` (GroupNorm 32, eps 1e-6), swish, `decoder.conv_out` (3x3, -> 3 channels).

The blocks are LlamaGen's (`models.vq16`: same taming-derived res block, attention block and
upsampling, GroupNorm(32, eps 1e-6), swish, no time embedding); only the naming, the level order
and the codebook differ. Every width must be a multiple of 32.

Shapes: B images, G = h * w codes, e codebook dimension, C channels, H x W pixels.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from models.vq16 import (
    AttnBlock,
    CodeDecoder,
    DecoderLevel,
    ResBlock,
    _group_norm,
    _read_state_dict,
    _swish,
    check_decoder_state_dict,
    check_decoder_widths,
)

SKIPPED_PREFIXES = ("encoder.", "quant_conv.", "loss.")
"""Checkpoint keys of the encoding path and of the training losses, which decoding never uses."""


@dataclass(frozen=True, kw_only=True)
class ChameleonVQGANConfig:
    """Decoder-side architecture of a taming VQGAN (defaults: Meta Chameleon's `vqgan.yaml`)."""

    codebook_size: int = 8192
    """Number of codes V (taming `n_embed`)."""
    embed_dim: int = 256
    """Width e of a codebook row (taming `embed_dim`)."""
    z_channels: int = 256
    """Latent width after `post_quant_conv` (`ddconfig.z_channels`)."""
    ch: int = 128
    """Base channel count."""
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    """Channel multiplier per level; len - 1 upsamplings (5 levels: 16x)."""
    num_res_blocks: int = 2
    """The decoder has num_res_blocks + 1 res blocks per level."""
    attn_resolutions: tuple[int, ...] = ()
    """Level resolutions (resolution / 2^level) with attention after each res block; Chameleon: none."""
    resolution: int = 512
    """Training image side; only places the attention blocks of `attn_resolutions`."""
    out_channels: int = 3
    """Image channels (`ddconfig.out_ch`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", check_decoder_widths(self.ch, self.ch_mult))
        object.__setattr__(self, "attn_resolutions", tuple(int(r) for r in self.attn_resolutions))

    @property
    def downsample(self) -> int:
        """Pixels per code along a side (16 for Chameleon)."""
        return 2 ** (len(self.ch_mult) - 1)

    def level_has_attention(self, level: int) -> bool:
        """Whether level `level` (0 = full resolution) has attention blocks (taming's `curr_res` rule)."""
        return self.resolution // 2**level in self.attn_resolutions

    @classmethod
    def from_yaml(cls, path: str | Path) -> ChameleonVQGANConfig:
        """The config of a taming `VQModel` yaml (`model.params`: `n_embed`, `embed_dim`, `ddconfig`).

        Raises:
            ValueError: for settings this decoder does not implement (`tanh_out`, `give_pre_end`,
                linear attention, `resamp_with_conv: false`, index `remap`).
        """
        import yaml

        with open(path) as handle:
            loaded = yaml.safe_load(handle)
        params: dict[str, Any] = loaded.get("model", loaded).get("params", loaded)
        missing = [key for key in ("n_embed", "embed_dim", "ddconfig") if key not in params]
        if missing:
            raise ValueError(f"{path}: not a taming VQModel config, model.params lacks {missing}")
        dd: dict[str, Any] = params["ddconfig"]
        unsupported = {
            "tanh_out": bool(dd.get("tanh_out", False)),
            "give_pre_end": bool(dd.get("give_pre_end", False)),
            "use_linear_attn": bool(dd.get("use_linear_attn", False)),
            "attn_type != vanilla": dd.get("attn_type", "vanilla") != "vanilla",
            "resamp_with_conv: false": not dd.get("resamp_with_conv", True),
            "remap": params.get("remap") is not None,
        }
        if any(unsupported.values()):
            raise ValueError(f"{path}: unsupported VQGAN settings {[k for k, v in unsupported.items() if v]}")
        return cls(
            codebook_size=int(params["n_embed"]),
            embed_dim=int(params["embed_dim"]),
            z_channels=int(dd["z_channels"]),
            ch=int(dd["ch"]),
            ch_mult=tuple(dd["ch_mult"]),
            num_res_blocks=int(dd["num_res_blocks"]),
            attn_resolutions=tuple(dd.get("attn_resolutions", ())),
            resolution=int(dd["resolution"]),
            out_channels=int(dd.get("out_ch", 3)),
        )


def resolve_config(config: ChameleonVQGANConfig | dict | str | Path | None) -> ChameleonVQGANConfig:
    """A config, its fields as a dict, a path to a taming yaml, or None (the Chameleon VQGAN)."""
    if config is None:
        return ChameleonVQGANConfig()
    if isinstance(config, ChameleonVQGANConfig):
        return config
    if isinstance(config, dict):
        known = {f.name for f in fields(ChameleonVQGANConfig)}
        if set(config) - known:
            raise ValueError(f"unknown ChameleonVQGANConfig fields {sorted(set(config) - known)}")
        return ChameleonVQGANConfig(**config)
    return ChameleonVQGANConfig.from_yaml(config)


class MidBlock(nn.Module):
    """`block_1` (res), `attn_1` (attention), `block_2` (res) at the deepest width."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block_1 = ResBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResBlock(channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Decoder(nn.Module):
    """Latent (B, z, h, w) -> pixels (B, 3, h * 2^(n-1), w * 2^(n-1)), taming naming."""

    def __init__(self, config: ChameleonVQGANConfig) -> None:
        super().__init__()
        mult = config.ch_mult
        levels = len(mult)
        width = config.ch * mult[-1]
        self.conv_in = nn.Conv2d(config.z_channels, width, kernel_size=3, stride=1, padding=1)
        self.mid = MidBlock(width)
        built: dict[int, DecoderLevel] = {}
        for level in reversed(range(levels)):  # processing order: deepest (ch_mult[-1]) first
            out = config.ch * mult[level]
            built[level] = DecoderLevel(width, out, config.num_res_blocks + 1, config.level_has_attention(level),
                                        level != 0, block_name="block")  # fmt: skip
            width = out
        self.up = nn.ModuleList(built[level] for level in range(levels))  # up.{i} = level i, as taming
        self.norm_out = _group_norm(width)
        self.conv_out = nn.Conv2d(width, config.out_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(range(len(self.up))):  # up.{n-1} first, up.0 last
            h = self.up[level](h)
        return self.conv_out(_swish(self.norm_out(h)))


class Codebook(nn.Module):
    """The quantizer's codebook (`quantize.embedding`): codes -> latent vectors, no normalisation."""

    def __init__(self, config: ChameleonVQGANConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.codebook_size, config.embed_dim)

    def lookup(self, codes: Tensor) -> Tensor:
        """(...,) int64 -> (..., e): the raw rows (taming `VectorQuantizer2` does not normalise)."""
        return self.embedding.weight[codes]


class ChameleonVQGANDecoder(CodeDecoder):
    """Codebook + `post_quant_conv` + decoder of Chameleon's VQGAN, keyed as the released checkpoint.

    Called as a module, (B, h, w) codes -> (B, 3, H, W) pixels: the `vq_decoder` contract of `LuminaTarget`.
    """

    def __init__(self, config: ChameleonVQGANConfig | None = None) -> None:
        super().__init__()
        self.config = config or ChameleonVQGANConfig()
        self.quantize = Codebook(self.config)
        self.post_quant_conv = nn.Conv2d(self.config.embed_dim, self.config.z_channels, kernel_size=1)
        self.decoder = Decoder(self.config)

    def forward(self, codes: Tensor) -> Tensor:
        """(B, h, w) codes -> (B, 3, H, W) pixels in about [-1, 1]."""
        return self.decode_code(codes.flatten(1), (int(codes.shape[-2]), int(codes.shape[-1])))


def check_chameleon_vqgan_state_dict(
    state: dict[str, Tensor], model: ChameleonVQGANDecoder, source: str = "state dict"
) -> dict[str, Tensor]:
    """The decoder-path entries of a taming VQGAN state dict, after checking them against `model`.

    Encoder-path (`encoder.`, `quant_conv.`) and loss (`loss.`) keys are dropped; `_orig_mod.` prefixes are removed.

    Raises:
        ValueError: naming the missing keys, the unexpected keys and the keys whose shapes differ.
    """
    return check_decoder_state_dict(
        state, model, source, SKIPPED_PREFIXES, (), f"the Chameleon VQGAN decoder layout of {model.config}",
        "Check codebook_size, embed_dim, ch, ch_mult, z_channels, num_res_blocks and attn_resolutions against "
        "the file (or its vqgan.yaml).",
    )  # fmt: skip


def load_chameleon_vqgan(
    path: str | Path, config: ChameleonVQGANConfig | dict | str | Path | None = None
) -> ChameleonVQGANDecoder:
    """Build a decoder for `config` and load a taming VQGAN checkpoint into it, in float32 on the CPU, frozen.

    Args:
        path: Meta's `vqgan.ckpt` (Lightning style, weights under "state_dict"), another `torch.save`
            wrapper or a bare state dict, or a safetensors file. Read with `weights_only=True`.
        config: a `ChameleonVQGANConfig`, its fields, the path of the release's `vqgan.yaml`, or None
            (the Chameleon VQGAN defaults).

    Raises:
        ValueError: naming the file and the missing, unexpected and mis-shaped keys; or when the file
            pickles objects other than tensors and plain containers.
    """
    path = Path(path)
    model = ChameleonVQGANDecoder(resolve_config(config))
    try:
        raw = _read_state_dict(path)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{path} pickles objects torch.load(weights_only=True) refuses ({error}). If you trust the file, "
            "convert it once: torch.save(torch.load(path, weights_only=False)['state_dict'], 'vqgan.pt')"
        ) from error
    state = check_chameleon_vqgan_state_dict(raw, model, source=str(path))
    model.load_state_dict(state, strict=True)
    return model.float().eval().requires_grad_(False)
