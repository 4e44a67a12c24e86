"""Generate images with a target: plain autoregressive sampling with classifier-free guidance.

    python -m inference.generate --target toy \
        --prompt "a small red circle at the top left on a striped blue background" --num-images 8 --out samples/

writes one PNG per image, `grid.png` with all of them, and `generation.json` with the settings,
prompts and per-image statistics. Sampling follows the target's official order (CFG, temperature,
top-k, top-p); every setting defaults to the target's own and can be overridden on the command line.

Shapes: B images, R rows (2B with CFG), G image tokens, V image vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from tqdm import tqdm

from inference.sampling import draw_tokens, guided_logits, sampling_probabilities
from models.registry import load_target
from models.target import ImageTarget, SamplingDefaults


@dataclass
class Generation:
    """Tokens of B generated images and what producing them cost."""

    tokens: Tensor  # (B, G) int64
    target_forwards: int  # target calls, prefill included
    seconds: float
    mean_entropy: float  # nats, of the distribution each token was drawn from
    mean_top1: float  # probability of that distribution's most likely token


@torch.no_grad()
def generate_ar(
    target: ImageTarget,
    prompts: list[str],
    settings: SamplingDefaults | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> Generation:
    """Sample one image per prompt, token by token, with a KV cache.

    Args:
        target: the model.
        prompts: B prompts.
        settings: sampling settings; None means the target's defaults. CFG rows are added when
            `cfg_scale != 1`.
        generator: source of randomness (seeded by the caller).
        progress: show a progress bar over image tokens.
    """
    settings = settings or target.sampling
    cfg = settings.cfg_scale != 1.0
    started = time.perf_counter()
    num_tokens = target.geometry.num_tokens
    conditioning = target.condition(prompts, cfg=cfg)
    cache = target.allocate_cache(conditioning.rows, target.prefix_length + num_tokens)
    logits = target.prefill(conditioning, cache).logits[:, -1]  # (R, V): predicts image token 0
    tokens = torch.empty(len(prompts), num_tokens, dtype=torch.long, device=logits.device)
    entropy = torch.zeros((), device=logits.device)
    top1 = torch.zeros((), device=logits.device)
    for index in tqdm(range(num_tokens), desc="image tokens", disable=not progress, leave=False):
        guided = guided_logits(logits, settings, cfg)  # (B, V)
        probabilities = sampling_probabilities(guided, settings)
        entropy += -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1).mean()
        top1 += probabilities.max(-1).values.mean()
        tokens[:, index] = draw_tokens(probabilities, settings, generator)
        if index + 1 == num_tokens:
            break
        rows = tokens[:, index : index + 1].repeat(2 if cfg else 1, 1)  # (R, 1): the same token in both halves
        position = target.image_positions(torch.tensor([index], device=rows.device))
        logits = target.forward(rows, position, cache).logits[:, -1]
    return Generation(
        tokens=tokens,
        target_forwards=num_tokens,  # the prefill plus G - 1 single-token forwards
        seconds=time.perf_counter() - started,
        mean_entropy=float(entropy) / num_tokens,
        mean_top1=float(top1) / num_tokens,
    )


def image_grid(images: np.ndarray, columns: int | None = None, scale: int = 4) -> Image.Image:
    """Tile (B, H, W, 3) uint8 images into one picture, each enlarged `scale` times (nearest)."""
    count, height, width, _ = images.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    canvas = np.full((rows * (height + 1) + 1, columns * (width + 1) + 1, 3), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        canvas[
            1 + r * (height + 1) : 1 + r * (height + 1) + height, 1 + c * (width + 1) : 1 + c * (width + 1) + width
        ] = image
    picture = Image.fromarray(canvas)
    return picture.resize((picture.width * scale, picture.height * scale), Image.Resampling.NEAREST)


def read_prompt_lines(path: Path) -> list[str]:
    """One prompt per non-empty line of a text file."""
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one per line expected)")
    return prompts


def _save_png(image: np.ndarray | Image.Image, path: Path) -> None:
    """Write a PNG atomically (temporary name, then rename)."""
    picture = image if isinstance(image, Image.Image) else Image.fromarray(image)
    tmp = path.with_name(path.name + ".tmp")
    picture.save(tmp, format="PNG")
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="toy", help="target name (default: toy)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt, repeated --num-images times")
    source.add_argument("--prompts", type=Path, help="text file, one prompt per line")
    parser.add_argument("--num-images", type=int, default=8, help="images per --prompt (default 8)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--cfg-scale", type=float, help="guidance scale (default: the target's)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default: the target's)")
    parser.add_argument("--top-k", type=int, help="default: the target's")
    parser.add_argument("--top-p", type=float, help="default: the target's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.num_images < 1:
        raise SystemExit(f"--num-images must be at least 1, got {args.num_images}")
    target = load_target(args.target)
    overrides = {name: getattr(args, name) for name in ("cfg_scale", "temperature", "top_k", "top_p")}
    settings = dataclasses.replace(target.sampling, **{k: v for k, v in overrides.items() if v is not None})
    prompts = [args.prompt] * args.num_images if args.prompt else read_prompt_lines(args.prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    images, records = [], []
    for start in tqdm(range(0, len(prompts), args.batch_size), desc="batches", disable=len(prompts) <= args.batch_size):
        batch = prompts[start : start + args.batch_size]
        result = generate_ar(target, batch, settings, generator, progress=True)
        pixels = target.decode_images(result.tokens).cpu().numpy()
        for offset, (prompt, image) in enumerate(zip(batch, pixels, strict=True)):
            index = start + offset
            _save_png(image, args.out / f"{index:05d}.png")
            records.append(
                {
                    "index": index,
                    "prompt": prompt,
                    "file": f"{index:05d}.png",
                    "target_forwards": result.target_forwards,
                    "seconds": result.seconds / len(batch),
                }
            )
        images.append(pixels)
        print(
            f"batch of {len(batch)}: {result.seconds:.2f} s, mean entropy {result.mean_entropy:.3f} nats, "
            f"mean top-1 probability {result.mean_top1:.3f}"
        )
    _save_png(image_grid(np.concatenate(images)), args.out / "grid.png")
    summary = {
        "target": args.target,
        "rule": "ar",
        "sampling": dataclasses.asdict(settings),
        "seed": args.seed,
        "note": "plain autoregressive sampling: one target forward per image token",
        "images": records,
    }
    tmp = args.out / "generation.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, args.out / "generation.json")
    print(f"wrote {len(records)} images and grid.png to {args.out}")


if __name__ == "__main__":
    main()
