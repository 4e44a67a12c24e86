"""Every `.md` file the code, configs, tests and docs cite is in the repository, and so is every section they cite.

A citation of a note that lives outside the repository is a dead end for a reader who has only the repository:
the project says it in its own docs (docs/method.md, docs/architecture.md, ...) and cites those. The scan reads
every *.py, *.yaml and *.md file (not .venv, .git, runs, outputs) and takes each `name.md` it mentions: it must
resolve next to the citing file, at the repository root or in docs/, unless it is a file a command writes
(`WRITTEN_NAMES`). A citation `docs/x.md, section "Name"` must name a heading of that file, and a Markdown link
`[text](path)` in a doc (no URL, no bare #anchor) must point at a file that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".venv", ".git", "runs", "outputs", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
SUFFIXES = {".py", ".yaml", ".md"}
MD_NAME = re.compile(r"[\w./-]+\.md\b")
SECTION = re.compile(r"(docs/[\w./-]+\.md), sections? ((?:\"[^\"]+\"(?:,? (?:and )?)?)+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

WRITTEN_NAMES = {
    "table.md": "the Markdown table the benchmark commands write into their --out folder",
    "TABLE.md": "python -m inference.evaluate --table TABLE: the table of the runs",
    "OUT.md": "python -m inference.evaluate's table command: --out OUT writes OUT.md and OUT.json",
    "PREFIX.md": "inference.evaluation.eval_table.write_table(rows, PREFIX)",
    "eval/table.md": "the example path in inference.evaluation.eval_table's usage",
    "eval/llamagen.md": "the evaluation table docs/evaluation.md's commands write",
    "outputs/eval/toy_table.md": "the toy evaluation's table, written under outputs/",
}
"""Names that are outputs of a command, not citations: each with where it comes from."""


def scanned_files(root: Path = ROOT) -> list[Path]:
    """Every *.py, *.yaml and *.md file under root outside SKIPPED_DIRS, except this checker (its planted names)."""
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part in SKIPPED_DIRS for part in relative.parts[:-1]) or path.resolve() == Path(__file__).resolve():
            continue
        if path.is_file() and path.suffix in SUFFIXES:
            found.append(path)
    return found


def resolves(name: str, citing: Path, root: Path, held: set[str]) -> bool:
    """The cited name exists next to the citing file, from the repository root or in docs/, or it is the end of the
    path of a file the repository holds (a test naming `NOTICE.md` of `data/prompts/`)."""
    if any((base / name).is_file() for base in (citing.parent, root, root / "docs")):
        return True
    return any(path == name or path.endswith("/" + name) for path in held)


def dead_citations(root: Path = ROOT) -> list[str]:
    """'path:line: name' for every `.md` a scanned file cites that the repository does not hold."""
    problems = []
    files = scanned_files(root)
    held = {path.relative_to(root).as_posix() for path in files if path.suffix == ".md"}
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in MD_NAME.finditer(line):
                name = match.group(0).removeprefix("./")
                if name in WRITTEN_NAMES or resolves(name, path, root, held):
                    continue
                problems.append(f"{path.relative_to(root)}:{number}: {name}")
    return problems


def headings(doc: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def dead_sections(root: Path = ROOT) -> list[str]:
    """'path: docs/x.md "Name"' for every cited section that is not a heading of its file. A citation may run over
    a line break (a comment's `#`, a docstring's indent): the text is read with those joined."""
    problems = []
    for path in scanned_files(root):
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))
        for match in SECTION.finditer(text):
            doc = root / match.group(1)
            if not doc.is_file():
                continue  # dead_citations reports the file
            for name in re.findall(r"\"([^\"]+)\"", match.group(2)):
                if name not in headings(doc):
                    problems.append(f'{path.relative_to(root)}: {match.group(1)} has no section "{name}"')
    return problems


def dead_links(root: Path = ROOT) -> list[str]:
    """'doc:line: target' for every relative Markdown link of a doc whose file does not exist (anchors dropped)."""
    problems = []
    for path in scanned_files(root):
        if path.suffix != ".md":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                file = target.split("#", 1)[0]
                if not file or re.match(r"^[a-z]+:", file):
                    continue  # a bare #anchor, or a URL
                if not (path.parent / file).exists():
                    problems.append(f"{path.relative_to(root)}:{number}: {target}")
    return problems


def test_every_cited_md_file_is_in_the_repository():
    assert dead_citations() == []


def test_every_cited_section_is_a_heading_of_its_doc():
    assert dead_sections() == []


def test_every_relative_link_of_the_docs_resolves():
    assert dead_links() == []


def test_the_checks_catch_a_planted_dead_citation_section_and_link(tmp_path):
    # the planted names are built here, so that the repository itself never cites a note it does not hold
    rules_note, peers_note, design_note = (f"{stem}.md" for stem in ("cascade", "peers", "design"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "method.md").write_text("# Method\n\n## Tree verification\n\nSee [missing](gone.md).\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "rules.py").write_text(
        f'"""Rules ({rules_note} §4; docs/method.md, section "Tree verification").\n\n'
        'Budget: docs/method.md, section "The\nbudget".\n"""\n'
    )
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.md").write_text(f"{peers_note} is cited here, but runs/ is not scanned\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text(f"# recipe: {design_note}; output: table.md; docs: method.md\n")
    assert dead_citations(tmp_path) == [f"configs/a.yaml:1: {design_note}", "docs/method.md:5: gone.md",
                                        f"pkg/rules.py:1: {rules_note}"]  # fmt: skip
    assert dead_sections(tmp_path) == ['pkg/rules.py: docs/method.md has no section "The budget"']
    assert dead_links(tmp_path) == ["docs/method.md:5: gone.md"]
