"""Train the embedded toy world's models: the patch VQ, the text-to-image target and the scene reader.

The shipped files in `models/toy/assets/` were made in two rounds (`models/toy/assets/MODEL_CARD.md`): a
1024-code world first, then the 4096-code world warm-started from it, because a 4096-code target
trained from scratch learns positions and backgrounds but, in 5000 steps, not which colour and shape
the caption asks for (held-out prompt fidelity 0.035):

    python -m models.toy.train --stage vq --num-codes 1024 --out work/toy1024           # 1.5 min
    python -m models.toy.train --stage target --steps 5000 --out work/toy1024           # 37 min
    python -m models.toy.train --stage vq --out models/toy/assets                           # 4096 codes, 5 min
    python -m models.toy.train --stage target --init-from work/toy1024 --steps 2000 --lr 1e-3 --out models/toy/assets
    python -m models.toy.train --stage reader --out models/toy/assets                       # 4 min
    python -m inference.toy_eval --folder models/toy/assets --cfg-scales 1,1.5,2,3       # sample and score

Stages (each writes one safetensors file into --out):

- `vq`: k-means patch codebook (--num-codes, 4096) fitted on 8000 training scenes -> `toy_vq.safetensors`;
- `target`: the caption encoder + LlamaGen GPT, trained on freshly drawn training scenes with
  caption dropout (the learned unconditional caption replaces 10 % of captions, for CFG) ->
  `toy_target.safetensors`; resumable from `toy_target.partial.pt` after an interruption;
  `--init-from FOLDER` starts from a target trained on another codebook (`warm_start`);
- `reader`: the CNN that reads scene attributes from pixels (prompt fidelity) and gives the
  FID-style features, trained on scenes both clean and passed through the VQ -> `scene_reader.safetensors`.

Sampling the trained target (prompt fidelity, FID-style distance, entropy at several CFG scales)
goes through the decoder's AR generation, so it is `python -m inference.toy_eval` (models import no
other project package).

Scenes are drawn from seeds derived from (seed, step), so a run is reproducible and a resumed run
sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.toy.model import TOY_GPT_CONFIG, CaptionEncoderConfig, ToyTextToImage
from models.toy.scenes import render_dataset
from models.toy.target import ASSETS
from models.toy.vq import PatchVQ, nearest_code, reconstruction_error

if TYPE_CHECKING:
    from models.toy.metrics import SceneReader


def train_vq(out: Path, seed: int, num_codes: int, num_images: int = 8000) -> PatchVQ:
    """Fit the patch codebook on training scenes and save it."""
    _, images = render_dataset(num_images, seed=seed, split="train")
    vq = PatchVQ(num_codes=num_codes, image_size=images.shape[1])
    errors = vq.fit(torch.from_numpy(images), iterations=20, seed=seed)
    _, held_out = render_dataset(256, seed=seed + 1, split="heldout")
    print(f"vq: {num_codes} codes, patch MSE {errors[-1]:.5f}, held-out mean abs pixel error "
          f"{reconstruction_error(vq, held_out):.2f}/255")  # fmt: skip
    vq.save(out / "toy_vq.safetensors")
    return vq


def _batch(vq: PatchVQ, size: int, seed: int, split: str = "train") -> tuple[list[str], torch.Tensor]:
    captions, images = render_dataset(size, seed=seed, split=split)
    return captions, vq.encode(torch.from_numpy(images))


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps to `peak`, then a cosine down to 0.1 x peak at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def target_loss(model: ToyTextToImage, captions: list[str], tokens: torch.Tensor, dropout: float,
                generator: torch.Generator, weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Cross-entropy of the image tokens, with caption dropout to the learned unconditional caption.

    `weights` (B, G), when given, weighs each token's cross-entropy: the loss is sum(w * ce) / sum(w), so
    uniform weights give the plain mean.
    """
    features, valid = model.caption_features(captions)
    drop = torch.rand(len(captions), generator=generator) < dropout  # (B,)
    uncond = model.gpt.unconditional_captions(len(captions))
    features = torch.where(drop[:, None, None], uncond, features)
    logits = model(features, valid, tokens)  # (B, G, V)
    if weights is None:
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    per_token = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none")  # (B * G,)
    weights = weights.flatten().to(per_token.dtype)
    return (weights * per_token).sum() / weights.sum()


def warm_start(model: ToyTextToImage, vq: PatchVQ, source: Path) -> None:
    """Copy a target trained on another codebook into `model` (in place).

    `source` holds `toy_target.safetensors` and its `toy_vq.safetensors`. Every weight of the same shape
    is copied; the rows indexed by code (token embedding, output head) are copied from the source code
    nearest in pixel space to each new code, so the caption encoder and the transformer keep what they
    learned and only the finer split of the codes is left to train.
    """
    from models.toy.target import ToyTarget

    old = ToyTarget.from_assets(source)  # names a missing file; checks that its VQ matches its GPT
    copy_by_nearest_code(model, vq, old.network, old.vq, source)


def copy_by_nearest_code(model: ToyTextToImage, vq: PatchVQ, old_model: ToyTextToImage, old_vq: PatchVQ,
                         source: Path) -> None:  # fmt: skip
    """Copy `old_model` (trained on `old_vq`) into `model` (for `vq`) in place: weights of the same shape as
    they are, rows indexed by code from the old code nearest in pixel space to each new code. `source`
    names the old weights in errors."""
    nearest = nearest_code(vq.codebook, old_vq.codebook)  # (K_new,) ids of the old codebook
    state = model.state_dict()
    for name, value in old_model.state_dict().items():
        if name not in state:
            raise ValueError(f"--init-from {source}: weight {name!r} is not in the target; not a target of this world")
        if value.shape == state[name].shape:
            state[name] = value
        elif value.shape[0] == old_vq.num_codes and value.shape[1:] == state[name].shape[1:]:
            state[name] = value[nearest]
        else:
            raise ValueError(f"--init-from {source}: weight {name!r} has shape {tuple(value.shape)}, "
                             f"the new target needs {tuple(state[name].shape)}")  # fmt: skip
    model.load_state_dict(state)
    print(f"target: warm start from {source} ({old_vq.num_codes} -> {vq.num_codes} codes, rows by nearest code)")


def train_target(
    out: Path, vq: PatchVQ, steps: int, batch_size: int, lr: float, seed: int, init_from: Path | None = None
) -> None:
    """Train the toy target; resumes from `toy_target.partial.pt` when it exists."""
    torch.manual_seed(seed)
    model = ToyTextToImage(CaptionEncoderConfig(), dataclasses.replace(TOY_GPT_CONFIG, vocab_size=vq.num_codes))
    if init_from is not None:
        warm_start(model, vq, init_from)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    partial = out / "toy_target.partial.pt"
    start, elapsed, history = 0, 0.0, []
    if partial.exists():
        state = torch.load(partial, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        start, elapsed, history = state["step"], state["elapsed"], state["history"]
        print(f"target: resuming from step {start} ({partial})")
    num_params = sum(p.numel() for p in model.parameters())
    print(f"target: {num_params / 1e6:.2f} M parameters, {steps} steps of {batch_size} scenes")
    eval_captions, eval_tokens = _batch(vq, 256, seed=seed + 7, split="heldout")
    progress = tqdm(range(start, steps), initial=start, total=steps, desc="toy target")
    began = time.perf_counter() - elapsed
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup=100)
        captions, tokens = _batch(vq, batch_size, seed=seed * 1_000_003 + step)
        loss = target_loss(model, captions, tokens, dropout=0.1, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 250 == 0 or step + 1 == steps:
            with torch.no_grad():
                model.eval()
                held_out = target_loss(model, eval_captions, eval_tokens, 0.0, generator).item()
                model.train()
            history.append((step + 1, loss.item(), held_out))
            tqdm.write(f"step {step + 1}: train loss {loss.item():.4f}, held-out loss {held_out:.4f}")
            atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "generator": generator.get_state(), "step": step + 1,
                          "elapsed": time.perf_counter() - began, "history": history}, partial)  # fmt: skip
    train_seconds = time.perf_counter() - began
    final = history[-1] if history else (steps, float("nan"), float("nan"))
    model.save(out / "toy_target.safetensors", extra_metadata={
        "steps": str(steps), "batch_size": str(batch_size), "train_seconds": f"{train_seconds:.0f}",
        "final_train_loss": f"{final[1]:.4f}", "final_heldout_loss": f"{final[2]:.4f}",
        "init_from": str(init_from or ""),
    })  # fmt: skip
    print(f"target: {steps} steps in {train_seconds / 60:.1f} min, held-out loss {final[2]:.4f}")
    partial.unlink(missing_ok=True)


def fit_scene_reader(
    reader: SceneReader,
    render: Callable[[int, int, str], tuple[list[str], np.ndarray]],
    vq: PatchVQ,
    steps: int,
    seed: int,
    batch_size: int = 128,
    description: str = "scene reader",
) -> tuple[float, float]:
    """Train `reader` on freshly drawn scenes of both splits, half of every batch through the VQ.

    `render(count, seed, split)` draws captions and (count, S, S, 3) uint8 pixels. Returns the reader's
    prompt fidelity on 1000 held-out ground-truth scenes, clean and through the VQ (its ceiling).
    """
    reader.train()
    optimizer = torch.optim.AdamW(reader.parameters(), lr=2e-3, weight_decay=1e-4)
    progress = tqdm(range(steps), desc=description)
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, 2e-3, warmup=50)
        captions, images = render(batch_size, seed * 7_000_003 + step, "any")
        pixels = torch.from_numpy(images)
        half = batch_size // 2  # half of every batch goes through the VQ, as generated images do
        pixels[:half] = vq.decode(vq.encode(pixels[:half]))
        loss = reader.loss(pixels, reader.labels(captions))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")
    reader.eval()
    return reader_ceiling(reader, render, vq, seed + 99)


def reader_ceiling(reader: SceneReader, render: Callable[[int, int, str], tuple[list[str], np.ndarray]],
                   vq: PatchVQ, seed: int, count: int = 1000) -> tuple[float, float]:  # fmt: skip
    """Prompt fidelity of `reader` on `count` held-out ground-truth scenes drawn with `seed`, clean and through
    the VQ: what a perfect target would score (the second is the ceiling of generated images)."""
    captions, images = render(count, seed, "heldout")
    pixels = torch.from_numpy(images)
    with torch.no_grad():
        return reader.fidelity(pixels, captions), reader.fidelity(vq.decode(vq.encode(pixels)), captions)


def train_reader(out: Path, vq: PatchVQ, steps: int, seed: int, batch_size: int = 128, resume: bool = False) -> None:
    """Train the scene reader on clean and VQ-round-tripped scenes, then report its accuracy.

    With `resume`, training continues from the reader already in `out` (a fresh schedule, new scenes).
    """
    from models.toy.metrics import SceneReader

    torch.manual_seed(seed)
    reader = SceneReader.load(out / "scene_reader.safetensors").train() if resume else SceneReader()
    if resume:
        seed += 1  # draw scenes the first run did not see
    clean, through_vq = fit_scene_reader(
        reader, lambda count, draw_seed, split: render_dataset(count, seed=draw_seed, split=split),
        vq, steps, seed, batch_size,
    )  # fmt: skip
    print(f"reader: fidelity on 1000 held-out ground-truth scenes {clean:.4f} clean, {through_vq:.4f} through the VQ")
    reader.save(out / "scene_reader.safetensors")


def atomic_save(obj: object, path: Path) -> None:
    """`torch.save` to a temporary file, then rename it over `path`, so a killed run never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["vq", "target", "reader", "all"], default="all")
    parser.add_argument("--out", type=Path, default=ASSETS, help="folder for the safetensors files")
    parser.add_argument("--num-codes", type=int, default=4096, help="--stage vq: codebook size")
    parser.add_argument("--steps", type=int, default=5000, help="target training steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--init-from", type=Path, help="start the target from one trained on another codebook (folder)")
    parser.add_argument("--reader-steps", type=int, default=1500)
    parser.add_argument("--reader-resume", action="store_true", help="continue training the reader in --out")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    np.seterr(all="raise")
    args.out.mkdir(parents=True, exist_ok=True)
    vq_path = args.out / "toy_vq.safetensors"
    training_vq = args.stage in ("vq", "all")
    vq = train_vq(args.out, args.seed, args.num_codes) if training_vq else PatchVQ.load(vq_path)
    if args.stage in ("target", "all"):
        train_target(args.out, vq, args.steps, args.batch_size, args.lr, args.seed, args.init_from)
    if args.stage in ("reader", "all"):
        train_reader(args.out, vq, args.reader_steps, args.seed, resume=args.reader_resume)


if __name__ == "__main__":
    main()
