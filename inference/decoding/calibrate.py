"""Calibrate CASCADE's similarity thresholds per target: quantiles of similarities measured on real trees.

    python -m inference.calibrate --target toy --drafter runs/demo/version_0/drafter --num-prompts 16

decodes held-out prompts with the drafter (exact rule, the default tree), collects at every
verification the mean-centred cosine similarities CASCADE thresholds (docs/method.md, section "The similarity and its
representation"): between siblings (interchangeability, tau_pos) and between a node and its parent (convergence,
tau_seq), and writes `cascade_calibration.json` next to the drafter (or to --out): the quantiles of both distributions
and the thresholds at the chosen quantiles. `inference.decoding.generate.build_rule` (and so generate, bench and the
decode-validation callback) reads the file from the drafter folder when it is there: raw cosines mean different things
per target, quantiles do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from inference.decoding.files import write_json
from inference.decoding.rules import REPRESENTATIONS, CascadeRule
from inference.decoding.similarity import cosine
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative
from inference.decoding.tree import Tree
from inference.decoding.verify import TargetView, Verdict

CALIBRATION_FILE = "cascade_calibration.json"
DEFAULT_QUANTILES = {"tau_pos": 0.9, "tau_seq": 0.5}
"""Sibling pairs above their 90th percentile are interchangeable; child-parent edges above their median converge."""


class SimilarityRecorder(DecodeHooks):
    """Collects sibling and child-parent centred cosines of the cond-branch features of every tree verified."""

    def __init__(self) -> None:
        self.sibling: list[Tensor] = []
        self.parent: list[Tensor] = []

    def on_verify(self, tree: Tree, view: TargetView, verdict: Verdict) -> None:
        if view.features is None:
            raise ValueError("similarity recording needs the target view's features (decode with a CascadeRule)")
        cosines = cosine(view.features, centred=True, pairwise=True)  # (B, N, N), as in CascadeRule.prepare
        parents = tree.parents  # (B, N)
        has_parent = parents >= 0
        to_parent = cosines.gather(2, parents.clamp_min(0)[..., None]).squeeze(2)  # (B, N)
        self.parent.append(to_parent[has_parent].cpu())
        same = (parents[:, :, None] == parents[:, None, :]) & has_parent[:, :, None]  # (B, N, N)
        same &= torch.ones_like(same[0]).triu(1)  # each pair once
        self.sibling.append(cosines[same].cpu())


def calibrate(target: Any, drafter: Any, prompts: list[str], config: DecoderConfig | None = None,
              quantiles: dict[str, float] | None = None, seed: int = 0,
              representation: str = "hidden") -> dict[str, Any]:  # fmt: skip
    """Decode `prompts`, record the similarities of `representation` (`CascadeRule.representation`) and return
    the calibration record (thresholds at `quantiles`)."""
    quantiles, config = quantiles or DEFAULT_QUANTILES, (config or DecoderConfig()).for_target(target)
    recorder = SimilarityRecorder()
    rule = CascadeRule(delta=0.0, representation=representation)  # delta 0: the exact rule, features computed
    for i, prompt in enumerate(tqdm(prompts, desc="calibrating", leave=False)):
        generator = torch.Generator(device=target.device).manual_seed(seed + i)
        generate_speculative(target, drafter, [prompt], rule, config, generator=generator, hooks=recorder)
    sibling, parent = torch.cat(recorder.sibling).double(), torch.cat(recorder.parent).double()
    levels = [0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95]
    return {
        "target": target.name,
        "representation": representation,
        "quantiles": quantiles,
        "tau_pos": float(sibling.quantile(quantiles["tau_pos"])),
        "tau_seq": float(parent.quantile(quantiles["tau_seq"])),
        "sibling_similarity": {str(q): float(sibling.quantile(q)) for q in levels},
        "parent_similarity": {str(q): float(parent.quantile(q)) for q in levels},
        "pairs": {"sibling": int(sibling.numel()), "parent": int(parent.numel())},
        "prompts": len(prompts),
        "tree": dataclasses.asdict(config),
    }


def load_calibration(folder: Path | str | None, target_name: str) -> dict[str, Any]:
    """tau_pos, tau_seq and the representation they were measured on, from `folder/cascade_calibration.json`;
    {} when there is none. A file written for another target is an error naming both."""
    if folder is None:
        return {}
    path = Path(folder) / CALIBRATION_FILE
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        recorded = record["target"]
        values = {"tau_pos": float(record["tau_pos"]), "tau_seq": float(record["tau_seq"]),
                  "representation": str(record.get("representation", "hidden"))}  # fmt: skip
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a CASCADE calibration (needs target, tau_pos, tau_seq): {error}") from None
    if recorded != target_name:
        raise ValueError(
            f"{path} calibrates target {recorded!r}, not {target_name!r}: rerun python -m inference.calibrate "
            f"--target {target_name} or remove the file"
        )
    return values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="toy")
    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder; the file is written into it")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-seed", type=int, default=5, help="held-out captions of an embedded world (toy, "
                        "texture: the target's own, else the toy's) drawn with this seed")  # fmt: skip
    parser.add_argument("--quantile-pos", type=float, default=DEFAULT_QUANTILES["tau_pos"])
    parser.add_argument("--quantile-seq", type=float, default=DEFAULT_QUANTILES["tau_seq"])
    parser.add_argument(
        "--representation",
        default="hidden",
        choices=REPRESENTATIONS,
        help="the similarity features to calibrate; rules built with this drafter then use them",
    )
    parser.add_argument("--out", type=Path, help=f"output file (default: DRAFTER/{CALIBRATION_FILE})")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing calibration file")
    args = parser.parse_args(argv)
    out = args.out or args.drafter / CALIBRATION_FILE
    if out.exists() and not args.overwrite:
        raise SystemExit(f"{out} exists; pass --overwrite to replace it")
    from inference.decoding.eagle import EagleDrafter
    from models.registry import load_target_for_process
    from models.worlds import caption_world

    target = load_target_for_process(args.target)
    drafter = EagleDrafter.from_pretrained(args.drafter, target)
    prompts = caption_world(args.target).captions(args.num_prompts, args.prompt_seed, "heldout")
    quantiles = {"tau_pos": args.quantile_pos, "tau_seq": args.quantile_seq}
    record = calibrate(target, drafter, prompts, quantiles=quantiles, representation=args.representation)
    record["command"] = ["python", "-m", "inference.calibrate", *(argv if argv is not None else sys.argv[1:])]
    write_json(record, out)
    print(
        json.dumps(
            {k: record[k] for k in ("target", "tau_pos", "tau_seq", "sibling_similarity", "parent_similarity")},
            indent=1,
        )
    )
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
