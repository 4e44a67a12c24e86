"""Reporting of `inference.bench` runs: the text table, the markdown table of docs/results.md and the Pareto plot.

    print(format_table(records))
    Path("table.md").write_text(format_markdown(records, command, summary))
    plot_sweep(records, Path("pareto.png"), sweep_title(summary))

`Quality` scores images with an embedded world's scene reader (prompt fidelity, FID-style distance).
`records` are the JSON-ready rows `inference.measure.bench.summarise` returns (tau, forwards, speed, quality,
the time split of a step); nothing here decodes.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inference.decoding.files import write_atomic
from models.target import ImageTarget
from models.worlds import reading_world


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """The records as an aligned text table."""
    header = ["method", "tau", "tgt fwd/img", "drf fwd/img", "s/img", "speedup", "fidelity", "FID vs AR",
              "verify ms/step", "target ms/step", "draft ms/step", "verify share", "TV/step"]  # fmt: skip
    rows = [header]
    for r in records:
        ms = r["ms_per_step"]
        fidelity = "-" if r["fidelity"] is None else f"{r['fidelity']:.3f}±{r['fidelity_se']:.3f}"
        fid = _cell(r["fid_vs_ar"], ".1f") + ("*" if r["rule"] == "ar" and r["fid_vs_ar"] is not None else "")
        rows.append(
            [
                r["label"],
                f"{r['tau']:.2f}",
                f"{r['target_forwards_per_image']:.1f}",
                f"{r['drafter_forwards_per_image']:.1f}",
                f"{r['seconds_per_image']:.3f}",
                _cell(r["speedup_vs_ar"], ".2f") + ("x" if r["speedup_vs_ar"] is not None else ""),
                fidelity,
                fid,
                _cell(ms.get("verify"), ".2f"),
                _cell(ms.get("target"), ".2f"),
                _cell(ms.get("draft"), ".2f"),
                "-" if r["verify_share"] is None else f"{100 * r['verify_share']:.0f}%",
                f"{r['tv_charged_per_step']:.3f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_markdown(records: Sequence[dict[str, Any]], command: Sequence[str], summary: dict[str, Any]) -> str:
    """The records as the decoding table (docs/results.md): the command, the seeds, each rule's settings."""
    lines = [
        "```bash",
        " ".join(command),
        "```",
        "",
        f"{summary['num_prompts']} prompts ({summary['prompt_source']}), sampling seed {summary['seed']}, "
        f"tree {summary['tree']['tree']}, {summary['threads']} threads, {summary['seconds']:.0f} s.",
        "",
        "| method | settings | τ | target fwd / image | s / image | speedup vs AR | prompt fidelity | FID-style vs AR"
        " |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        settings = ", ".join(f"{k} {v}" for k, v in r["settings"].items()) or "-"
        fidelity = "-" if r["fidelity"] is None else f"{r['fidelity']:.3f} ± {r['fidelity_se']:.3f}"
        fid = _cell(r["fid_vs_ar"], ".1f") + (" (AR vs AR)" if r["rule"] == "ar" and r["fid_vs_ar"] is not None else "")
        speedup = _cell(r["speedup_vs_ar"], ".2f") + ("x" if r["speedup_vs_ar"] is not None else "")
        lines.append(
            f"| {r['label']} | {settings} | {r['tau']:.2f} | {r['target_forwards_per_image']:.1f} | "
            f"{r['seconds_per_image']:.3f} | {speedup} | {fidelity} | {fid} |"
        )
    return "\n".join(lines) + "\n"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points not dominated in (x up, y up), sorted by x."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def plot_sweep(records: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Tau against fidelity (left, ± one standard error) and FID-style distance to AR (right), one series
    per rule, each point annotated with the settings that vary within its series; written to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        series.setdefault(r["series"], []).append(r)
    ar = next((r for r in records if r["rule"] == "ar"), None)
    panels = ((axes[0], "fidelity", "prompt fidelity (higher is better)"),
              (axes[1], "fid_vs_ar", "FID-style distance to AR (lower is better)"))  # fmt: skip
    # one colour per rule series, one marker and line style per tree kind (records of several trees)
    bases = list(dict.fromkeys(_series_base(r) for r in records if r["rule"] != "ar"))
    for ax, key, label in panels:
        for name, points in series.items():
            pts = sorted((p for p in points if p[key] is not None), key=lambda p: (p["tau"], p[key]))
            if name == "ar" or not pts:
                continue
            colour = f"C{bases.index(_series_base(pts[0])) % 10}"
            marker, line = TREE_MARKERS.get(pts[0].get("tree", "static"), ("o", "-"))
            xs, ys = [p["tau"] for p in pts], [p[key] for p in pts]
            ax.plot(xs, ys, marker=marker, linestyle=line, color=colour, label=name)
            if key == "fidelity":
                ax.errorbar(xs, ys, yerr=[p["fidelity_se"] for p in pts], fmt="none", ecolor=colour, alpha=0.3)
            varying = _varying_settings(points)
            for p in pts:
                text = ",".join(f"{k}={p['settings'].get(k)}" for k in varying)
                if text:
                    ax.annotate(text, (p["tau"], p[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if ar and ar[key] is not None:
            ax.axhline(ar[key], color="black", linestyle=":", label="AR" if key == "fidelity" else "AR vs AR (floor)")
            if key == "fidelity":
                ax.axhspan(ar[key] - 0.03, ar[key] + 0.03, color="grey", alpha=0.15, label="AR ± 0.03")
        sign = 1.0 if key == "fidelity" else -1.0  # the front maximises tau and quality
        front = pareto_front([(r["tau"], sign * r[key]) for r in records if r[key] is not None and r["rule"] != "ar"])
        if front:
            ax.step([x for x, _ in front], [sign * y for _, y in front], where="post",
                    color="grey", linestyle="--", linewidth=0.8, label="Pareto front")  # fmt: skip
        ax.set_xlabel("tau (accepted drafts + 1 per target forward)")
        ax.set_ylabel(label)
        if key == "fid_vs_ar":
            ax.set_yscale("log")  # distances span two orders of magnitude once a rule breaks the images
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


TREE_MARKERS = {"static": ("o", "-"), "dynamic": ("s", "--"), "dynamic-sampled": ("^", ":")}
"""Marker and line style of each tree kind's series in `plot_sweep`."""


def _series_base(record: dict[str, Any]) -> str:
    """A record's series name without its " (tree kind)" suffix: the colour key of `plot_sweep`."""
    suffix = f" ({record['tree']})" if "tree" in record else ""
    name = str(record["series"])
    return name[: -len(suffix)] if suffix and name.endswith(suffix) else name


def _varying_settings(points: Sequence[dict[str, Any]]) -> list[str]:
    """The setting names whose values differ between the points of one series."""
    names = sorted({k for p in points for k in p["settings"]})
    return [k for k in names if len({json.dumps(p["settings"].get(k)) for p in points}) > 1]


def sweep_title(summary: dict[str, Any]) -> str:
    """The plot title: target, drafter, prompts and tree of a bench summary."""
    tree = summary["tree"]
    return (f"{summary['target']}, drafter {summary['drafter']}, {summary['num_prompts']} prompts "
            f"({summary['prompt_source']}), tree {tree['tree']} top_k={tree['top_k']} depth={tree['depth']} "
            f"total={tree['total_tokens']}")  # fmt: skip


class Quality:
    """Prompt fidelity and FID-style distance with an embedded world's scene reader (None where it cannot read).

    `reader`: a `models.toy.SceneReader` (or subclass) for the target's images; None = the one of the world
    `models.worlds.reading_world` names for the target (the toy's for a target drawing toy-sized images).
    """

    def __init__(self, target: ImageTarget, reader: Any = None) -> None:
        self.target = target
        if reader is None:
            world = reading_world(target.name, target.geometry.image_size)
            if world is None:
                raise ValueError(f"no embedded world's scene reader reads the images of target {target.name!r}")
            reader = world.scene_reader()
        self.reader = reader

    @classmethod
    def for_target(cls, target: ImageTarget) -> Quality | None:
        """The scorer of `target`'s images; None, and no quality columns, for a target no scene reader reads
        (a real target) or whose world ships no reader yet (said once on stdout)."""
        world = reading_world(target.name, target.geometry.image_size)
        if world is None:
            return None
        try:
            return cls(target, world.scene_reader())
        except FileNotFoundError as error:
            print(f"no prompt fidelity or FID-style distance: {error}")
            return None

    def images(self, tokens: list[Tensor]) -> Tensor:
        """N x (G,) tokens -> (N, H, W, 3) uint8 on the CPU."""
        return self.target.decode_images(torch.stack(tokens).to(self.target.device)).cpu()

    def readable(self, images: Tensor) -> bool:
        side = self.reader.image_size
        return tuple(images.shape[1:]) == (side, side, 3)

    def fidelity(self, images: Tensor, prompts: Sequence[str]) -> tuple[float | None, float | None]:
        """Fraction of images matching their caption and its binomial standard error."""
        if not self.readable(images):
            return None, None
        try:
            value = self.reader.fidelity(images, list(prompts))
        except ValueError:  # captions outside the world's grammar
            return None, None
        return value, math.sqrt(max(value * (1 - value), 0.0) / len(prompts))

    def distance(self, reference: Tensor, images: Tensor) -> float | None:
        from models.toy import frechet_distance

        if not self.readable(images) or len(images) < 2:
            return None
        value = frechet_distance(reference, images, self.reader)
        return value if math.isfinite(value) else None
