"""Disk per sample and per dataset, for every target, feature mode and dtype, from the shapes alone.

    python -m data.disk                     # the table: toy, LlamaGen-XL, Janus-Pro-7B, Lumina-mGPT-7B
    python -m data.disk --samples 100000    # per 100k samples instead of 30k

A sample is one WebDataset key in a tar (data/shards.py): every member is a 512-byte tar header plus
its bytes rounded up to 512-byte blocks; an `.npy` member is a 128-byte header plus the raw array.
So the size is exact given the members' shapes, up to the json member (index, prompt, seed: one or
two blocks) and the end of each shard (two zero blocks, padding to a 10 KB record). With `features:
tokens` a sample holds the json and the (G,) token ids; with `full` also the (G, width) streams in
the feature dtype, and for float8_e4m3fn each stream's (G,) float32 row scales as a member of its own.
`tests/test_training_online.py` checks the formula against tiny-config extractions of every target family.

The real targets' shapes (targets.md): Janus-Pro-7B 576 tokens, H 4096, 30 layers; LlamaGen-XL t2i
stage I 256 tokens, H 1280; Lumina-mGPT-7B-768 48 x 49 = 2352 tokens (with the end-of-line column),
H 4096. The toy's come from its committed weights.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

BLOCK = 512
NPY_HEADER = 128  # numpy's v1.0 header for the shapes written here (padded to a multiple of 64)
JSON_BYTES = 300  # index, prompt_id, prompt, seed, batch_row, length: one block for captions up to ~200 chars
FEATURE_BYTES = {"float32": 4, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class SampleShape:
    """What fixes a sample's size: image tokens G, hidden size D, EAGLE-3 streams, vocabulary V."""

    name: str
    num_tokens: int
    hidden_size: int
    num_aux: int = 3
    image_vocab_size: int = 16384

    @property
    def token_bytes(self) -> int:
        return 2 if self.image_vocab_size <= 2**15 else 4  # extraction's int16 / int32 choice


REAL_TARGETS = (
    SampleShape("llamagen-xl", num_tokens=256, hidden_size=1280, image_vocab_size=16384),
    SampleShape("janus-pro-7b", num_tokens=576, hidden_size=4096, image_vocab_size=16384),
    SampleShape("lumina-mgpt-7b", num_tokens=2352, hidden_size=4096, image_vocab_size=8194),
)


def member_bytes(size: int) -> int:
    """A tar member of `size` bytes: its header and its data blocks."""
    return BLOCK + BLOCK * math.ceil(size / BLOCK)


def sample_bytes(
    shape: SampleShape,
    features: str = "full",
    feature_dtype: str = "float16",
    store_aux: bool = True,
    store_uncond: bool = True,
    json_bytes: int = JSON_BYTES,
) -> int:
    """Bytes one sample adds to a shard (data/extract.py's members for these settings)."""
    tokens = shape.num_tokens
    total = member_bytes(json_bytes) + member_bytes(NPY_HEADER + tokens * shape.token_bytes)
    if features == "tokens":
        return total
    widths = [shape.hidden_size] + ([shape.num_aux * shape.hidden_size] if store_aux else [])
    streams = widths + (widths if store_uncond else [])
    for width in streams:
        total += member_bytes(NPY_HEADER + tokens * width * FEATURE_BYTES[feature_dtype])
        if feature_dtype == "float8_e4m3fn":
            total += member_bytes(NPY_HEADER + tokens * 4)  # the (G,) float32 row scales
    return total


def format_bytes(count: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def disk_table(shapes: list[SampleShape], num_samples: int) -> str:
    """A Markdown table: per sample and per `num_samples` samples, token-only and full in each dtype."""
    modes = [("tokens", "float16")] + [("full", dtype) for dtype in ("float16", "float8_e4m3fn")]
    header = ["target", "G x D"]
    for features, dtype in modes:
        label = "tokens only" if features == "tokens" else f"full, {dtype.replace('_e4m3fn', ' e4m3')}"
        header += [f"{label}: per sample", f"per {num_samples:,}"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape in shapes:
        cells = [shape.name, f"{shape.num_tokens} x {shape.hidden_size}"]
        for features, dtype in modes:
            size = sample_bytes(shape, features, dtype)
            cells += [format_bytes(size), format_bytes(size * num_samples)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def toy_shape() -> SampleShape:
    """The embedded toy target's shape, read from its committed weights."""
    from models.registry import load_target

    target = load_target("toy")
    return SampleShape("toy", target.geometry.num_tokens, target.hidden_size, len(target.aux_layer_ids),
                       target.image_vocab_size)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30000, help="dataset size for the per-dataset columns")
    args = parser.parse_args(argv)
    print("Disk per sample (EAGLE-3 streams and unconditional rows stored; store_aux/store_uncond: true):")
    print(disk_table([toy_shape(), *REAL_TARGETS], args.samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
