"""What a bench run decodes: methods (AR, or a rule with settings and a label), `--rule-arg` parsing,
and the sweep grids of rule settings (`SWEEP_GRID`, or a JSON file of {series, rule, options}).

    methods = parse_methods("ar,exact,cascade@wide", ["cascade@wide.tau_seq=0"])
    methods = sweep_methods(load_grid(Path("configs/decoding_table.json")), parse_methods("ar", None))
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inference.decoding.generate import RULE_CLASSES
from inference.decoding.peer_rules import LANTERN_PP_K, LANTERN_PP_LAM, LANTERN_PP_REPO_RUNS

SweepPoint = tuple[str, str, dict[str, object]]  # (series, rule, options)


def _series(series: str, rule: str, *options: Mapping[str, object]) -> list[SweepPoint]:
    return [(series, rule, dict(o)) for o in options]


SWEEP_GRID: list[SweepPoint] = [
    *_series("exact", "exact", {}),
    *_series("cascade", "cascade", *({"delta": d} for d in (0.1, 0.25, 0.5, 1.0))),
    *_series(
        "cascade tau 0.5/0.3", "cascade", *({"delta": d, "tau_pos": 0.5, "tau_seq": 0.3} for d in (0.25, 0.5, 1.0))
    ),
    *_series("cascade+beyond", "cascade", *({"delta": d, "pool_beyond_tree": True} for d in (0.1, 0.25, 0.5))),
    *_series(
        "cascade+beyond conf_gate=0.8",
        "cascade",
        *({"delta": d, "conf_gate": 0.8, "pool_beyond_tree": True} for d in (0.25, 0.5, 1.0)),
    ),
    *_series("lantern", "lantern", *({"delta": d} for d in (0.05, 0.1, 0.2, 0.4))),
    *_series("lantern reject=pooled", "lantern", *({"delta": d, "reject_zeroes": "pooled"} for d in (0.1, 0.4))),
    # LANTERN++: the CASCADE authors' baseline, then the LANTERN repository's runs (`inference.decoding.peer_rules`)
    *_series(
        "lantern++",
        "lantern++",
        *({"lam": lam, "k": k} for k, lam in ((LANTERN_PP_K, LANTERN_PP_LAM), *LANTERN_PP_REPO_RUNS)),
    ),
    *_series("gsd-blocks", "gsd-blocks", *({"group": g} for g in (2, 3, 5, 25))),
    *_series("gsd", "gsd", *({"p_threshold": t} for t in (0.05, 0.15))),
]


@dataclass(frozen=True)
class Method:
    """One row of the table: AR or a rule with settings."""

    label: str  # "ar", "cascade", "cascade@wide", or a sweep point's name
    rule: str  # "ar" or a key of RULE_CLASSES
    options: dict[str, object] = field(default_factory=dict)
    series: str = ""  # sweep: the plot series


def parse_methods(rules: str, rule_args: Sequence[str] | None) -> list[Method]:
    """Methods from "ar,exact,cascade@wide" and ["cascade.delta=0.3", "cascade@wide.tau_seq=0"]."""
    labels = [item.strip() for item in rules.split(",") if item.strip()]
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"--rules needs distinct comma-separated names, got {rules!r}")
    general: dict[str, dict[str, str]] = {}
    specific: dict[str, dict[str, str]] = {}
    for item in rule_args or []:
        key, sep, value = item.partition("=")
        scope, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ValueError(f"rule argument {item!r} is not RULE.NAME=VALUE (e.g. cascade.delta=0.3)")
        (specific if "@" in scope else general).setdefault(scope, {})[name] = value.strip()
    methods = []
    for label in labels:
        rule = label.partition("@")[0]
        if rule != "ar" and rule not in RULE_CLASSES:
            raise ValueError(f"unknown rule {rule!r} in --rules; known: ar, {', '.join(RULE_CLASSES)}")
        options = {**general.get(rule, {}), **specific.get(label, {})}
        if rule == "ar" and options:
            raise ValueError("ar takes no rule arguments")
        methods.append(Method(label, rule, dict(options)))
    unused = (set(general) - {m.rule for m in methods}) | (set(specific) - {m.label for m in methods})
    if unused:
        raise ValueError(f"--rule-arg names rules not in --rules: {', '.join(sorted(unused))}")
    return methods


def sweep_methods(grid: Sequence[SweepPoint], base: Sequence[Method]) -> list[Method]:
    """AR plus one method per grid point; `base` options (from --rule-arg) apply under each point's own."""
    base_options = {m.rule: m.options for m in base}
    methods = [Method("ar", "ar", series="ar")]
    for series, rule, options in grid:
        merged = {**base_options.get(rule, {}), **options}
        knobs = ",".join(f"{k}={v}" for k, v in options.items())
        methods.append(Method(f"{series}[{knobs}]" if knobs else series, rule, merged, series))
    return methods


def load_grid(path: Path) -> list[SweepPoint]:
    """A sweep grid from JSON: [{"series": ..., "rule": ..., "options": {...}}, ...]."""
    entries = json.loads(path.read_text())
    return [(e.get("series", e["rule"]), e["rule"], dict(e.get("options", {}))) for e in entries]
