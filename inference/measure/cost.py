"""What a speculative step costs in operations and host syncs, phase by phase (`OpCounter`).

On a GPU every eager aten op is a kernel launch (about 5-10 us) and every host read of a device value
a stall; on this CPU neither shows in milliseconds. `OpCounter` is a `DecodeHooks` that runs the
decoder under a `TorchDispatchMode` and counts, per phase of the decode loop (draft, target, view,
verify, commit), the aten ops dispatched and the host syncs among them: `_local_scalar_dense` (what
`.item()`, `int()`, `bool()` and `if tensor:` dispatch), `nonzero` / `masked_select` / `unique`
(their output size is read from the device) and device-to-host copies. It also counts the tensor
views among the ops (reshapes, slices, transposes: no kernel launch, no memory traffic), so the
table can give the ratio both ways.

    counter = OpCounter()
    generate_speculative(target, drafter, prompts, rule, config, generator=g, hooks=counter)
    counter.per_step()  # {"draft": (ops, syncs), ...} averaged over verification steps
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inference.decoding.compiled import decodes_under_no_grad
from inference.decoding.drafter import Drafter
from inference.decoding.rules import Rule
from inference.decoding.speculative import TREE_KINDS, DecodeHooks, DecoderConfig, generate_speculative
from inference.decoding.tree import Tree
from inference.decoding.verify import TargetView, Verdict
from models.target import ImageTarget, SamplingDefaults

PHASES = ("draft", "target", "view", "verify", "commit")
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "item"}


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counter._count(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class OpCounter(DecodeHooks):
    """Counts aten ops and host syncs per decode phase while installed as the decoder's hooks."""

    def __init__(self) -> None:
        self.ops = dict.fromkeys(PHASES, 0)
        self.views = dict.fromkeys(PHASES, 0)  # among the ops: tensor views (reshapes, slices): no kernel launch
        self.syncs = dict.fromkeys(PHASES, 0)
        self.steps = 0
        self._phase: str | None = None

    def _count(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._phase is None:
            return
        name = func.__name__.split(".")[0]
        self.ops[self._phase] += 1
        self.views[self._phase] += bool(getattr(func, "is_view", False)) or name == "_unsafe_view"  # reshape's
        to_host = name in ("_to_copy", "copy_") and _device_to_host(name, args, kwargs)
        if name in SYNC_OPS or to_host:
            self.syncs[self._phase] += 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase = name
        try:
            with _Dispatch(self):
                yield
        finally:
            self._phase = None

    def on_verify(self, tree: Tree, view: TargetView, verdict: Verdict) -> None:
        self.steps += 1

    def per_step(self) -> dict[str, tuple[float, float]]:
        """(aten ops, host syncs) per verification step, by phase."""
        steps = max(self.steps, 1)
        return {p: (self.ops[p] / steps, self.syncs[p] / steps) for p in PHASES}

    def views_per_step(self) -> dict[str, float]:
        """Tensor-view ops (no kernel, no memory traffic) per verification step, by phase."""
        return {p: self.views[p] / max(self.steps, 1) for p in PHASES}


def _device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a copy moves data from an accelerator to the host."""
    source = args[0] if name == "_to_copy" else (args[1] if len(args) > 1 else None)
    if not isinstance(source, torch.Tensor) or source.device.type == "cpu":
        return False
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"
    return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"


def count_decode_ops(
    target: ImageTarget,
    drafter: Drafter,
    rules: dict[str, Rule],
    trees: dict[str, DecoderConfig],
    prompts: list[str],
    settings: SamplingDefaults | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Decode `prompts` (one at a time) with every rule on every tree under an `OpCounter`.

    The decodes run under no_grad, not inference mode (`inference.decoding.compiled.decodes_under_no_grad`), so that
    the count sees the ops composite ops are made of. Each tree first decodes the first prompt once,
    uncounted: work done once per process (a static tree's index tables and masks, the drafter's fused
    weights) is not a cost of every step, and would otherwise land on whichever rule is counted first.

    Returns one row per (tree, rule): aten ops and host syncs per verification step by phase, and the
    drafting + verification + commit ops against the target forward's.
    """
    with decodes_under_no_grad():
        rows = []
        for tree_name, config in trees.items():
            warm_rule = next(iter(rules.values()))
            generator = torch.Generator(device=target.device).manual_seed(seed)
            generate_speculative(target, drafter, prompts[:1], warm_rule, config, settings, generator)
            for label, rule in rules.items():
                counter = OpCounter()
                for i, prompt in enumerate(prompts):
                    generator = torch.Generator(device=target.device).manual_seed(seed + i)
                    generate_speculative(target, drafter, [prompt], rule, config, settings, generator, hooks=counter)
                per_step, views = counter.per_step(), counter.views_per_step()
                overhead_phases = ("draft", "view", "verify", "commit")
                overhead = sum(per_step[p][0] for p in overhead_phases)
                computing = overhead - sum(views[p] for p in overhead_phases)
                rows.append(
                    {
                        "tree": tree_name,
                        "rule": label,
                        "steps": counter.steps,
                        "ops": {p: per_step[p][0] for p in PHASES},
                        "tensor_view_ops": views,
                        "syncs": {p: per_step[p][1] for p in PHASES},
                        "syncs_per_step": sum(per_step[p][1] for p in PHASES),
                        "overhead_ops_per_target_op": overhead / max(per_step["target"][0], 1.0),
                        "overhead_non_view_ops_per_target": computing
                        / max(per_step["target"][0] - views["target"], 1.0),
                    }
                )
        return rows


def format_op_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `count_decode_ops` as a text table, ops and syncs per verification step."""
    header = f"{'tree':<16} {'rule':<14} " + " ".join(f"{p + ' ops':>11}" for p in PHASES)
    header += f" {'syncs/step':>10} {'overhead/target':>15} {'no views':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        ops = " ".join(f"{r['ops'][p]:>11.0f}" for p in PHASES)
        ratio, computing = r["overhead_ops_per_target_op"], r["overhead_non_view_ops_per_target"]
        lines.append(
            f"{r['tree']:<16} {r['rule']:<14} {ops} {r['syncs_per_step']:>10.2f} {ratio:>15.2f} {computing:>8.2f}"
        )
    lines.append(
        "aten ops and host syncs (_local_scalar_dense, nonzero, device-to-host copies) per verification step, eager; "
        "overhead = draft + view + verify + commit ops over the target forward's; no views: the same ratio without "
        "tensor views (reshapes, slices: no kernel launch)"
    )
    return "\n".join(lines)


def run_count_ops(args: argparse.Namespace, target: ImageTarget, drafter: Any, methods: list[Any],
              rules: dict[str, Rule | None], prompts: list[str], settings: SamplingDefaults,
              config: DecoderConfig) -> list[dict[str, Any]]:  # fmt: skip
    """`inference.bench --count-ops`: aten ops and host syncs per speculative step, per phase, for every rule
    (`methods`, bench's parsed methods, and their built `rules`) x tree kind (or only `--tree`)."""
    from inference.decoding.files import write_json
    from inference.measure.provenance import provenance

    if drafter is None:
        raise SystemExit("--count-ops needs --drafter")
    speculative_rules = {m.label: rule for m in methods if (rule := rules[m.label]) is not None}
    trees = {kind: dataclasses.replace(config, tree=kind) for kind in (args.tree,) if kind} or {
        kind: dataclasses.replace(config, tree=kind) for kind in TREE_KINDS
    }
    rows = count_decode_ops(target, drafter, speculative_rules, trees, prompts, settings, args.seed)
    print(format_op_table(rows))
    if args.out:
        command = ["python", "-m", "inference.bench", *sys.argv[1:]]
        write_json({"command": command, "provenance": provenance(), "rows": rows}, args.out)
        print(f"wrote {args.out}")
    return rows
