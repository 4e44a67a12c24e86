"""docs/results.md, rendered from the JSON the benchmark commands wrote: one command keeps the page true.

    python -m inference.results                 # rewrite docs/results.md from docs/results/page.json
    python -m inference.results --check         # exit 1 when the page is not what its sources render

`docs/results/page.json` lists the page's sections in order; each names its kind and the JSON files (in
`docs/results/`) a benchmark command wrote, copied there unchanged:

- `decoding_table`: `python -m inference.decoding_table`'s `table.json`, one table per tree;
- `drafters`: several decoding tables of the same grid, one per drafter (or tree: `row_header` names the rows),
  as one table (a row each: exact's and CASCADE's tau, speed and quality), and, where rows name an `arm`, each
  arm's mean and seed spread;
- `bench`: `python -m inference.bench --out`'s JSON (a sweep or a set of rules), one table;
- `signals`: `python -m inference.signals`'s `signals.json`, the AUC table;
- `op_count`: `python -m inference.bench --count-ops --out`, ops and host syncs per step;
- `table`: a command's JSON that carries its own Markdown `table` (`python -m inference.convergence_region`).

A section may carry a `note` (Markdown, no figures: it explains how to read the table). Every table is
printed under the command(s) that made it and the date, machine and commit from the JSON's `provenance`
(`inference.measure.provenance`: every benchmark command stamps its JSON with it); `tests/test_results_page.py`
checks both, and that the page is rendered.

A figure must be reproducible from a commit: a source stamped `<commit>+changes` was made from a work tree with
uncommitted changes, which no one can check out again. The page refuses such a source (`uncommitted_sources`), and
`--check` names each one with the command that regenerates it; run that command at a clean commit and copy its JSON
over the source.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from inference.decoding.files import write_atomic
from inference.measure.provenance import UNCOMMITTED
from inference.measure.report import format_markdown

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
HEADER = """# Results on the toy world

Rendered by `python -m inference.results` from the JSON in `docs/results/` (the section list is
`docs/results/page.json`); do not edit by hand. Each table stands under the command that made it, with
the date, the machine and the commit it ran at. Settings were chosen on the tune captions (seed 11);
the decoding tables report on captions of seed 2026, which chose nothing.
"""


OUTPUT_FILES = {
    "inference.decoding_table": "table.json",
    "inference.signals": "signals.json",
    "inference.convergence_region": "convergence_region.json",
}
"""The JSON a folder-writing command leaves in its --out folder (`inference.bench --out` names the file itself)."""
MOVED_COMMANDS = {"training.convergence_region": "inference.convergence_region"}
"""`python -m` modules a recorded command names that run under another name now: a source keeps the command it
was made with, and its regeneration names the one to run."""


def source_files(results: Path = RESULTS) -> list[str]:
    """Every JSON file `results/page.json` names, in page order, each once."""
    sections = json.loads((results / "page.json").read_text(encoding="utf-8"))
    names: list[str] = []
    for section in sections:
        for name in [s["file"] for s in section.get("sources", [])] or [section["file"]]:
            if name not in names:
                names.append(name)
    return names


def regeneration(payload: dict[str, Any], name: str) -> str:
    """How to remake the source `name` from its own command: the command, then the copy onto the source."""
    command = [str(part) for part in payload["command"]]
    out = command[command.index("--out") + 1] if "--out" in command else None
    module = command[2] if command[:2] == ["python", "-m"] and len(command) > 2 else ""
    if module in MOVED_COMMANDS:
        module = command[2] = MOVED_COMMANDS[module]
    made = None if out is None else (f"{out}/{OUTPUT_FILES[module]}" if module in OUTPUT_FILES else out)
    copy = f" && cp {made} docs/results/{name}" if made else f" (then copy its JSON to docs/results/{name})"
    return " ".join(command) + copy


def uncommitted_sources(results: Path = RESULTS) -> list[str]:
    """One line per source stamped with uncommitted changes: the file, its stamp and the command that remakes it."""
    problems = []
    for name in source_files(results):
        payload = _load(results, name)
        commit = str((payload.get("provenance") or {}).get("commit", ""))
        if commit.endswith(UNCOMMITTED):
            where = results / name
            shown = where.relative_to(ROOT) if where.resolve().is_relative_to(ROOT) else where
            problems.append(
                f"{shown}: made at commit {commit}, from uncommitted changes, so its figures cannot be "
                f"reproduced; regenerate it at a clean commit: {regeneration(payload, name)}"
            )
    return problems


def provenance_line(payload: dict[str, Any]) -> str:
    """'2026-12-07, 2 CPU cores, no GPU, commit 7a13149': where a figure was made (its JSON's provenance)."""
    record = payload.get("provenance")
    if not record:
        raise ValueError("a results source needs its provenance (date, machine, commit); rerun its command")
    return f"{record['date']}, {record['machine']}, torch {record['torch']}, commit {record['commit']}."


def _shared_provenance(payloads: list[dict[str, Any]], files: list[str]) -> str:
    """One provenance line for a table whose rows come from several runs: the commit only when they share one
    (a table names at most one commit); otherwise each row's stays in its JSON."""
    for payload, name in zip(payloads, files, strict=True):
        if not payload.get("provenance"):
            raise ValueError(f"{name}: a results source needs its provenance (date, machine, commit); rerun it")
    lines = {provenance_line(p) for p in payloads}
    if len(lines) == 1:
        return lines.pop()
    records = [p["provenance"] for p in payloads]
    where = sorted({f"{r['date']}, {r['machine']}, torch {r['torch']}" for r in records})
    return "; ".join(where) + f". The rows ran at different commits, each in its JSON ({', '.join(files)})."


def _command_block(*commands: list[str]) -> list[str]:
    return ["```bash", *(" ".join(command) for command in commands), "```", ""]


def render_decoding_table(payload: dict[str, Any]) -> list[str]:
    """One table per tree of a decoding-table run, each under the run's command."""
    lines = []
    for summary in payload["trees"]:
        kind = summary["tree"]["tree"]
        records = [r for r in payload["records"] if r["tree"] == kind]
        table = format_markdown(records, payload["command"], summary).splitlines()
        lines += [f"### Tree {kind}", "", *table[:5], provenance_line(payload), *table[5:], ""]
    return lines


def render_bench(payload: dict[str, Any]) -> list[str]:
    """One `inference.bench` run as a table under its command, with each rule's TV budget spent per step."""
    table = format_markdown(payload["records"], payload["command"], payload).splitlines()
    spent = ", ".join(f"{r['label']} {r['tv_charged_per_step']:.3f}" for r in payload["records"] if r["rule"] != "ar")
    return [*table[:5], provenance_line(payload), *table[5:], "", f"TV budget spent per step: {spent}.", ""]


def _by_rule(payload: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """The first record of each series on tree `kind` (the grid's default setting of each rule)."""
    found: dict[str, dict[str, Any]] = {}
    for record in payload["records"]:
        if record["tree"] == kind:
            found.setdefault(record["series"].split(" (")[0], record)
    return found


def render_drafters(
    sources: list[dict[str, Any]], payloads: list[dict[str, Any]], rules: list[str], row_header: str = "drafter"
) -> list[str]:
    """A row per drafter (or tree: each row reads its run's first tree): tau and quality of each rule in `rules`
    (the first is the reference); arm means after."""
    first, other = rules[0], rules[1:]
    lines = _command_block(*(p["command"] for p in payloads))
    lines += [_shared_provenance(payloads, [source["file"] for source in sources]), ""]
    header = [row_header, f"τ {first}", *(f"τ {rule} (x {first})" for rule in other), "speedup vs AR " +
              " / ".join(rules), "prompt fidelity " + " / ".join(rules), "FID-style " + " / ".join(rules)]  # fmt: skip
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    taus: dict[str, dict[str, list[float]]] = {}
    for source, payload in zip(sources, payloads, strict=True):
        kind = payload["trees"][0]["tree"]["tree"]
        rows = _by_rule(payload, kind)
        missing = [rule for rule in rules if rule not in rows]
        if missing:
            raise ValueError(f"{source['file']}: no {', '.join(missing)} row on tree {kind}")
        base = rows[first]["tau"]
        cells = [source["label"], f"{base:.2f}"]
        cells += [f"{rows[rule]['tau']:.2f} ({rows[rule]['tau'] / base:.3f})" for rule in other]
        cells.append(" / ".join(f"{rows[rule]['speedup_vs_ar']:.2f}x" for rule in rules))
        cells.append(" / ".join(f"{rows[rule]['fidelity']:.3f}" for rule in rules))
        cells.append(" / ".join(f"{rows[rule]['fid_vs_ar']:.1f}" for rule in rules))
        lines.append("| " + " | ".join(cells) + " |")
        if "arm" in source:
            arm_taus = taus.setdefault(source["arm"], {rule: [] for rule in rules})
            for rule in rules:
                arm_taus[rule].append(rows[rule]["tau"])
    lines.append("")
    for arm, values in taus.items():  # each arm's mean over its seeds, and their spread (max - min)
        figures = "; ".join(f"τ {rule} mean {statistics.fmean(v):.3f}, seed spread {max(v) - min(v):.3f}"
                            for rule, v in values.items())  # fmt: skip
        lines.append(f"- arm {arm} ({len(values[first])} seeds, rows above): {figures}")
    lines += [""] if taus else []
    return lines


def render_signals(payload: dict[str, Any]) -> list[str]:
    """The AUC table of a signal study, one per tree kind, each under the study's command."""
    from inference.measure.signals import format_table

    settings = payload["settings"]
    kept = settings.get("trees_per_image")
    trees = f"{kept} verified trees per image, evenly spaced" if kept else "every verified tree"
    about = [f"{settings['prompts']} captions, {trees}, pixel threshold {settings['pixel_threshold']} grey levels. "
             + provenance_line(payload), ""]  # fmt: skip
    lines: list[str] = []
    for block in format_table(payload["records"]).split("### Tree ")[1:]:  # "kind\n\n| table |..."
        kind, table = block.split("\n", 1)
        lines += [f"### Tree {kind}", "", *_command_block(payload["command"]), *about, *table.strip().splitlines(), ""]
    return lines


def render_op_count(payload: dict[str, Any]) -> list[str]:
    """Ops and host syncs per speculative step, by tree and phase, under the bench command."""
    from inference.measure.cost import format_op_table

    return [*_command_block(payload["command"]), provenance_line(payload), "", "```text",
            format_op_table(payload["rows"]), "```", ""]  # fmt: skip


def render_table(payload: dict[str, Any]) -> list[str]:
    """A JSON that carries its own Markdown table, under its command."""
    if "table" not in payload:
        raise ValueError("a `table` section's JSON needs a 'table' field (Markdown)")
    return [
        *_command_block(payload["command"]),
        provenance_line(payload),
        "",
        *payload["table"].strip().splitlines(),
        "",
    ]


def render_page(results: Path = RESULTS, allow_uncommitted: bool = False) -> str:
    """The whole page from `results/page.json` and the JSON files it names. A source stamped with uncommitted
    changes is refused (`uncommitted_sources`) unless allow_uncommitted (a draft while the sources are remade)."""
    if not allow_uncommitted:
        stale = uncommitted_sources(results)
        if stale:
            raise ValueError("the results page takes figures made at a commit only:\n" + "\n".join(stale))
    sections = json.loads((results / "page.json").read_text(encoding="utf-8"))
    lines = [HEADER]
    for section in sections:
        lines += [f"## {section['title']}", ""]
        if section.get("note"):
            lines += [section["note"], ""]
        kind = section["kind"]
        if kind == "drafters":
            payloads = [_load(results, source["file"]) for source in section["sources"]]
            rules = section.get("rules", ["exact", "cascade"])
            lines += render_drafters(section["sources"], payloads, rules, section.get("row_header", "drafter"))
            continue
        payload = _load(results, section["file"])
        if kind == "decoding_table":
            lines += render_decoding_table(payload)
        elif kind == "bench":
            lines += render_bench(payload)
        elif kind == "signals":
            lines += render_signals(payload)
        elif kind == "op_count":
            lines += render_op_count(payload)
        elif kind == "table":
            lines += render_table(payload)
        else:
            raise ValueError(f"{results / 'page.json'}: section {section['title']!r} has unknown kind {kind!r}")
        if section.get("image"):
            lines += [f"![{section['title']}]({section['image']})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _load(results: Path, name: str) -> dict[str, Any]:
    path = results / name
    try:
        payload: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable results JSON ({error}); copy the command's output there") from None
    if "command" not in payload:
        raise ValueError(f"{path}: no 'command' field: every figure names the command that made it")
    return payload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder with page.json and the JSON sources")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (default docs/results.md)")
    parser.add_argument(
        "--check", action="store_true",
        help="only check: exit 1 when a source was made from uncommitted changes (each named with the command that "
        "regenerates it) or the page differs from what its sources render",
    )  # fmt: skip
    parser.add_argument(
        "--allow-uncommitted", action="store_true",
        help="render sources stamped <commit>+changes anyway (a draft page while they are being remade)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        stale = uncommitted_sources(args.results)
        page = render_page(args.results, allow_uncommitted=True)
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        problems = list(stale)
        if current != page:
            problems.append(f"{args.out} is stale: rerun python -m inference.results (sources: {args.results})")
        if problems:
            raise SystemExit("\n".join(problems))
        print(f"{args.out} is up to date and every source names the commit it was made at")
        return
    try:
        page = render_page(args.results, allow_uncommitted=args.allow_uncommitted)
    except ValueError as error:
        raise SystemExit(f"{error}\n(or pass --allow-uncommitted for a draft page)") from None
    write_atomic(args.out, page)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
