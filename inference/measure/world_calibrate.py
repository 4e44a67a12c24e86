"""How uncertain an embedded world's target is at its default sampling: the statistics the texture world is fixed by.

    python -m inference.world_calibrate --folder RUN                      # a trained texture target
    python -m inference.world_calibrate --checkpoint RUN/texture_target.partial.pt --folder RUN
    python -m inference.world_calibrate --world toy                        # the toy, for comparison
    python -m inference.world_calibrate --drafter runs/demo_texture/version_0/drafter --out outputs/calib

Held-out captions are sampled once each with plain AR decoding (`generate_ar`) at the target's
default sampling (CFG, temperature, top-k; override with --cfg-scale / --top-k). The distribution
each token was drawn from is then recomputed for every position at once (a teacher-forced pass over
the sampled tokens through the same logits chain, `processed_distribution`) and summarised over all
tokens: mean entropy (nats), the share of tokens above --high-entropy nats, the share whose top-1
probability is below --low-top1, and entropy quantiles. Real targets sit at a mean of 4.4-6.9 nats
(LlamaGen on COCO) with most of Lumina-mGPT's tokens at top-1 < 0.05; the texture world's bar is a
mean >= 4 nats, >= 20 % of tokens above 5 nats and >= 50 % with top-1 < 0.05 (its MODEL_CARD.md).
The same samples are read back by the world's scene reader: prompt fidelity (every object and the
background as the caption says) and which attributes fail.

With --drafter, how hard the world is to draft for (`inference.measure.draft_calibrate`): static
trees of --drafts nodes fitted with the lossless `exact` rule on --tune-prompts captions (seed
--tune-seed, 11), then the lossless tau of each and of the dynamic top-k tree (--dynamic: children,
depth, nodes) on --report-prompts other captions (seed --report-seed, 2026), with the acceptance at
each depth given the depth above. --out writes calibration.json and each fitted tree as
static<N>.json (decode it with --static-tree FILE).

Shapes: B prompts, R rows (2B with CFG), G image tokens, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inference.decoding.autoregressive import generate_ar
from inference.decoding.files import write_json
from inference.decoding.generate import image_grid
from inference.decoding.sampling import processed_distribution
from inference.measure.draft_calibrate import drafting_report, report_table
from inference.measure.provenance import provenance
from models.target import ImageTarget, SamplingDefaults
from models.texture import ASSETS as TEXTURE_ASSETS
from models.texture import TextureSceneReader, TextureTarget, network_from_checkpoint
from models.texture.reader import READER_FILE
from models.toy import PatchVQ, ToyTarget
from models.worlds import EMBEDDED_WORLDS


@torch.no_grad()
def drawn_distributions(target: ImageTarget, prompts: list[str], tokens: Tensor, settings: SamplingDefaults) -> Tensor:
    """The processed distribution every token of `tokens` (B, G) was drawn from, (B, G, V), in one pass."""
    cfg = settings.cfg_scale != 1.0
    num_tokens = tokens.shape[1]
    conditioning = target.condition(prompts, cfg=cfg)
    cache = target.allocate_cache(conditioning.rows, target.prefix_length + num_tokens)
    first = target.prefill(conditioning, cache).logits[:, -1:]  # (R, 1, V): predicts token 0
    rows = tokens[:, :-1].repeat(2 if cfg else 1, 1)  # (R, G - 1)
    rest = target.forward(rows, target.image_positions(torch.arange(num_tokens - 1)), cache).logits  # (R, G-1, V)
    logits = torch.cat([first, rest], dim=1)  # (R, G, V)
    index = torch.arange(num_tokens).expand(len(prompts), num_tokens)  # (B, G)
    _, probabilities = processed_distribution(logits, settings, cfg, target, index, one_hot_greedy=True)
    return probabilities


def token_statistics(target: ImageTarget, prompts: list[str], settings: SamplingDefaults, seed: int,
                     batch_size: int) -> tuple[dict[str, float], Tensor]:  # fmt: skip
    """Sample one image per prompt; per-token entropy and top-1 summarised, and the (B, G) tokens."""
    generator = torch.Generator().manual_seed(seed)
    entropies, top1s, all_tokens = [], [], []
    seconds, ar_entropy = 0.0, 0.0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        generation = generate_ar(target, batch, settings, generator)
        seconds += generation.seconds
        ar_entropy += generation.mean_entropy * len(batch)
        probabilities = drawn_distributions(target, batch, generation.tokens, settings)  # (b, G, V)
        entropies.append(-(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1).flatten())
        top1s.append(probabilities.max(-1).values.flatten())
        all_tokens.append(generation.tokens)
    entropy, top1 = torch.cat(entropies), torch.cat(top1s)
    quantiles = torch.quantile(entropy, torch.tensor([0.1, 0.5, 0.9]))
    stats = {
        "mean_entropy": float(entropy.mean()),
        "ar_mean_entropy": ar_entropy / len(prompts),
        "share_entropy_above_5": float((entropy > 5.0).float().mean()),
        "share_entropy_below_2": float((entropy < 2.0).float().mean()),
        "share_top1_below_0.05": float((top1 < 0.05).float().mean()),
        "mean_top1": float(top1.mean()),
        "entropy_p10": float(quantiles[0]),
        "entropy_p50": float(quantiles[1]),
        "entropy_p90": float(quantiles[2]),
        "seconds_per_image": seconds / len(prompts),
    }
    return stats, torch.cat(all_tokens)


def _load(world: str, folder: Path | None, checkpoint: Path | None) -> ImageTarget:
    """The target to measure: a world's shipped (or --folder) assets, or a texture training checkpoint."""
    if world == "toy":
        if checkpoint is not None:
            raise SystemExit("--checkpoint reads a texture-world training checkpoint; drop it with --world toy")
        return ToyTarget.from_assets(folder) if folder else ToyTarget.from_assets()
    folder = folder or TEXTURE_ASSETS
    if checkpoint is None:
        return TextureTarget.from_assets(folder)
    vq_file = folder / "texture_vq.safetensors"
    if not vq_file.exists():
        raise SystemExit(f"{vq_file} is missing: --folder must hold the VQ the checkpoint {checkpoint} was trained on")
    return TextureTarget(network_from_checkpoint(checkpoint), PatchVQ.load(vq_file))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", choices=sorted(EMBEDDED_WORLDS), default="texture")
    parser.add_argument("--folder", type=Path, help="assets folder (default: the world's shipped assets)")
    parser.add_argument("--checkpoint", type=Path, help="texture: a training checkpoint (.partial.pt) to measure")
    parser.add_argument("--num-prompts", type=int, default=64, help="held-out captions, one sample each")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cfg-scale", type=float, help="override the target's default CFG scale")
    parser.add_argument("--top-k", type=int, help="override the default top-k (0: off)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--grid-out", type=Path, help="save a grid of the samples here (.png)")
    parser.add_argument("--drafter", type=Path, help="also measure lossless tau of this drafter (config.json folder)")
    parser.add_argument("--drafts", default="25,40,60", help="--drafter: static tree sizes to fit (comma-separated)")
    parser.add_argument("--dynamic", default="10,6,60", help="--drafter: dynamic tree children,depth,nodes")
    parser.add_argument("--tune-prompts", type=int, default=64, help="--drafter: captions the trees are fitted on")
    parser.add_argument("--tune-seed", type=int, default=11)
    parser.add_argument("--report-prompts", type=int, default=64, help="--drafter: captions tau is measured on")
    parser.add_argument("--report-seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, help="folder for calibration.json and the fitted trees")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = _load(args.world, args.folder, args.checkpoint)
    settings = target.sampling
    if args.cfg_scale is not None:
        settings = dataclasses.replace(settings, cfg_scale=args.cfg_scale)
    if args.top_k is not None:
        settings = dataclasses.replace(settings, top_k=args.top_k or None)
    prompts = EMBEDDED_WORLDS[args.world].captions(args.num_prompts, args.seed, "heldout")
    started = time.perf_counter()
    stats, tokens = token_statistics(target, prompts, settings, args.seed, args.batch_size)
    print(f"{args.world} target, {args.num_prompts} held-out captions (seed {args.seed}), {tokens.shape[1]} tokens "
          f"each, {target.image_vocab_size} codes; sampling {settings}")  # fmt: skip
    for name, value in stats.items():
        print(f"{name:24s} {value:.4f}")
    images = target.decode_images(tokens)  # (B, S, S, 3) uint8
    reader = _reader(args.world, args.folder)
    if reader is not None:
        stats["prompt_fidelity"] = reader.fidelity(images, prompts)
        errors = reader.attribute_errors(images, prompts)
        print(f"{'prompt_fidelity':24s} {stats['prompt_fidelity']:.4f}   (AR samples read back by the scene reader)")
        print("images with an error, by attribute: " + ", ".join(f"{k} {v:.3f}" for k, v in errors.items()))
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.grid_out is not None:
        args.grid_out.parent.mkdir(parents=True, exist_ok=True)
        image_grid(images.numpy(), columns=8).save(args.grid_out)
        print(f"samples in {args.grid_out}")
    record: dict[str, Any] = {
        "command": ["python", "-m", "inference.world_calibrate", *(sys.argv[1:] if argv is None else argv)],
        "provenance": provenance(), "world": args.world, "sampling": dataclasses.asdict(settings),
        "prompts": {"count": args.num_prompts, "seed": args.seed, "split": "heldout"}, "tokens": stats,
    }  # fmt: skip
    if args.drafter is not None:
        record["drafting"] = _drafting(args, target)
    if args.out is not None:
        write_json(record, args.out / "calibration.json")
        print(f"wrote {args.out / 'calibration.json'}")


def _reader(world: str, folder: Path | None) -> Any:
    """The scene reader beside a --folder target (its own world's file), else the world's shipped one; None if none."""
    if world == "texture" and folder is not None and (folder / READER_FILE).exists():
        return TextureSceneReader.load(folder / READER_FILE)
    try:
        return EMBEDDED_WORLDS[world].scene_reader()
    except FileNotFoundError as error:
        print(f"no prompt fidelity: {error}")
        return None


def _drafting(args: argparse.Namespace, target: ImageTarget) -> dict[str, Any]:
    """Fit static trees on the tune captions and measure lossless tau on the report captions; print and return it."""
    from inference.decoding.eagle import EagleDrafter
    from inference.decoding.rules import ExactRule

    try:
        drafts = [int(n) for n in args.drafts.split(",")]
        top_k, depth, nodes = (int(n) for n in args.dynamic.split(","))
    except ValueError:
        raise SystemExit(
            f"--drafts {args.drafts!r} / --dynamic {args.dynamic!r}: give integers, e.g. 25,40 and 10,6,60"
        ) from None
    drafter = EagleDrafter.from_pretrained(args.drafter, target)
    world = EMBEDDED_WORLDS[args.world]
    tune = world.captions(args.tune_prompts, args.tune_seed, "heldout")
    report = world.captions(args.report_prompts, args.report_seed, "heldout")
    results = drafting_report(target, drafter, ExactRule(), tune, report, drafts, dynamic=(top_k, depth, nodes))
    print(
        f"\nlossless (exact) tau of {args.drafter}: trees fitted on {len(tune)} captions (seed {args.tune_seed}), "
        f"tau measured on {len(report)} others (seed {args.report_seed}); accept @d = P(>= d drafts | >= d - 1)"
    )
    print(report_table(results))
    if args.out is not None:
        for result in results:
            if result.paths is not None:
                tree = {"paths": [list(p) for p in result.paths], "fitted_on": f"{args.world} heldout seed "
                        f"{args.tune_seed}, {len(tune)} captions, exact", "drafter": str(args.drafter)}  # fmt: skip
                write_json(tree, args.out / f"static{result.drafts}.json")
    return {"drafter": str(args.drafter), "tune": {"count": len(tune), "seed": args.tune_seed},
            "report": {"count": len(report), "seed": args.report_seed},
            "trees": [dataclasses.asdict(r) for r in results]}  # fmt: skip


if __name__ == "__main__":
    main()
