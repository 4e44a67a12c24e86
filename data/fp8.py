"""FP8 storage of features: float8 e4m3fn codes with one float32 scale per row.

A feature stored with the manifest dtype `float8_e4m3fn` is two `.npy` members per sample:

    <field>.npy         (L, width) uint8     the e4m3fn bit patterns (codes)
    <field>_scale.npy   (L,) float32         scale_r = max|x_r| / 448 (1 for a row of zeros)

so x[r, c] ~ float(code[r, c] as e4m3fn) * scale_r. Scaling each row so its largest magnitude lands
on 448 (e4m3fn's largest finite value) uses the format's whole range for every row: the relative
error of an element is at most 2^-4 (3 mantissa bits, round to nearest), down to 2^-6 * scale_r,
below which e4m3fn's subnormals give an absolute error of at most 2^-10 * scale_r. The scale member
is implied by the dtype; the manifest lists only the field.

The casts are torch's own `torch.float8_e4m3fn` (round to nearest even; dequantising looks codes up
in a table of torch's cast of all 256 of them, `CODE_VALUES`), not bit manipulation. The
reader (`data.shard_stream.collate_samples`) dequantises into float16 batches, so a scale must keep
448 * scale below float16's overflow threshold (`MAX_SCALE`), and extraction refuses features
beyond float16's range.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

FP8_DTYPE = "float8_e4m3fn"
"""The manifest's dtype name for fields stored this way."""
CODE_DTYPE = np.dtype(np.uint8)
"""How the codes are stored (numpy's .npy has no float8)."""
SCALE_DTYPE = np.dtype(np.float32)
E4M3_MAX = 448.0
"""e4m3fn's largest finite value (0x7E: 1.75 * 2^8); there is no Inf, and 0x7F / 0xFF are NaN."""
NAN_BITS = 0x7F
"""code & 0x7F == 0x7F is NaN (S.1111.111), for either sign."""
FLOAT16_MAX = 65504.0
MAX_SCALE = 65520.0 / E4M3_MAX
"""Scales must stay below this: 448 * scale then rounds to at most 65504 in float16 (65520 rounds to Inf)."""


def scale_member(field: str) -> str:
    """The member holding a float8 field's row scales: `hidden` -> `hidden_scale`."""
    return f"{field}_scale"


def quantize_rows(x: np.ndarray | Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Quantise features to e4m3fn codes with a scale per row (the last axis is a row).

    Args:
        x: (..., L, width) finite floats (float16 or float32; checked by the caller).

    Returns:
        codes (..., L, width) uint8 and scales (..., L) float32, with scale = max|row| / 448, or 1 for a
        row whose scale would be 0 (all zeros, or so small that max|row| / 448 underflows float32).
    """
    values = torch.as_tensor(x).float()  # (..., L, width)
    scales = values.abs().amax(dim=-1) / E4M3_MAX  # (..., L)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = (values / scales[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)  # the row max may round just above 448
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)  # (..., L, width)
    return codes.numpy(), scales.numpy()


CODE_VALUES: np.ndarray = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
"""(256,) float32: torch's float8_e4m3fn -> float32 cast of every code (NaN at 0x7F and 0xFF).

Dequantising looks codes up here instead of casting each time: the lookup is the same cast, done once.
Measured on this project's 2-core CPU for a (4, 36, 384) batch: the table gather and multiply take
~0.16 ms; torch's CPU cast alone ~0.27 ms on one thread and 1.2-4.9 ms with its two intra-op threads."""


def dequantize_rows(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """codes (..., L, width) uint8 and scales (..., L) float32 -> (..., L, width) features: code * scale.

    Args:
        codes, scales: as `quantize_rows` returns them, or read-only views of a shard's members.
        out: optional (..., L, width) array to write into, e.g. a float16 batch row (the float32
            product is rounded to its dtype); else a new float32 array is returned.
    """
    values = CODE_VALUES[codes]  # (..., L, width) float32: the codes as float8 -> float32
    return np.multiply(values, scales[..., None], out=out, casting="same_kind")


def codes_problem(codes: np.ndarray) -> str | None:
    """NaN codes (0x7F or 0xFF; e4m3fn has no Inf) in (L, width) uint8 codes, or None.

    One masked copy and a max reduction; only a failing array is scanned again for the first NaN.
    """
    if codes.size == 0:
        return None
    low_bits = codes & NAN_BITS  # (L, width)
    if int(low_bits.max()) < NAN_BITS:
        return None
    bad = low_bits == NAN_BITS
    where = np.argwhere(bad)[0].tolist()
    return (
        f"{np.count_nonzero(bad)} NaN codes (0x7F/0xFF), the first at row {where[0]}, column {where[1]}; "
        "extraction never writes them (it refuses non-finite features), so the shard is corrupt"
    )


def scales_problem(scales: np.ndarray) -> str | None:
    """What is wrong with (L,) float32 row scales, or None: each must be finite, > 0 and < MAX_SCALE."""
    if scales.size == 0:
        return None
    low, high = float(scales.min()), float(scales.max())  # NaN propagates and fails both tests
    if low > 0 and high < MAX_SCALE:
        return None
    bad = ~((scales > 0) & (scales < MAX_SCALE))  # (L,); NaN compares False
    first = int(np.flatnonzero(bad)[0])
    return (
        f"{np.count_nonzero(bad)} bad row scale(s), the first {float(scales[first])!r} at row {first}; a scale "
        f"must be finite, > 0 and < {MAX_SCALE} (448 * scale must fit float16, the batch dtype), so the shard "
        "is corrupt"
    )
