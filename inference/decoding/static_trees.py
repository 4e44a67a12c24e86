"""Static draft trees as lists of child-index paths: the shipped lists, loading one from JSON, and the check
that a list is a tree of draws (`check_static_paths`). `inference.decoding.tree.StaticTreeSpec` builds them.

A path [c1, c2, ...] is the c2-th child of the c1-th child of the root; a c-th child receives its
parent's c-th draw from the drafter distribution, so it needs its parent and its earlier siblings.
"""

from __future__ import annotations

import json

# LANTERN's default static tree (jadohu/LANTERN models/drafters/choices.py; docs/method.md, section "Drafting a tree"):
# 57 draft nodes, depth 5, level sizes 5/13/16/14/9. A path [c1, c2, ...] is the c2-th child of the c1-th child.
NAIVE_EXTEND_57: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (4,),
    (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1),
    (0, 2, 2), (0, 3, 0), (0, 3, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 1, 2),
    (0, 0, 2, 0), (0, 0, 2, 1), (0, 0, 3, 0), (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 1, 0), (0, 2, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 1, 1), (0, 0, 1, 0, 0),
    (0, 0, 1, 0, 1), (0, 0, 1, 1, 0), (0, 0, 2, 0, 0),
)  # fmt: skip
# EAGLE's smaller 25-node tree (depth 5), also tried in LANTERN.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip
# The toy target's default: 8 drafts, depth 7, fitted to the demo drafter by `python -m inference.tree_fit
# --target toy --drafter runs/demo/version_0/drafter --num-prompts 256 --prompt-seed 11` (its "drafts8") and
# picked on the same tune captions as the fastest of the fitted trees on this project's 2-core CPU, with the
# 6-draft chain (docs/decoding.md, "Fitting the static tree"): a chain of first draws and the root's second draw.
TOY_DEMO_FIT_8: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0),
)  # fmt: skip
STATIC_TREES = {"naive_extend_57": NAIVE_EXTEND_57, "mc_sim_7b_63": MC_SIM_7B_63, "toy_demo_fit_8": TOY_DEMO_FIT_8}


def load_static_tree(source: str) -> tuple[tuple[int, ...], ...]:
    """A static list's child-index paths: a name in `STATIC_TREES`, or a JSON file whose "paths" field holds
    them (what `python -m inference.tree_fit --out` writes: {"paths": [[0], [1], [0, 0], ...], ...})."""
    if source in STATIC_TREES:
        return STATIC_TREES[source]
    if not source.endswith(".json"):
        raise ValueError(f"static tree {source!r} is neither a known list ({', '.join(STATIC_TREES)}) nor a .json file")
    try:
        with open(source, encoding="utf-8") as file:
            record = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"static tree file {source}: {error}; write one with python -m inference.tree_fit") from None
    paths = record.get("paths") if isinstance(record, dict) else None
    if not isinstance(paths, list) or not all(
        isinstance(path, list) and path and all(isinstance(c, int) and c >= 0 for c in path) for path in paths
    ):
        raise ValueError(
            f"static tree file {source}: field 'paths' must be a list of non-empty lists of child indices >= 0, "
            f"e.g. [[0], [1], [0, 0]]; got {str(paths)[:80]}"
        )
    loaded = tuple(tuple(path) for path in paths)
    check_static_paths(loaded, f"static tree file {source}, field 'paths'")
    return loaded


def check_static_paths(paths: tuple[tuple[int, ...], ...], where: str = "static tree") -> None:
    """Refuse a static list that is not a tree of draws: every path needs its parent path and, for a c-th
    child (c > 0), its earlier sibling (..., c - 1).

    Why the sibling: node (..., c) receives its parent's (c + 1)-th draw without replacement, but verification
    tests a child against q with only the *listed* earlier siblings removed
    (`inference.decoding.verify.draw_probabilities`, recursive rejection sampling; docs/method.md, section "Tree
    verification"). With a hole the draw before it was taken from q and never tested, so even `exact` is lossy: V = 3, p
    uniform, q = (0.6, 0.3, 0.1) and the list ((0,), (2,)) emit (0.333, 0.311, 0.356), TV 0.022.

    Args:
        paths: child-index paths, e.g. ((0,), (1,), (0, 0)).
        where: what the error names first: the list's name, or its file and field.
    Raises:
        ValueError: naming the offending path, the missing one and how to fix the list.
    """
    given = set(paths)
    if len(given) != len(paths):
        repeated = sorted({path for path in paths if paths.count(path) > 1})
        raise ValueError(f"{where}: tree paths must be distinct; {repeated} appear more than once")
    for path in sorted(paths, key=lambda path: (len(path), path)):
        if not path or min(path) < 0:
            raise ValueError(f"{where}: tree path {path} is empty or negative; child indices are >= 0, e.g. (0, 1)")
        parent = path[:-1]
        if parent and parent not in given:
            raise ValueError(f"{where}: tree path {path} lacks its parent path {parent}: add {parent} or remove {path}")
        sibling = parent + (path[-1] - 1,)
        if path[-1] > 0 and sibling not in given:
            listed = sum(parent + (c,) in given for c in range(path[-1]))  # earlier siblings that are in the list
            raise ValueError(
                f"{where}: tree path {path} has a hole: its earlier sibling {sibling} is missing, so it would take "
                f"its parent's draw {path[-1] + 1} while verification tests it as draw {listed + 1} (lossy even "
                f"under exact). Add {sibling}, or renumber the children of {parent or 'the root'} 0, 1, 2, ... "
                "in draw order"
            )
