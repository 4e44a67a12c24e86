"""Which states mark CASCADE's convergence region in the training data, scored against the decoded image.

    python -m inference.convergence_region --config demo --batches 16 --out outputs/convergence_region

The objective doubles the soft cross-entropy of a position whose state has cosine > `convergence_tau` with
some later position's state (`training/losses.py`; docs/method.md, section "Convergence-region reweighting"): a region
where the image repeats itself. This command checks that premise on the fit config's own training batches, with the
states the objective reads (stored, or computed online by the frozen target as in training): the system and the
DataModule come from the config through `training.fit.check_config`, the parsing and checks of `python training/fit.py`,
so they share one target (`models.registry.shared_target`). Ground truth comes from the target's image decoder, which
no decode-time signal sees:

- a position is **convergent** when its token's patch of the decoded image lies within `--pixel-threshold`
  grey levels (root mean square over the patch) of the patch of a later token of the same image: the
  signal study's "interchangeable" label (docs/signals.md), between positions instead of between drafts.
  On the toy's patch VQ a patch depends on its token only; on a convolutional decoder it is a stand-in.

Each candidate state (the last hidden state, and each EAGLE-3 stream when the batch has them), compared by
raw and by mean-centred cosine, scores a position by its largest similarity to a later position. The table
gives its ROC AUC against the label, the share of truly convergent positions, and for the config's own
`convergence_source` and `convergence_tau` the share flagged with its precision and recall, next to the
threshold of every other candidate that flags the same share. Writes `convergence_region.json` (the figures,
the table, the command and provenance: `python -m inference.results` renders it) and `table.md` into `--out`.

Shapes: B samples, L positions, D state width, G image tokens, C values per patch.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from data.drafter_data import DrafterDataModule
from inference.decoding.files import write_atomic, write_json
from inference.measure.provenance import provenance
from inference.measure.signals import DEFAULT_PIXEL_THRESHOLD, roc_auc
from models.target import ImageTarget
from training.fit import check_config
from training.losses import convergent_positions, later_pairs, later_similarity
from training.objective import CONVERGENCE_SOURCES, ObjectiveConfig, convergence_stream
from training.system import DrafterSystem

COMPARISONS = ("raw", "centred")


def token_patches(target: ImageTarget, tokens: Tensor) -> Tensor:
    """(B, G) image tokens -> (B, G, C) float grey levels of each token's patch of the decoded image."""
    images = target.decode_images(tokens).float()  # (B, H, W, 3)
    rows, cols = target.geometry.grid
    batch, height, width, channels = images.shape
    blocks = images.view(batch, rows, height // rows, cols, width // cols, channels)
    return blocks.permute(0, 1, 3, 2, 4, 5).reshape(batch, rows * cols, -1)


def convergent_truth(patches: Tensor, mask: Tensor, pixel_threshold: float) -> Tensor:
    """(B, L) bool: a later counted position's patch lies within pixel_threshold grey levels RMS of this one's."""
    rms = torch.cdist(patches.double(), patches.double()) / patches.shape[-1] ** 0.5  # (B, L, L)
    return ((rms <= pixel_threshold) & later_pairs(mask)).any(-1)


def candidate_states(batch: dict[str, Any]) -> dict[str, Tensor]:
    """The states a convergence source can read: `hidden`, and the EAGLE-3 streams when the batch has `aux`."""
    sources = [s for s in CONVERGENCE_SOURCES if s == "hidden" or "aux" in batch]
    return {s: batch["hidden"] if s == "hidden" else convergence_stream(batch, "aux", s, batch["hidden"].device)
            for s in sources}  # fmt: skip


@dataclass
class RegionStudy:
    """Labels and scores of every scored position, gathered batch by batch."""

    objective: ObjectiveConfig
    pixel_threshold: float = DEFAULT_PIXEL_THRESHOLD
    labels: list[Tensor] = field(default_factory=list)
    scores: dict[str, list[Tensor]] = field(default_factory=dict)
    flagged: list[Tensor] = field(default_factory=list)

    def add(self, target: ImageTarget, batch: dict[str, Any]) -> None:
        """Score one batch (tokens, loss_mask and its states, conditional branch)."""
        tokens, mask = batch["tokens"], batch["loss_mask"].bool()
        if tokens.shape[1] != target.geometry.num_tokens:  # pad to a whole image for the decoder
            tokens = F.pad(tokens, (0, target.geometry.num_tokens - tokens.shape[1]))
        scored = (mask & later_pairs(mask).any(-1)).cpu()  # positions with something later to match
        truth = convergent_truth(token_patches(target, tokens.cpu())[:, : mask.shape[1]], mask.cpu(),
                                 self.pixel_threshold)  # fmt: skip
        self.labels.append(truth[scored].double())
        states = candidate_states(batch)
        for source, features in states.items():
            for comparison in COMPARISONS:
                score = later_similarity(features.double(), mask, comparison == "centred").cpu()
                self.scores.setdefault(f"{source} {comparison}", []).append(score[scored])
        own = states[self.objective.convergence_source]  # compared as training compares it
        flagged = convergent_positions(own, mask, self.objective.convergence_tau, self.objective.convergence_centred)
        self.flagged.append(flagged.cpu()[scored].double())

    def summary(self) -> dict[str, Any]:
        """AUC per candidate, the truly convergent share, and the config's threshold against the label."""
        if not self.labels:
            raise ValueError("no batch was scored")
        labels, flagged = torch.cat(self.labels), torch.cat(self.flagged)
        share = float(flagged.mean())
        candidates = {}
        for name, parts in self.scores.items():
            scores = torch.cat(parts)
            # the threshold that flags the same share as the config's: the (1 - share) quantile of the scores
            matched = float(scores.quantile(1 - share)) if 0 < share < 1 else None
            candidates[name] = {"auc": roc_auc(scores, labels), "threshold_same_share": matched}
        hits = float((flagged * labels).sum())
        own = f"{self.objective.convergence_source} {'centred' if self.objective.convergence_centred else 'raw'}"
        return {
            "positions": int(labels.numel()),
            "convergent_share": float(labels.mean()),
            "pixel_threshold": self.pixel_threshold,
            "config": {
                "source": own,
                "tau": self.objective.convergence_tau,
                "flagged_share": share,
                "precision": hits / max(float(flagged.sum()), 1.0),
                "recall": hits / max(float(labels.sum()), 1.0),
            },  # fmt: skip
            "candidates": candidates,
        }


def format_table(summary: dict[str, Any]) -> str:
    """The summary as Markdown: one row per candidate, then the config's threshold."""
    config = summary["config"]
    lines = [
        f"{summary['positions']} positions; truly convergent (a later patch within "
        f"{summary['pixel_threshold']:g} grey levels RMS): {summary['convergent_share']:.3f}",
        "",
        "| state, cosine | AUC | threshold flagging the config's share |",
        "|---|---|---|",
    ]
    for name, row in summary["candidates"].items():
        auc = "-" if row["auc"] is None else f"{row['auc']:.3f}"
        matched = "-" if row["threshold_same_share"] is None else f"{row['threshold_same_share']:.3f}"
        lines.append(f"| {name} | {auc} | {matched} |")
    lines += [
        "",
        f"The config's region ({config['source']} cosine > {config['tau']:g}) flags {config['flagged_share']:.3f} "
        f"of the positions: precision {config['precision']:.3f}, recall {config['recall']:.3f}.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inference.convergence_region", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--config", default="demo", help="fit config: a name in configs/ or a path (default demo)")
    parser.add_argument("--train-dir", help="the dataset (default: the config's data.train_dir)")
    parser.add_argument("--batches", type=int, default=16, help="training batches scored (default 16)")
    parser.add_argument("--pixel-threshold", type=float, default=DEFAULT_PIXEL_THRESHOLD,
                        help="grey levels RMS under which two patches count as alike (default 10)")  # fmt: skip
    parser.add_argument("--convergence-source", choices=CONVERGENCE_SOURCES,
                        help="instead of the config's objective.convergence_source")  # fmt: skip
    parser.add_argument("--convergence-tau", type=float, help="instead of the config's objective.convergence_tau")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, help="folder for convergence_region.json and table.md")
    return parser.parse_args(argv)


def build_study(args: argparse.Namespace) -> tuple[DrafterSystem, DrafterDataModule]:
    """The fit config's system and DataModule, built by `training.fit`'s own config check (`check_config`: the
    same parsing, links and validation as `python training/fit.py`), so the DataModule and the system pass the
    same `target_options` and share one target (`models.registry.shared_target`). The study reads every shard
    (`data.num_val_shards 0`) and the conditional rows only (`data.load_uncond false`)."""
    overrides = ["--data.num_val_shards", "0", "--data.load_uncond", "false"]
    if args.train_dir:
        overrides += ["--data.train_dir", args.train_dir]
    if args.convergence_source:
        overrides += ["--model.objective.convergence_source", args.convergence_source]
    if args.convergence_tau is not None:
        overrides += ["--model.objective.convergence_tau", str(args.convergence_tau)]
    saved_argv = sys.argv  # LightningCLI warns when both its `args` and sys.argv hold arguments
    sys.argv = sys.argv[:1]
    try:
        cli = check_config(["--config", args.config, *overrides])
    finally:
        sys.argv = saved_argv
    return cli.model, cli.datamodule


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    system, datamodule = build_study(args)
    datamodule.setup("fit")
    system.setup("fit")
    target = system.frozen_target
    assert target is not None
    study = RegionStudy(system.objective, args.pixel_threshold)
    with torch.no_grad():
        for batch in tqdm(itertools.islice(datamodule.train_dataloader(), args.batches), total=args.batches,
                          desc="batches", file=sys.stderr):  # fmt: skip
            study.add(target, system.on_after_batch_transfer(batch, 0))
    summary = study.summary()
    table = format_table(summary)
    print(table, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = ["python", "-m", "inference.convergence_region", *(sys.argv[1:] if argv is None else argv)]
        write_json({"command": command, "provenance": provenance(), "config_file": args.config, **summary,
                    "table": table}, args.out / "convergence_region.json")  # fmt: skip
        write_atomic(args.out / "table.md", f"```\n{' '.join(command)}\n```\n\n{table}")
        print(f"wrote {args.out}/convergence_region.json and table.md")
    return summary


if __name__ == "__main__":
    main()
