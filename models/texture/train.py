"""Train the texture world's models: the patch VQ, the text-to-image target and the scene reader.

    python -m models.texture.train --stage vq --background plain --num-codes 1024 --out PLAIN
    python -m models.texture.train --stage target --background plain --out PLAIN   # stage 1: plain scenes
    python -m models.texture.train --stage vq --out FINAL                          # 8192 codes, under 10 min
    python -m models.texture.train --stage target --out FINAL --init-from PLAIN    # stage 2: textures
    python -m models.texture.train --stage reader --out FINAL                      # needs the VQ

(the shipped weights' exact commands, times and rounds are in assets/MODEL_CARD.md)

Stages (each writes one safetensors file into --out):

- `vq`: k-means codebook of 4 x 4 RGB patches (--num-codes, 8192) fitted on --vq-images training
  scenes (1000, --vq-iterations 8 Lloyd iterations) -> `texture_vq.safetensors`;
- `target`: the caption encoder + LlamaGen GPT (`models.texture.model`) on freshly drawn training
  scenes (--steps 1600 of --batch-size 16, AdamW at peak --lr 2e-3), with caption dropout 0.1 to
  the learned unconditional caption (for CFG) -> `texture_target.safetensors`. The run checkpoints
  to `texture_target.partial.pt` in --checkpoint-dir (default --out) every --checkpoint-every steps
  and at --max-minutes, and the same command resumes it; the schedule (warm-up, cosine to 0.1x) is
  fixed by --steps, so a resumed run sees the same batches and learning rates as an uninterrupted
  one. The final file is written only when the run reaches --steps. `--init-from FILE --seed S`
  starts a second round (a new schedule, new batches) from finished weights; `--init-from FOLDER`
  (a `texture_target.safetensors` with its `texture_vq.safetensors`, e.g. of 1024 codes) starts from a
  target of another codebook, each code's rows copied from the old code nearest to it in pixel space,
  so a small-codebook round that learned the caption binding carries it over. `--object-weight W`
  weighs the cross-entropy of each token whose patch an object covers by a quarter or more W times
  (the held-out loss stays the plain mean), so the few object tokens are not drowned by the texture's;
- `reader`: the scene reader (`models.texture.reader`: prompt fidelity and FID-style features),
  --reader-steps (1200) of 64 freshly drawn scenes, half of each batch through the VQ ->
  `texture_reader.safetensors`;
- `reader-check`: the fidelity of --out's reader on 1000 held-out ground-truth scenes (--background),
  clean and through --out's VQ: the score of a perfect target.

Batches are drawn from seeds derived from (seed, step). Progress lines (step, train loss, held-out
loss on 128 held-out scenes, minutes) go to stdout, flushed, so `> log` shows them as they come.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from models.llamagen import LlamaGenConfig
from models.texture.model import TEXTURE_GPT_CONFIG, texture_network
from models.texture.reader import READER_FILE, TextureSceneReader
from models.texture.scenes import BACKGROUNDS, render_texture_dataset, render_texture_dataset_with_coverage
from models.texture.target import ASSETS, TARGET_FILE, VQ_FILE, TextureTarget
from models.toy import (
    PatchVQ,
    ToyTextToImage,
    atomic_save,
    copy_by_nearest_code,
    fit_scene_reader,
    learning_rate,
    reader_ceiling,
    reconstruction_error,
    target_loss,
)

PARTIAL_FILE = "texture_target.partial.pt"
CAPTION_DROPOUT = 0.1
OBJECT_PATCH_SHARE = 0.25  # an object token: its patch is at least a quarter covered by an object


def _say(text: str) -> None:
    print(text, flush=True)


def train_texture_vq(out: Path, seed: int, num_codes: int, num_images: int, iterations: int = 8,
                     background: str = "texture") -> PatchVQ:  # fmt: skip
    """Fit the patch codebook on `num_images` training scenes, report its round-trip error, save it."""
    _, images = render_texture_dataset(num_images, seed=seed, split="train", background=background)
    vq = PatchVQ(num_codes=num_codes, patch=4, image_size=images.shape[1])
    errors = vq.fit(torch.from_numpy(images), iterations=iterations, seed=seed)
    _, held_out = render_texture_dataset(256, seed=seed + 1, split="heldout", background=background)
    _say(f"vq: {num_codes} codes, patch MSE {errors[-1]:.5f}, held-out mean abs pixel error "
         f"{reconstruction_error(vq, held_out):.2f}/255")  # fmt: skip
    vq.save(out / VQ_FILE)
    return vq


def _tokens(vq: PatchVQ, count: int, seed: int, split: str = "train",
            background: str = "texture") -> tuple[list[str], torch.Tensor]:  # fmt: skip
    captions, images = render_texture_dataset(count, seed=seed, split=split, size=vq.image_size, background=background)
    return captions, vq.encode(torch.from_numpy(images))  # (count, G)


def object_token_weights(coverage: torch.Tensor, patch: int, object_weight: float) -> torch.Tensor:
    """Per-token loss weights: `object_weight` for a patch an object covers at least OBJECT_PATCH_SHARE of,
    1 elsewhere. coverage (B, H, W) in [0, 1] -> (B, G) with G = (H / patch) * (W / patch), raster order."""
    share = torch.nn.functional.avg_pool2d(coverage[:, None], patch).flatten(1)  # (B, G)
    return torch.where(share >= OBJECT_PATCH_SHARE, object_weight, 1.0)


def _training_batch(vq: PatchVQ, count: int, seed: int, object_weight: float,
                    background: str = "texture") -> tuple[list[str], torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Training scenes as tokens (count, G), with per-token loss weights (count, G) unless object_weight is 1
    (the renderer computes the coverage either way, so the batch is the same draw with or without weights)."""
    captions, images, coverage = render_texture_dataset_with_coverage(
        count, seed=seed, size=vq.image_size, background=background
    )
    tokens = vq.encode(torch.from_numpy(images))  # (count, G)
    if object_weight == 1.0:
        return captions, tokens, None
    return captions, tokens, object_token_weights(torch.from_numpy(coverage), vq.patch, object_weight)


@dataclasses.dataclass
class TargetRun:
    """Settings of one target training run (all of them fix the schedule and the batches)."""

    steps: int
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 100
    seed: int = 1234
    gpt_config: LlamaGenConfig = dataclasses.field(default_factory=lambda: TEXTURE_GPT_CONFIG)
    eval_every: int = 250
    checkpoint_every: int = 50
    object_weight: float = 1.0  # loss weight of the tokens an object covers (held-out loss stays unweighted)
    background: str = "texture"  # "plain": the same scenes over their flat tone (a first stage's data)


def train_texture_target(out: Path, vq: PatchVQ, run: TargetRun, checkpoint_dir: Path | None = None,
                         max_minutes: float | None = None,
                         init_from: Path | None = None) -> ToyTextToImage | None:  # fmt: skip
    """Train (or resume) the target; returns the network once it reaches `run.steps`, None when stopped early.

    `init_from` (a finished `texture_target.safetensors` of the same architecture) starts a fresh
    schedule from its weights instead of random ones: a second round after a first one ran its schedule out.
    """
    checkpoint_dir = checkpoint_dir or out
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    partial = checkpoint_dir / PARTIAL_FILE
    torch.manual_seed(run.seed)
    model = texture_network(vq.num_codes, run.gpt_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.05, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(run.seed)
    step, elapsed, history = 0, 0.0, []
    if init_from is not None and not partial.exists():
        if init_from.is_dir():  # a target of another codebook: rows by nearest code
            old = TextureTarget.from_assets(init_from)
            copy_by_nearest_code(model, vq, old.network, old.vq, init_from)
        else:
            model.load_state_dict(ToyTextToImage.load(init_from).state_dict(), strict=True)
            _say(f"target: starting from the weights of {init_from}")
    if partial.exists():
        state = torch.load(partial, weights_only=True)
        if state["run"] != repr(run):
            raise ValueError(f"{partial} was written by {state['run']}, not {run!r}; "
                             f"resume with the same settings or move the file away")  # fmt: skip
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        _say(f"target: resuming from step {step} ({partial})")
    num_params = sum(p.numel() for p in model.parameters()) / 1e6
    _say(f"target: {num_params:.2f} M parameters, {run.steps} steps of {run.batch_size} scenes, "
         f"{vq.num_codes} codes, {vq.grid[0] * vq.grid[1]} tokens")  # fmt: skip
    eval_captions, eval_tokens = _tokens(vq, 128, seed=run.seed + 7, split="heldout", background=run.background)
    began = time.perf_counter() - elapsed

    def checkpoint() -> None:
        atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "run": repr(run),
                     "gpt_config": json.dumps(dataclasses.asdict(model.gpt.config)),
                     "generator": generator.get_state(), "step": step,
                     "elapsed": time.perf_counter() - began, "history": history}, partial)  # fmt: skip

    session_start = time.perf_counter()
    model.train()
    while step < run.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, run.steps, run.lr, run.warmup)
        captions, tokens, weights = _training_batch(
            vq, run.batch_size, run.seed * 1_000_003 + step, run.object_weight, run.background
        )
        loss = target_loss(model, captions, tokens, CAPTION_DROPOUT, generator, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        minutes = (time.perf_counter() - began) / 60
        if step % run.eval_every == 0 or step == run.steps:
            with torch.no_grad():
                model.eval()
                held_out = target_loss(model, eval_captions, eval_tokens, 0.0, generator).item()
                model.train()
            history.append((step, loss.item(), held_out))
            _say(f"step {step}: train loss {loss.item():.4f}, held-out loss {held_out:.4f}, {minutes:.1f} min")
        elif step % 10 == 0:
            _say(f"step {step}: train loss {loss.item():.4f}, {minutes:.1f} min")
        out_of_time = max_minutes is not None and time.perf_counter() - session_start > 60 * max_minutes
        if (step % run.checkpoint_every == 0 or out_of_time) and step < run.steps:
            checkpoint()
        if out_of_time and step < run.steps:
            _say(f"target: stopped at step {step} after --max-minutes {max_minutes}; the same command resumes it")
            return None
    final = history[-1]
    model.eval()
    model.save(out / TARGET_FILE, extra_metadata={
        "steps": str(run.steps), "batch_size": str(run.batch_size), "lr": str(run.lr),
        "train_seconds": f"{time.perf_counter() - began:.0f}",
        "final_train_loss": f"{final[1]:.4f}", "final_heldout_loss": f"{final[2]:.4f}",
    })  # fmt: skip
    partial.unlink(missing_ok=True)
    _say(f"target: {run.steps} steps in {(time.perf_counter() - began) / 60:.1f} min, held-out loss {final[2]:.4f}")
    return model


def _reader_scenes(background: str = "texture") -> Callable[[int, int, str], tuple[list[str], np.ndarray]]:
    """The reader's scene source: `(count, seed, split)` -> captions and (count, S, S, 3) uint8 pixels."""
    return lambda count, draw_seed, split: render_texture_dataset(count, draw_seed, split, background=background)


def train_texture_reader(out: Path, vq: PatchVQ, steps: int, seed: int, batch_size: int = 64) -> TextureSceneReader:
    """Train the scene reader, print its fidelity on held-out ground truth (clean and through the VQ), save it."""
    torch.manual_seed(seed)
    reader = TextureSceneReader()
    began = time.perf_counter()
    clean, through_vq = fit_scene_reader(
        reader, _reader_scenes(), vq, steps, seed, batch_size, description="texture scene reader",
    )  # fmt: skip
    minutes = (time.perf_counter() - began) / 60
    _say(f"reader: {steps} steps of {batch_size} in {minutes:.1f} min; fidelity on 1000 held-out ground-truth "
         f"scenes {clean:.4f} clean, {through_vq:.4f} through the VQ")  # fmt: skip
    reader.save(out / READER_FILE)
    return reader


def check_texture_reader(folder: Path, vq: PatchVQ, seed: int, background: str = "texture",
                         count: int = 1000) -> tuple[float, float]:  # fmt: skip
    """Print the fidelity of `folder`'s reader on `count` held-out ground-truth scenes, clean and through `vq`."""
    if not (folder / READER_FILE).exists():
        sys.exit(f"{folder / READER_FILE} is missing; train it with --stage reader --out {folder}")
    reader = TextureSceneReader.load(folder / READER_FILE)
    clean, through_vq = reader_ceiling(reader, _reader_scenes(background), vq, seed + 99, count)
    _say(f"reader: fidelity on {count} held-out ground-truth scenes ({background} background) {clean:.4f} clean, "
         f"{through_vq:.4f} through the {vq.num_codes}-code VQ")  # fmt: skip
    return clean, through_vq


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["vq", "target", "reader", "reader-check", "all"], default="all")
    parser.add_argument("--out", type=Path, default=ASSETS, help="folder for the safetensors files")
    parser.add_argument("--num-codes", type=int, default=8192, help="--stage vq: codebook size")
    parser.add_argument("--vq-images", type=int, default=1000, help="--stage vq: training scenes for k-means")
    parser.add_argument("--vq-iterations", type=int, default=8, help="--stage vq: Lloyd iterations")
    parser.add_argument("--steps", type=int, default=1600, help="target training steps (fixes the schedule)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    parser.add_argument("--dim", type=int, default=TEXTURE_GPT_CONFIG.dim, help="GPT width (tests: a tiny one)")
    parser.add_argument("--layers", type=int, default=TEXTURE_GPT_CONFIG.num_layers, help="GPT layers")
    parser.add_argument(
        "--init-from",
        type=Path,
        help="finished weights (a file) or a target of another codebook "
        "(a folder with its VQ) to start a new round from",
    )
    parser.add_argument("--checkpoint-dir", type=Path, help="where the resumable checkpoint lives (default --out)")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--max-minutes", type=float, help="stop (checkpointed, resumable) after this long")
    parser.add_argument("--reader-steps", type=int, default=1200, help="--stage reader: training steps of 64 scenes")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--object-weight", type=float, default=1.0, help="--stage target: loss weight of object tokens (1: plain mean)"
    )
    parser.add_argument(
        "--background",
        choices=BACKGROUNDS,
        default="texture",
        help="--stage vq/target: 'plain' draws the same scenes over their flat tone (a first stage)",
    )
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage in ("vq", "all"):
        vq = train_texture_vq(args.out, args.seed, args.num_codes, args.vq_images, args.vq_iterations, args.background)
    else:
        if not (args.out / VQ_FILE).exists():
            sys.exit(f"{args.out / VQ_FILE} is missing; fit it first with --stage vq --out {args.out}")
        vq = PatchVQ.load(args.out / VQ_FILE)
    if args.stage in ("target", "all"):
        gpt = dataclasses.replace(
            TEXTURE_GPT_CONFIG, dim=args.dim, caption_dim=args.dim, num_layers=args.layers, aux_layer_ids=None
        )
        run = TargetRun(args.steps, args.batch_size, args.lr, args.warmup, seed=args.seed, gpt_config=gpt,
                        checkpoint_every=args.checkpoint_every, object_weight=args.object_weight,
                        background=args.background)  # fmt: skip
        train_texture_target(args.out, vq, run, args.checkpoint_dir, args.max_minutes, args.init_from)
    if args.stage in ("reader", "all"):
        train_texture_reader(args.out, vq, args.reader_steps, args.seed)
    if args.stage == "reader-check":
        check_texture_reader(args.out, vq, args.seed, args.background)


if __name__ == "__main__":
    main()
