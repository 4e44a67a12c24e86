"""Lumina-mGPT's image sequence in Chameleon's vocabulary: the prompt turn, the image header, the codes with
their end-of-line tokens, and the rule that says which token may stand where (used by `models.lumina`).

Upstream sequence (the Lumina-mGPT repository's `FlexARItemProcessor` and `inference_solver.py`)::

    BOS  "Generate an image of {W}x{H} according to the following prompt:\\n{prompt}"  <reserved08706>
    <racm3:break>  <reserved{8800 + rows/2}>  <reserved{8800 + cols/2}>              (image header)
    rows x ( cols image codes as BPE ids, <reserved08799> )                         (codes + end-of-line)
    <eoss>                                                                          (end of image)

The image vocabulary V seen through the interface (`image_vocab_size` = K + 2, 8194 for the real model):

- index k < K (K = number of `IMGIMG*` entries of `config.vocabulary_map`, 8192): VQ code k, i.e.
  Chameleon BPE id `vocabulary_mapping.img2bpe[k]` (not an identity or offset map);
- index K (`eol_index`): end-of-line `<reserved08799>` (8803 in the real vocabulary);
- index K + 1 (`eoi_index`): end-of-image `<eoss>` (8196).

`token_ids` (V,) maps an interface index to its Chameleon id; `interface_index` maps back (-1 outside V).

Geometry: the generated image is the code grid *with its end-of-line column*: `geometry.grid` =
(rows, cols + 1) so G = rows * (cols + 1) (2352 for 768 px); token j is an end-of-line exactly when
j % (cols + 1) == cols. The end-of-image token that follows (upstream forces it right after the last
end-of-line) is deterministic, carries no information and is not part of G; `layout_mask(G)` still
names it, for a decoder that wants to emit the full Chameleon span (`chameleon_ids`).
`geometry.image_size` is the pixel size, (rows, cols) x the VQ downsampling factor.

Layout rule (upstream `MultiModalLogitsProcessor`): `layout_mask(token_index)` gives, per image
token index, the allowed V entries (codes only at code slots, only end-of-line at row ends, only
end-of-image at index G); `apply_layout` turns it into -inf logits. `forward` returns the raw image
logits of all V entries; the decoders (`inference/decoding/generate.py`, `inference/decoding/speculative.py`,
`inference/decoding/drafter.py`) apply the rule through `constrain_logits` after CFG and before
temperature/top-k, upstream's order (CFG -> layout mask -> top-k 2000), to target and drafter logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
"""The human turn; the resolution string is part of the conditioning."""
END_OF_TURN = "<reserved08706>"  # the conversation separator (id 8710), appended to the human turn
IMAGE_START = "<racm3:break>"  # 8197
IMAGE_END = "<eoss>"  # 8196
END_OF_LINE = "<reserved08799>"  # 8803
SIZE_TOKEN = "<reserved{:05d}>"  # size token of n grids: <reserved{8800 + n}> (id 8804 + n)
SIZE_PATCH_CODES = 2  # upstream: a size-token grid is 32 px = 2 VQ codes (h_latent = h_grids * 2)


def layout_rows(codebook: Tensor, count: int) -> Tensor:
    """(count, e) float32 latent rows for tokens without a code, farther from every code than any two codes are
    apart and as far from each other: (K, e) codebook -> rows no code ever has among its K - 1 nearest.

    With c the codebook's mean and r its largest distance from c, row j (1-based) is c + j (4r + 1) along the
    first axis: it lies at least 3r + 1 from every code (codes are at most 2r apart) and 4r + 1 from the other
    rows, and its squared distance to a code is at least 1 (above GSD's 0.5 threshold on any table).
    """
    codes = codebook.detach().float()
    centre = codes.mean(0)  # (e,)
    radius = (codes - centre).norm(dim=-1).max()
    steps = torch.arange(1, count + 1, device=codes.device, dtype=codes.dtype)[:, None] * (4 * radius + 1)  # (n, 1)
    axis = torch.zeros_like(centre)
    axis[0] = 1.0
    return centre + steps * axis  # (count, e)
