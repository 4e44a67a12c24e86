"""Which signal knows that two drafted tokens are interchangeable: candidate similarities scored against ground truth.

    python -m inference.signals --target toy --drafter runs/demo/version_0/drafter \
        --num-prompts 64 --prompt-seed 11 --trees static,dynamic --out outputs/signals

CASCADE pools a drafted token with its siblings whose target states are similar (interchangeability) and
relaxes a node whose state resembles its parent's (convergence). This command measures whether a
similarity tells that, on real trees: it decodes captions with the exact rule, records every verified
tree with the finished image, and labels two kinds of pairs of tree nodes:

- siblings (two children of one node: CASCADE's interchangeability sets), and
- parent-child edges (its convergence test).

Labels, from the target's own image decoder (the ground truth no real target gives at decode time):

- **interchangeable**: the finished image with one token or the other at the pair's image position
  (the child's position for an edge) decodes to pixels that differ by at most `--pixel-threshold`
  grey levels, root mean square over one token's patch area. The default, 10, is the toy's background
  grain: the noise the scene generator itself puts on every background pixel, so two tokens closer
  than that are as alike as two renderings of one scene. On a context-free patch decoder (the toy's
  VQ) the label is exact for every pair; on a convolutional decoder the finished image is a
  stand-in context for pairs off the accepted path.
- **substitutable**: the two images read the same scene (every attribute the scene reader reads:
  shapes, colours, sizes, positions, background). Only pairs whose context was committed (their
  parent on the accepted path) and only targets with a scene reader (the embedded worlds: toy, texture).

Signals, each a similarity of the two nodes (higher = more alike), scored by ROC AUC against each label:
the target state after each node's token at every layer EAGLE-3 reads (low, mid, high) and the last
post-norm hidden state CASCADE uses, each as a raw cosine, a per-vector mean-centred cosine (CASCADE's,
`inference.decoding.similarity.cosine`), a cosine after subtracting the mean state of the run's nodes, and a
cosine after whitening with the run's covariance; the cosine of the target's softmaxed guided logits (the CASCADE
authors' Lumina development file) and of the raw guided logits (their LlamaGen file: normalised logits);
minus the distance of the two tokens' latent codes (LANTERN's proximity, `target.latent_table()`); and
the cosine of the drafter's distributions q at the two nodes, where both were drafted from.

The states come from one teacher-forced pass per node over the committed tokens and the node's path
(`models.target.teacher_forced_states`), so they are the states the tree forward computed. Writes
`signals.json` (every pair's labels and signals summarised: AUCs, counts, positive rates),
`table.md` and `signals.png` into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torchmetrics.functional.classification import binary_auroc
from tqdm import tqdm

from inference.decoding.files import write_atomic, write_json
from inference.decoding.rules import ExactRule
from inference.decoding.sampling import processed_distribution
from inference.decoding.similarity import cosine
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative
from inference.decoding.tree import Tree
from inference.decoding.verify import TargetView, Verdict
from inference.measure.provenance import provenance
from models.target import ImageTarget, teacher_forced_states
from models.worlds import embedded_world

PAIR_KINDS = ("sibling", "parent")
LABELS = ("interchangeable", "substitutable")
LAYERS = ("low", "mid", "high", "last")
TRANSFORMS = ("raw", "centred", "mean-removed", "whitened")
DEFAULT_PIXEL_THRESHOLD = 10.0
"""Grey levels (0-255), RMS over one token's patch: the toy scenes' background grain (models/toy/scenes.py GRAIN)."""


@dataclass
class RecordedTree:
    """One verified tree of a one-prompt decode, on the host: what the labels and signals need."""

    tokens: Tensor  # (N,) int64, node 0 the root (the last committed token)
    parents: Tensor  # (N,) int64, -1 at the root
    depths: Tensor  # (N,) int64
    accepted_path: Tensor  # (N,) bool: the root and the accepted nodes
    drafter_cosine: Tensor  # (N, N) cosine of the drafter's q at two nodes, NaN where either has none
    root_position: int = 0  # image position of the root token


@dataclass
class TreeRecorder(DecodeHooks):
    """Records every verified tree of a one-prompt decode and tracks the root's image position."""

    trees: list[RecordedTree] = field(default_factory=list)
    position: int = 0

    def on_verify(self, tree: Tree, view: TargetView, verdict: Verdict) -> None:
        if tree.tokens.shape[0] != 1:
            raise ValueError("the signal recorder follows one prompt at a time (batch of 1)")
        q = tree.q_full[0]  # (N, V)
        drafted = q.sum(-1) > 0  # (N,)
        similarity = cosine(q, pairwise=True).masked_fill(~(drafted[:, None] & drafted[None, :]), float("nan"))
        parents = tree.parents[0].cpu()
        on_path = torch.zeros_like(parents, dtype=torch.bool)
        node = int(verdict.last_node[0])
        while node >= 0:  # the accepted path, walked up from its deepest node
            on_path[node] = True
            node = int(parents[node])
        self.trees.append(
            RecordedTree(tree.tokens[0].cpu(), parents, tree.depths[0].cpu(), on_path, similarity.cpu(), self.position)
        )
        self.position += int(verdict.num_accepted[0]) + 1


@dataclass
class PairTable:
    """Every labelled pair of one kind: its labels (NaN: not labelled) and its signals."""

    labels: dict[str, list[float]] = field(default_factory=lambda: {label: [] for label in LABELS})
    signals: dict[str, list[float]] = field(default_factory=dict)

    def add(self, labels: dict[str, Tensor], signals: dict[str, Tensor]) -> None:
        for name, values in labels.items():
            self.labels[name] += values.tolist()
        for name, values in signals.items():
            self.signals.setdefault(name, []).extend(values.tolist())


def node_pairs(tree: RecordedTree, kind: str, usable: Tensor) -> Tensor:
    """(P, 2) node ids: sibling pairs (i < j, distinct tokens) or (child, parent) edges, both nodes usable."""
    parents = tree.parents
    if kind == "parent":
        child = torch.nonzero((parents >= 0) & usable).squeeze(-1)
        child = child[usable[parents[child]]]
        return torch.stack([child, parents[child]], dim=-1)
    same = (parents[:, None] == parents[None, :]) & (parents >= 0)[:, None]  # (N, N)
    same &= torch.ones_like(same).triu(1) & (tree.tokens[:, None] != tree.tokens[None, :])
    same &= usable[:, None] & usable[None, :]
    return torch.nonzero(same)


def node_states(target: ImageTarget, prompt: str, image: Tensor, trees: list[RecordedTree]) -> dict[str, Tensor]:
    """Target states after each node's token, for every node of every tree (concatenated in tree order).

    Returns "low", "mid", "high" (aux streams), "last" (post-norm hidden), each (M, D), and "logits"
    (M, V): the guided logits predicting the node's next token. Nodes at the image's last position
    predict nothing and get the last position's state (`usable_nodes` leaves them out). One teacher-forced
    row per leaf, the committed tokens and the leaf's path, cut after the deepest state needed: every node
    on that path reads its state off the same row (the states are causal).
    """
    num_tokens = target.geometry.num_tokens
    sequences: list[list[int]] = []
    source_row, position = [], []  # per node: its leaf's row, and the index of its state in that row
    for tree in trees:
        parents = tree.parents.tolist()
        has_child = set(parents[1:])
        assigned = [-1] * len(parents)
        for leaf in (n for n in range(len(parents)) if n not in has_child):
            path, current = [], leaf
            while current >= 0:
                path.append(current)
                current = parents[current]
            for node in path:  # the leaf and its ancestors not yet given a row
                if assigned[node] < 0:
                    assigned[node] = len(sequences)
            below_root = [int(tree.tokens[n]) for n in reversed(path[:-1])]  # top down
            sequences.append(image[: tree.root_position + 1].tolist() + below_root)
        source_row += assigned
        position += [min(tree.root_position + int(d) + 1, num_tokens - 1) for d in tree.depths]
    length = max(position) + 1  # the longest prefix any state needs
    padded = torch.tensor([(seq + [0] * length)[:length] for seq in sequences], dtype=torch.long)  # (L, length)
    cfg = target.sampling.cfg_scale != 1.0
    states = teacher_forced_states(target, [prompt] * len(sequences), padded, aux=True, uncond=cfg)
    device = states.hidden.device
    pick = torch.tensor(source_row, device=device), torch.tensor(position, device=device)  # (M,) each
    aux = states.aux[pick].float() if states.aux is not None else None  # (M, 3D)
    last = states.hidden[pick]  # (M, D)
    heads = [last] + ([states.uncond_hidden[pick]] if cfg and states.uncond_hidden is not None else [])
    logits = target.image_head(torch.cat(heads))  # (R, V)
    guided, _ = processed_distribution(logits[:, None], target.sampling, cfg, target, pick[1][:, None], unfiltered=True)
    out = {"last": last.float().cpu(), "logits": guided[:, 0].float().cpu()}
    if aux is not None:
        for name, part in zip(LAYERS[:3], aux.chunk(3, dim=-1), strict=True):
            out[name] = part.cpu()
    return out


def usable_nodes(tree: RecordedTree, num_tokens: int) -> Tensor:
    """(N,) bool: nodes inside the image whose state predicts a token (position < G - 1)."""
    return tree.root_position + tree.depths < num_tokens - 1


def swapped_images(target: ImageTarget, image: Tensor, positions: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """The finished image with `first` then `second` at `positions`: (2P, H, W, C) decoded, first halves first."""
    canvases = image[None].repeat(2 * positions.shape[0], 1)  # (2P, G)
    both = torch.cat([positions, positions])
    canvases[torch.arange(both.shape[0]), both] = torch.cat([first, second])
    return target.decode_images(canvases)


def pair_labels(
    target: ImageTarget, image: Tensor, tree: RecordedTree, pairs: Tensor, kind: str, pixel_threshold: float,
    reader: Any | None,
) -> dict[str, Tensor]:  # fmt: skip
    """Interchangeable and substitutable labels (1/0, NaN where not labelled) of (P, 2) pairs of one tree."""
    first, second = tree.tokens[pairs[:, 0]], tree.tokens[pairs[:, 1]]
    positions = tree.root_position + tree.depths[pairs[:, 0]]  # the child's position for an edge
    images = swapped_images(target, image, positions, first, second).float()  # (2P, H, W, C)
    a, b = images.chunk(2)
    patch_area = images[0].numel() / target.geometry.num_tokens
    rms = ((a - b) ** 2).flatten(1).sum(-1).div(patch_area).sqrt()  # (P,) grey levels over one token's patch
    labels = {"interchangeable": (rms <= pixel_threshold).double()}
    committed = tree.accepted_path[tree.parents[pairs[:, 0]]]  # the pair's context was committed
    substitutable = torch.full((pairs.shape[0],), float("nan"), dtype=torch.float64)
    if reader is not None and bool(committed.any()):
        with torch.no_grad():
            read_a, read_b = reader.read(a.to(torch.uint8)), reader.read(b.to(torch.uint8))
        same = torch.stack([(read_a[k] == read_b[k]).reshape(a.shape[0], -1).all(-1) for k in read_a]).all(0)
        substitutable[committed] = same[committed].double()
    labels["substitutable"] = substitutable
    return labels


def representation_transforms(states: Tensor) -> dict[str, Callable[[Tensor], Tensor]]:
    """The four views of one layer's states (M, D): raw, per-vector centred, the run's mean removed, whitened."""
    mean = states.double().mean(0)
    centred = states.double() - mean
    covariance = centred.T @ centred / max(states.shape[0] - 1, 1)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    floor = eigenvalues.clamp_min(0).mean() * 1e-3  # shrinkage: directions the nodes never vary in stay finite
    whitening = eigenvectors / (eigenvalues.clamp_min(0) + floor).sqrt()  # (D, D)
    return {
        "raw": lambda x: x.double(),
        "centred": lambda x: x.double() - x.double().mean(-1, keepdim=True),
        "mean-removed": lambda x: x.double() - mean,
        "whitened": lambda x: (x.double() - mean) @ whitening,
    }


def pair_signals(
    states: dict[str, Tensor], transforms: dict[str, dict[str, Callable[[Tensor], Tensor]]], offsets: Tensor,
    pairs: Tensor, tree: RecordedTree, latent: Tensor | None,
) -> dict[str, Tensor]:  # fmt: skip
    """Every candidate similarity of (P, 2) pairs of one tree; `offsets` is the tree's first row in `states`."""
    rows_a, rows_b = offsets + pairs[:, 0], offsets + pairs[:, 1]
    out: dict[str, Tensor] = {}
    for layer, views in transforms.items():
        for name, view in views.items():
            out[f"{layer} state, {name}"] = cosine(view(states[layer][rows_a]), view(states[layer][rows_b]))
    logits_a, logits_b = states["logits"][rows_a], states["logits"][rows_b]
    out["softmaxed logits (Lumina dev file)"] = cosine(logits_a.double().softmax(-1), logits_b.double().softmax(-1))
    out["normalised logits (LlamaGen dev file)"] = cosine(logits_a.double(), logits_b.double())
    if latent is not None:
        codes = latent[tree.tokens[pairs[:, 0]]].double(), latent[tree.tokens[pairs[:, 1]]].double()
        out["latent code distance, negated (LANTERN)"] = -(codes[0] - codes[1]).norm(dim=-1)
    out["drafter q, cosine"] = tree.drafter_cosine[pairs[:, 0], pairs[:, 1]].double()
    return out


def roc_auc(scores: Tensor, labels: Tensor) -> float | None:
    """Area under the ROC curve (ties count half); None without both classes. NaN scores or labels are left out.

    torchmetrics' exact curve (`binary_auroc` without thresholds): its trapezoids over tied scores count a tied
    (positive, negative) pair as half a win, the Mann-Whitney statistic (tests/test_signals.py checks it against
    the pair count)."""
    keep = ~(scores.isnan() | labels.isnan())
    scores, labels = scores[keep], labels[keep].long()
    positives = int(labels.sum())
    if positives == 0 or positives == labels.numel():
        return None
    return float(binary_auroc(scores.double(), labels))


@dataclass
class SignalStudy:
    """The pairs of every tree kind and pair kind, and how they were obtained."""

    tables: dict[str, dict[str, PairTable]]  # tree kind -> pair kind -> table
    settings: dict[str, Any]

    def summary(self) -> list[dict[str, Any]]:
        """One record per (tree, pair kind, label, signal): AUC, labelled pairs, positive rate, coverage."""
        records = []
        for tree_kind, kinds in self.tables.items():
            for kind, table in kinds.items():
                for label in LABELS:
                    target = torch.tensor(table.labels[label], dtype=torch.float64)
                    labelled = ~target.isnan()
                    for signal, values in table.signals.items():
                        scores = torch.tensor(values, dtype=torch.float64)
                        covered = labelled & ~scores.isnan()
                        records.append({
                            "tree": tree_kind, "pairs": kind, "label": label, "signal": signal,
                            "auc": roc_auc(scores, target), "labelled": int(labelled.sum()),
                            "covered": int(covered.sum()),
                            "positive_rate": float(target[labelled].mean()) if bool(labelled.any()) else None,
                        })  # fmt: skip
        return records


def study_signals(
    target: ImageTarget, drafter: Any, prompts: list[str], configs: dict[str, DecoderConfig],
    pixel_threshold: float = DEFAULT_PIXEL_THRESHOLD, reader: Any | None = None, seed: int = 0,
    trees_per_image: int | None = None,
) -> SignalStudy:  # fmt: skip
    """Decode every prompt on every tree kind (exact rule), label the pairs and compute the signals.

    `trees_per_image` keeps that many of an image's verified trees, evenly spaced over its steps (None: all):
    the states cost one teacher-forced row per leaf, which on a 60-node dynamic tree is most of the time."""
    latent = target.latent_table().cpu() if _has_latent_table(target) else None
    num_tokens = target.geometry.num_tokens
    tables: dict[str, dict[str, PairTable]] = {}
    for tree_kind, config in configs.items():
        collected: list[tuple[str, Tensor, list[RecordedTree], dict[str, Tensor]]] = []
        for i, prompt in enumerate(tqdm(prompts, desc=f"decoding ({tree_kind})", leave=False)):
            recorder = TreeRecorder()
            generator = torch.Generator(device=target.device).manual_seed(seed + i)
            result = generate_speculative(target, drafter, [prompt], ExactRule(), config, generator=generator,
                                          hooks=recorder)  # fmt: skip
            image = result.tokens[0].cpu()
            for tree in recorder.trees:  # the recorder's positions must land on the committed tokens
                if tree.root_position < num_tokens and int(tree.tokens[0]) != int(image[tree.root_position]):
                    raise RuntimeError(f"tree root at position {tree.root_position} is not the committed token")
            trees = [t for t in recorder.trees if t.root_position < num_tokens - 1]
            if trees_per_image is not None and len(trees) > trees_per_image:
                keep = torch.linspace(0, len(trees) - 1, trees_per_image).round().long().tolist()
                trees = [trees[i] for i in keep]
            collected.append((prompt, image, trees, node_states(target, prompt, image, trees)))
        # the run's statistics for the mean-removed and whitened views: every node of this tree kind
        pooled = {layer: torch.cat([c[3][layer] for c in collected]) for layer in LAYERS if layer in collected[0][3]}
        transforms = {layer: representation_transforms(states) for layer, states in pooled.items()}
        tables[tree_kind] = {kind: PairTable() for kind in PAIR_KINDS}
        for _prompt, image, trees, states in tqdm(collected, desc=f"labelling ({tree_kind})", leave=False):
            offset = 0
            for tree in trees:
                usable = usable_nodes(tree, num_tokens)
                for kind in PAIR_KINDS:
                    pairs = node_pairs(tree, kind, usable)
                    if pairs.shape[0]:
                        labels = pair_labels(target, image, tree, pairs, kind, pixel_threshold, reader)
                        signals = pair_signals(states, transforms, torch.tensor(offset), pairs, tree, latent)
                        tables[tree_kind][kind].add(labels, signals)
                offset += tree.tokens.shape[0]
    settings = {"target": target.name, "prompts": len(prompts), "pixel_threshold": pixel_threshold, "seed": seed,
                "trees_per_image": trees_per_image,
                "trees": {k: dataclasses.asdict(c) for k, c in configs.items()}}  # fmt: skip
    return SignalStudy(tables, settings)


def _has_latent_table(target: ImageTarget) -> bool:
    try:
        target.latent_table()
    except (NotImplementedError, AttributeError):
        return False
    return True


def format_table(records: list[dict[str, Any]]) -> str:
    """Markdown: one table per tree kind, a row per signal, a column per (pair kind, label)."""
    lines = []
    for tree_kind in dict.fromkeys(r["tree"] for r in records):
        rows = [r for r in records if r["tree"] == tree_kind]
        columns = [(kind, label) for kind in PAIR_KINDS for label in LABELS]
        header = [f"{kind} / {label}" for kind, label in columns]
        lines += [f"### Tree {tree_kind}", "", "| signal | " + " | ".join(header) + " |",
                  "|---|" + "---|" * len(columns)]  # fmt: skip
        for signal in dict.fromkeys(r["signal"] for r in rows):
            cells = []
            for kind, label in columns:
                match = next(r for r in rows if r["signal"] == signal and r["pairs"] == kind and r["label"] == label)
                auc = "-" if match["auc"] is None else f"{match['auc']:.3f}"
                partial = match["covered"] < match["labelled"]
                cells.append(f"{auc} ({match['covered']} of {match['labelled']})" if partial else auc)
            lines.append(f"| {signal} | " + " | ".join(cells) + " |")
        counts = []
        for kind, label in columns:
            first = next(r for r in rows if r["pairs"] == kind and r["label"] == label)
            rate = "-" if first["positive_rate"] is None else f"{first['positive_rate']:.2f}"
            counts.append(f"{first['labelled']} pairs, {rate} positive")
        lines += ["| *labelled pairs* | " + " | ".join(counts) + " |", ""]
    return "\n".join(lines)


def plot_auc(records: list[dict[str, Any]], path: Path) -> None:
    """Horizontal bars of every signal's AUC, one panel per (tree kind, pair kind, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["tree"], r["pairs"], r["label"]) for r in records))
    signals = list(dict.fromkeys(r["signal"] for r in records))
    columns = len(PAIR_KINDS) * len(LABELS)
    rows = max(1, len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 0.32 * len(signals) * rows + 1.5),
                                sharey=True, squeeze=False)  # fmt: skip
    for axis, (tree_kind, kind, label) in zip(axes.flat, panels, strict=False):
        values = []
        for signal in signals:
            match = [
                r
                for r in records
                if (r["tree"], r["pairs"], r["label"], r["signal"]) == (tree_kind, kind, label, signal)
            ]
            values.append(match[0]["auc"] if match and match[0]["auc"] is not None else float("nan"))
        axis.barh(range(len(signals)), [v - 0.5 for v in values], left=0.5, color="tab:blue")
        axis.axvline(0.5, color="grey", lw=0.8)
        axis.set_xlim(0.0, 1.0)
        axis.set_title(f"{tree_kind}: {kind} / {label}", fontsize=9)
        axis.set_yticks(range(len(signals)), signals, fontsize=7)
        axis.set_xlabel("ROC AUC (0.5 = chance)", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="toy")
    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-seed", type=int, default=11,
                        help="held-out captions of an embedded world (toy, texture) drawn with this seed")  # fmt: skip
    parser.add_argument("--prompts-file", type=Path,
                        help="captions, one a line (targets other than an embedded world (toy, texture))")  # fmt: skip
    parser.add_argument("--trees", default="static,dynamic", help="tree kinds: static, dynamic, dynamic-sampled")
    parser.add_argument("--pixel-threshold", type=float, default=DEFAULT_PIXEL_THRESHOLD,
                        help="interchangeable: RMS grey levels over a token's patch at most this")  # fmt: skip
    parser.add_argument("--trees-per-image", type=int, default=8,
                        help="verified trees kept per image, evenly spaced (0: all)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of caption i is seed + i")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, required=True, help="folder for signals.json, table.md, signals.png")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from inference.decoding.eagle import EagleDrafter
    from models.registry import load_target_for_process

    target = load_target_for_process(args.target)
    drafter = EagleDrafter.from_pretrained(args.drafter, target)
    world = embedded_world(args.target)
    if world is not None:
        prompts, reader = world.captions(args.num_prompts, args.prompt_seed, "heldout"), world.scene_reader()
    elif args.prompts_file is not None:  # a real target: interchangeability from its decoder, no scene reader
        lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        prompts, reader = [line.strip() for line in lines if line.strip()][: args.num_prompts], None
    else:
        raise SystemExit(f"target {args.target!r}: give --prompts-file (one caption a line); only an embedded world "
                         "(toy, texture) has its own")  # fmt: skip
    configs = {kind: DecoderConfig(tree=kind) for kind in args.trees.split(",")}
    study = study_signals(target, drafter, prompts, configs, args.pixel_threshold, reader, args.seed,
                          args.trees_per_image or None)  # fmt: skip
    records = study.summary()
    command = ["python", "-m", "inference.signals", *(argv if argv is not None else sys.argv[1:])]
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "provenance": provenance(), "settings": study.settings, "records": records}
    write_json(payload, args.out / "signals.json")
    seeds = f"{len(prompts)} captions (seed {args.prompt_seed}), sampling seed {args.seed}."
    header = f"```bash\n{' '.join(command)}\n```\n\n{seeds}\n\n"
    write_atomic(args.out / "table.md", header + format_table(records))
    plot_auc(records, args.out / "signals.png")
    print(format_table(records))
    print(f"wrote {args.out}/signals.json, table.md, signals.png")
    return records


if __name__ == "__main__":
    main()
