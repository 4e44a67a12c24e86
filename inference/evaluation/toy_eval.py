"""Sample the toy target at several CFG scales and score it: prompt fidelity, FID-style distance, entropy.

    python -m inference.toy_eval --cfg-scales 1,1.5,2,3                      # the shipped toy target
    python -m inference.toy_eval --folder work/toy1024 --num-prompts 64 --top-k 0

Held-out captions are sampled `--samples` times each with the target's AR sampling, so a caption's
fidelity is a fraction and the spread over captions gives a standard error; every scale after the
first is compared with the first on the same captions (a paired difference with its standard
error). The ground-truth scenes of the captions give the fidelity ceiling (after a VQ round trip)
and the reference of the FID-style distance. This is how the shipped target's CFG default was
chosen (models/toy/assets/MODEL_CARD.md); training the toy world is `python -m models.toy.train`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path

import torch

from inference.decoding.autoregressive import generate_ar
from inference.decoding.generate import image_grid
from models.toy import ASSETS, SceneReader, ToyTarget, frechet_distance, render_dataset


def evaluate(
    folder: Path,
    num_prompts: int,
    cfg_scales: list[float],
    seed: int,
    grid_out: Path,
    top_k: int | None = None,
    samples_per_caption: int = 8,
) -> None:
    """Sample held-out captions with the trained target at several CFG scales; print fidelity, FID, entropy.

    Each caption is sampled `samples_per_caption` times, so a caption's fidelity is a fraction and the
    spread over captions gives a standard error; every scale after the first is also compared with
    the first on the same captions (a paired difference with its standard error).
    """
    target = ToyTarget.from_assets(folder)
    reader = SceneReader.load(folder / "scene_reader.safetensors")
    captions, truth_pixels = render_dataset(num_prompts, seed=seed, split="heldout")
    truth = torch.from_numpy(truth_pixels)
    through_vq = target.vq.decode(target.vq.encode(truth))
    print(f"{num_prompts} held-out captions, ground truth fidelity {reader.fidelity(truth, captions):.3f}, "
          f"{reader.fidelity(through_vq, captions):.3f} after a VQ round trip (a ceiling for any target)")  # fmt: skip
    errors = reader.attribute_errors(through_vq, captions)
    print("VQ round trip: images with an error in: " + ", ".join(f"{k} {v:.3f}" for k, v in errors.items()))
    print(f"sampling defaults: {target.sampling}" + (f", top_k overridden to {top_k}" if top_k is not None else ""))
    print(f"{samples_per_caption} samples per caption; fidelity ± standard error over captions")
    print("cfg_scale  fidelity         vs_first         fid_vs_truth  entropy_nats  top1_prob  seconds")
    grid_out.mkdir(parents=True, exist_ok=True)
    repeated = captions * samples_per_caption  # sample s of caption c sits at s * num_prompts + c
    first: torch.Tensor | None = None
    for scale in cfg_scales:
        settings = dataclasses.replace(target.sampling, cfg_scale=scale)
        if top_k is not None:
            settings = dataclasses.replace(settings, top_k=top_k or None)  # 0 turns top-k off
        generation = generate_ar(target, repeated, settings, torch.Generator().manual_seed(seed), progress=True)
        images = target.decode_images(generation.tokens)
        hits = reader.matches(images, repeated)  # (num_prompts * samples_per_caption,) bool
        per_caption = hits.float().view(samples_per_caption, num_prompts).mean(0)  # (num_prompts,)
        first = per_caption if first is None else first
        difference = per_caption - first
        distance = frechet_distance(truth, images[:num_prompts], reader)
        print(f"{settings.cfg_scale:9.2f}  {per_caption.mean():.3f} ± {_standard_error(per_caption):.3f}  "
              f"{difference.mean():+.3f} ± {_standard_error(difference):.3f}  {distance:12.2f}  "
              f"{generation.mean_entropy:12.3f}  {generation.mean_top1:9.3f}  {generation.seconds:7.1f}")  # fmt: skip
        errors = reader.attribute_errors(images, repeated)
        print("           images with an error in: " + ", ".join(f"{k} {v:.3f}" for k, v in errors.items()))
        image_grid(images[:num_prompts].numpy(), columns=8).save(grid_out / f"heldout_cfg{scale:g}.png")
    print(f"grids (the first sample of each caption) in {grid_out}")


def _standard_error(values: torch.Tensor) -> float:
    """Standard error of the mean of a 1-D tensor."""
    return float(values.std(unbiased=True) / math.sqrt(values.numel())) if values.numel() > 1 else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=ASSETS, help="toy target, VQ and scene reader files")
    parser.add_argument("--num-prompts", type=int, default=64, help="held-out captions")
    parser.add_argument("--cfg-scales", default="1.0,1.5", help="comma-separated CFG scales")
    parser.add_argument("--samples", type=int, default=8, help="images sampled per caption")
    parser.add_argument("--top-k", type=int, help="override the target's top-k (0 = off)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path("runs/toy_eval"), help="where the image grids go")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    scales = [float(s) for s in args.cfg_scales.split(",")]
    evaluate(args.folder, args.num_prompts, scales, args.seed, args.out, args.top_k, args.samples)


if __name__ == "__main__":
    main()
