"""Generate images with a target: plain autoregressive sampling, or tree speculative decoding with a drafter.

    python -m inference.generate --target toy \
        --prompt "a small red circle at the top left on a striped blue background" --num-images 8 --out samples/
    python -m inference.generate --target toy --drafter outputs/drafters/demo --rule cascade \
        --rule-arg delta=0.3 --rule-arg pool_beyond_tree=true --tree dynamic --tree-depth 8 --tree-total 60 \
        --prompts prompts.txt --out samples/

writes one PNG per image, `grid.png` with all of them, and `generation.json` with the settings,
prompts and per-image statistics. Sampling follows the target's official order (CFG, the target's
layout constraint `constrain_logits`, temperature, top-k, top-p); every setting defaults to the
target's own and can be overridden on the command line.

Without `--drafter` every image token costs one target forward (AR). With `--drafter` the tree
decoder (`inference.decoding.speculative`) drafts a tree per step and verifies it with `--rule` (exact,
lantern, lantern++, gsd, gsd-blocks, cascade, cascade-dev); every field of the rule's dataclass in
`inference.decoding.rules` can be set with `--rule-arg NAME=VALUE` (repeatable). Per image it reports tau =
accepted draft tokens + 1 per target verification forward (the +1 is the bonus/correction token every
forward also yields), target forwards (the prefill, which yields token 0, included), drafter forwards
and wall time.
Speculative decoding runs one image per batch by default, so these are that image's own numbers.

Shapes: B images, R rows (2B with CFG), G image tokens, V image vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import typing
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from tqdm import tqdm

from inference.decoding.autoregressive import generate_ar
from inference.decoding.calibrate import CALIBRATION_FILE, load_calibration
from inference.decoding.compiled import add_compile_argument, compile_decoding
from inference.decoding.files import write_atomic, write_json
from inference.decoding.peer_rules import LANTERN_K, LANTERN_PP_K, LANTERN_PP_LAM, lantern_static_zeroes
from inference.decoding.rules import RULES, GSDRule, LanternRule, Rule
from inference.decoding.speculative import TREE_KINDS, DecoderConfig, SpeculativeGeneration, generate_speculative
from inference.decoding.verify import build_latent_neighbours, verify
from models.registry import load_target_for_process
from models.target import ImageTarget

RULE_CLASSES: dict[str, type] = RULES
TAU_DEFINITION = (
    "tau = accepted draft tokens + 1 per target verification forward (the +1 is the bonus/correction token "
    "each forward also yields); target_forwards counts the prefill (which yields image token 0) too"
)
# fixed by the rule's name / built from the target's codebook and LM ids
_NOT_SETTABLE = {"name", "neighbours", "embeddings", "token_ids"}


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
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    write_atomic(path, buffer.getvalue())


def rule_options(name: str) -> dict[str, str]:
    """The settable fields of rule `name` and their types, e.g. {"delta": "float", ...}."""
    if name not in RULE_CLASSES:
        raise ValueError(f"unknown rule {name!r}; known rules: {', '.join(RULE_CLASSES)}")
    hints = typing.get_type_hints(RULE_CLASSES[name])
    return {
        f.name: _type_name(hints[f.name]) for f in dataclasses.fields(RULE_CLASSES[name]) if f.name not in _NOT_SETTABLE
    }


def _type_name(hint: object) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:  # X | None
        return f"{args[0].__name__} | None"  # type: ignore[attr-defined]
    return hint.__name__  # type: ignore[attr-defined]


def _convert(name: str, text: str, type_name: str) -> object:
    """A `--rule-arg` value as the field's type; "none" gives None for optional fields."""
    base, optional = type_name.removesuffix(" | None"), type_name.endswith(" | None")
    if optional and text.lower() == "none":
        return None
    try:
        if base == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        return {"float": float, "int": int, "str": str}[base](text)
    except (KeyError, ValueError):
        raise ValueError(f"rule argument {name}={text!r}: expected {type_name}") from None


def parse_rule_args(items: list[str] | None) -> dict[str, str]:
    """["delta=0.3", "tau_seq=0.5"] -> {"delta": "0.3", "tau_seq": "0.5"}."""
    options: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"rule argument {item!r} is not NAME=VALUE")
        options[key.strip()] = value.strip()
    return options


def default_lantern_k(vocab: int) -> int:
    """LANTERN's 1000 neighbours (`LANTERN_K`) of 16384 codes, scaled to the codebook (at least 1)."""
    return max(1, min(LANTERN_K, vocab // 16))


def build_rule(
    name: str,
    target: ImageTarget,
    options: Mapping[str, object] | None = None,
    drafter_dir: Path | None = None,
    latent_table: Tensor | None = None,
) -> Rule:
    """Verification rule `name` with its dataclass defaults, overridden by `options` (strings are parsed).

    CASCADE's tau_pos / tau_seq and their representation come from `drafter_dir/cascade_calibration.json` when
    that file exists (`inference.decoding.calibrate`; one written for another target is an error), unless
    `options` set them; asking for another representation than the file's needs both thresholds given.
    LANTERN rules get the neighbour table of the target's `latent_table()`, its image tokenizer's VQ codebook
    as LANTERN's authors use it: the toy's PatchVQ (V x P*P*3 RGB patches), LlamaGen's VQ-16 and Janus-Pro's
    generation VQ-16 (16384 x 8), Lumina-mGPT's Chameleon VQGAN (8192 x 256, plus two far rows for its
    end-of-line and end-of-image tokens). GSD gets the target's `lm_embedding_table()`, the LM's input
    embeddings of the image tokens as GSD's authors measure distance (as float32): the GPT's `tok_embeddings`
    (toy, LlamaGen), Chameleon's `embed_tokens` rows of the image tokens (Lumina-mGPT), the aligned generation
    embeddings `generation_aligner(generation_embeddings(v))` (Janus-Pro, whose image tokens have no LM
    embedding row); and the target's LM ids (`token_ids`, where it has them: Lumina-mGPT's Chameleon ids) for
    its id bound. Unless `options` set them: LANTERN's k is `default_lantern_k(V)`;
    LANTERN++ takes the CASCADE authors' baseline k = `LANTERN_PP_K` (10) and lam = `LANTERN_PP_LAM` (3.0);
    and `static_zeroes` follows the target's family as LANTERN's own file for it does
    (`lantern_static_zeroes`: "p" on Lumina-mGPT, "q" on LlamaGen).
    `latent_table` (V, e), when given, stands in for the target's own (LANTERN rules; the others ignore it),
    e.g. a random one for a latency run's random-weight target that exposes none.
    """
    known = rule_options(name)
    values: dict[str, object] = {}
    for key, value in (options or {}).items():
        if key not in known:
            raise ValueError(f"rule {name!r} has no field {key!r}; its fields: {', '.join(known) or 'none'}")
        values[key] = _convert(key, value, known[key]) if isinstance(value, str) else value
    if name == "cascade":  # the calibration's thresholds hold for the features they were measured on
        calibration = load_calibration(drafter_dir, target.name)
        measured_on = calibration.get("representation", "hidden")
        if calibration and values.get("representation", measured_on) != measured_on:
            if not {"tau_pos", "tau_seq"} <= values.keys():
                raise ValueError(
                    f"{drafter_dir}/{CALIBRATION_FILE} holds thresholds for representation {measured_on!r}, not "
                    f"{values['representation']!r}: give tau_pos and tau_seq, or recalibrate with python -m "
                    f"inference.calibrate --representation {values['representation']} --overwrite"
                )
            calibration = {}
        values = {**calibration, **values}
    if name == "gsd":  # LM ids where the target has them (Lumina-mGPT's Chameleon ids): GSD's id bound reads them
        embeddings = target.lm_embedding_table().float()  # float32 once here, not at every step's `prepare`
        token_ids = getattr(target, "token_ids", None)
        return GSDRule(embeddings=embeddings, token_ids=token_ids, **values)  # type: ignore[arg-type]
    if name not in ("lantern", "lantern++"):
        return RULE_CLASSES[name](**values)
    if name == "lantern" and values.get("lam") is not None:
        raise ValueError("lam sets LANTERN++'s multiplicative bound: use the rule lantern++")
    if name == "lantern++" and values.setdefault("lam", LANTERN_PP_LAM) is None:
        raise ValueError("lantern++ needs lam (its multiplicative bound); without it use the rule lantern")
    values.setdefault("static_zeroes", lantern_static_zeroes(target.family))
    codebook = _codebook(name, target, latent_table)
    if values.get("k") is None:  # unset, or "none": the mode's published default
        values["k"] = LANTERN_PP_K if name == "lantern++" else default_lantern_k(codebook.shape[0])
    k = int(values["k"])  # type: ignore[call-overload]
    if not 1 <= k <= codebook.shape[0] - 2:
        raise ValueError(f"lantern k must be in 1..{codebook.shape[0] - 2} for {codebook.shape[0]} codes, got {k}")
    return LanternRule(neighbours=build_latent_neighbours(codebook, k + 1), **values)  # type: ignore[arg-type]


def _codebook(name: str, target: ImageTarget, stand_in: Tensor | None = None) -> Tensor:
    """LANTERN's latent proximity table (V, e): `stand_in` if given, else the target's `latent_table()`.

    Raises:
        ValueError: the target has no latent table (its reason, and the fix, in the message).
    """
    table = stand_in
    if table is None:
        try:
            table = target.latent_table()
        except NotImplementedError as error:
            raise ValueError(f"rule {name!r} needs the target's latent table (its VQ codebook): {error}") from None
    if table.shape[0] != target.image_vocab_size:
        raise ValueError(
            f"rule {name!r}: a latent table of {table.shape[0]} rows for {target.name!r}'s "
            f"{target.image_vocab_size} image tokens"
        )
    return table


def rule_settings(rule: Rule) -> dict[str, object]:
    """The rule's name and fields, JSON-ready (the LANTERN neighbour table left out)."""
    fields = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule) if f.name not in _NOT_SETTABLE}
    return {"rule": rule.name, **fields}


def image_statistics(result: SpeculativeGeneration, column: int, batch: int) -> dict[str, float | int]:
    """Per-image numbers of one speculative batch: tau, target forwards while it decoded, drafter forwards, s."""
    steps, plus_one = result.tally(column)
    return {
        "tau": plus_one / steps,
        "verification_steps": steps,
        "target_forwards": 1 + steps,
        "drafter_forwards": result.drafter_forwards,  # of the whole batch (batch size 1: this image's)
        "seconds": result.seconds / batch,
        "tv_charged_per_step": result.tv_charged,
    }


def decoder_config(args: argparse.Namespace) -> DecoderConfig:
    """The draft tree from --tree, --static-tree, --tree-top-k, --tree-depth, --tree-total (unset: the defaults)."""
    given = {
        "tree": args.tree,
        "static_tree": args.static_tree,
        "top_k": args.tree_top_k,
        "depth": args.tree_depth,
        "total_tokens": args.tree_total,
    }
    kind = args.tree or DecoderConfig.tree
    dynamic_only = [f"--tree-{k.replace('_tokens', '').replace('_', '-')}" for k in ("top_k", "depth", "total_tokens")
                    if given[k] is not None]  # fmt: skip
    if kind == "static" and dynamic_only:
        raise ValueError(f"{', '.join(dynamic_only)} shape the dynamic trees; add --tree dynamic or dynamic-sampled")
    if kind != "static" and args.static_tree is not None:
        raise ValueError(f"--static-tree names a static list; it does nothing with --tree {kind}")
    return DecoderConfig(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]


def add_decoder_arguments(parser: argparse.ArgumentParser) -> None:
    """--drafter, --rule, --rule-arg and the tree options, shared with `inference.measure.bench`."""
    parser.add_argument("--drafter", type=Path, help="drafter folder (config.json + model.safetensors)")
    parser.add_argument(
        "--tree", choices=TREE_KINDS, help="draft tree kind (default static: the target's tree, sampled drafts)"
    )
    parser.add_argument(
        "--static-tree",
        help="static list: a name (default: the target's, toy_demo_fit_8 for the "
        "toy, else mc_sim_7b_63; also naive_extend_57) or a JSON file from python -m inference.tree_fit",
    )
    parser.add_argument("--tree-top-k", type=int, help="dynamic tree: children per node and frontier width (10)")
    parser.add_argument("--tree-depth", type=int, help="dynamic tree: draft levels (5)")
    parser.add_argument("--tree-total", type=int, help="dynamic tree: nodes kept, root included (60)")


def _rules_epilog() -> str:
    lines = ["rule fields (--rule-arg NAME=VALUE):"]
    for name in RULE_CLASSES:
        lines.append(f"  {name}: " + (", ".join(f"{k} ({t})" for k, t in rule_options(name).items()) or "(none)"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=_rules_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    parser.add_argument("--batch-size", type=int, help="images per batch (default 16 for AR, 1 with --drafter)")
    parser.add_argument("--seed", type=int, default=0)
    add_decoder_arguments(parser)
    add_compile_argument(parser)
    parser.add_argument("--rule", choices=tuple(RULE_CLASSES), help="verification rule with --drafter (cascade)")
    parser.add_argument("--rule-arg", action="append", metavar="NAME=VALUE", help="set a rule field (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.num_images < 1:
        raise SystemExit(f"--num-images must be at least 1, got {args.num_images}")
    tree_options = (args.tree, args.static_tree, args.tree_top_k, args.tree_depth, args.tree_total)
    if args.drafter is None and (args.rule or args.rule_arg or any(v is not None for v in tree_options)):
        raise SystemExit("--rule, --rule-arg and the tree options need --drafter")
    batch_size = args.batch_size or (1 if args.drafter else 16)
    if batch_size < 1:
        raise SystemExit(f"--batch-size must be at least 1, got {batch_size}")
    target = load_target_for_process(args.target)
    overrides = {name: getattr(args, name) for name in ("cfg_scale", "temperature", "top_k", "top_p")}
    settings = dataclasses.replace(target.sampling, **{k: v for k, v in overrides.items() if v is not None})
    prompts = [args.prompt] * args.num_images if args.prompt else read_prompt_lines(args.prompts)
    speculative: dict[str, object] = {}
    if args.drafter:
        from inference.decoding.eagle import EagleDrafter

        try:
            rule = build_rule(args.rule or "cascade", target, parse_rule_args(args.rule_arg), args.drafter)
            config = decoder_config(args).for_target(target)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        drafter = EagleDrafter.from_pretrained(args.drafter, target)
        speculative = {"drafter": str(args.drafter), **rule_settings(rule), "tree": dataclasses.asdict(config)}
    verifier = compile_decoding(target, drafter if args.drafter else None, args.compile) if args.compile else verify
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    images, records = [], []
    quiet = len(prompts) <= batch_size or args.drafter is not None  # speculative decoding prints a line per image
    for start in tqdm(range(0, len(prompts), batch_size), desc="batches", disable=quiet):
        batch = prompts[start : start + batch_size]
        if args.drafter:
            spec = generate_speculative(target, drafter, batch, rule, config, settings, generator, verifier=verifier)
            tokens, stats = spec.tokens, [image_statistics(spec, j, len(batch)) for j in range(len(batch))]
        else:
            result = generate_ar(target, batch, settings, generator, progress=True)
            tokens = result.tokens
            per_image = {"tau": 1.0, "target_forwards": result.target_forwards, "drafter_forwards": 0}
            stats = [{**per_image, "seconds": result.seconds / len(batch)} for _ in batch]
        pixels = target.decode_images(tokens).cpu().numpy()
        for offset, (prompt, image, stat) in enumerate(zip(batch, pixels, stats, strict=True)):
            index = start + offset
            _save_png(image, args.out / f"{index:05d}.png")
            records.append({"index": index, "prompt": prompt, "file": f"{index:05d}.png", **stat})
            if args.drafter:
                print(
                    f"image {index}: tau {stat['tau']:.2f} (accepted drafts + 1 per target forward), "
                    f"{stat['target_forwards']} target forwards, {stat['drafter_forwards']} drafter forwards, "
                    f"{stat['seconds']:.2f} s"
                )
        images.append(pixels)
        if not args.drafter:
            print(
                f"batch of {len(batch)}: {result.seconds:.2f} s, mean entropy {result.mean_entropy:.3f} nats, "
                f"mean top-1 probability {result.mean_top1:.3f}"
            )
    _save_png(image_grid(np.concatenate(images)), args.out / "grid.png")
    summary: dict[str, object] = {"target": args.target, "rule": "ar", "sampling": dataclasses.asdict(settings)}
    summary |= {"seed": args.seed, "batch_size": batch_size}
    if args.drafter:
        total_steps = sum(int(r["verification_steps"]) for r in records)
        mean_tau = sum(float(r["tau"]) * int(r["verification_steps"]) for r in records) / max(total_steps, 1)
        summary |= {"rule": speculative["rule"], "speculative": speculative, "tau_definition": TAU_DEFINITION}
        summary |= {"tau": mean_tau, "note": "tree speculative decoding; tau over all verification steps"}
        print(f"mean tau {mean_tau:.3f} over {total_steps} verification steps ({TAU_DEFINITION})")
    else:
        summary["note"] = "plain autoregressive sampling: one target forward per image token"
    summary["images"] = records
    write_json(summary, args.out / "generation.json")
    print(f"wrote {len(records)} images and grid.png to {args.out}")


if __name__ == "__main__":
    main()
