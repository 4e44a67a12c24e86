"""Where a training run writes, decided before anything is written: a new run never lands on a user's run.

The run folder is the logger's `log_dir`: `<save_dir>/<name>/version_<N>` when the logger's version is
null (the configs' default: each run takes the next free N, as TensorBoard's logger does), or
`<save_dir>/<name>/<version>` for an explicit version ("" = `<save_dir>/<name>` itself). Checkpoints
go to `<run folder>/checkpoints`, the exported drafter to `<run folder>/drafter`.

    fresh run, version null       -> the next version_N (nothing existing is touched)
    fresh run, explicit version   -> that folder if it holds no run, else an error naming the folder
                                     and what it holds (unless --overwrite true, which clears it first)
    --ckpt_path last              -> the newest `checkpoints/last.ckpt` among the run folders the
                                     logger's settings allow; the run continues in that folder; none
                                     is an error naming where it looked (never a silent fresh start)
    --ckpt_path PATH              -> PATH must exist; a `last.ckpt` inside `<name>/version_<N>/checkpoints`
                                     continues in version_<N>; any other checkpoint (a best-by-metric one,
                                     another logger's) starts the next version_N, so no run's newer
                                     last.ckpt is overwritten

The decision reads the file system only, so every rank of a DDP job reaches the same one before the
first rendezvous; only rank 0 clears a folder for `--overwrite`, and only once the run is built
(a config error leaves the old run in place).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

LAST_CHECKPOINT = "last.ckpt"
RUN_ENTRIES = ("checkpoints", "drafter", "config.yaml", "hparams.yaml")
"""What a run leaves in its folder, besides TensorBoard event files."""
_VERSION = re.compile(r"version_(\d+)")


class RunFolderError(ValueError):
    """The run folder holds another run, or the checkpoint to resume is missing; the message says what to do."""


@dataclass(frozen=True)
class RunPlan:
    """The resolved logger version and checkpoint of a run."""

    version: int | str | None  # the logger's version: None = next free version_N, int = version_N, str = that folder
    ckpt_path: str | None  # the checkpoint file (or DeepSpeed folder) to resume, never "last"
    folder: Path | None  # the run folder when it is known before the logger picks one
    to_clear: list[str]  # entries `clear_run` removes (--overwrite), once the run is built


def run_entries(folder: Path) -> list[str]:
    """Names of what a training run left in `folder` (checkpoints, drafter, config, event files)."""
    if not folder.is_dir():
        return []
    found = [name for name in RUN_ENTRIES if (folder / name).exists()]
    found += sorted(path.name for path in folder.glob("events.out.tfevents.*"))
    return found


def version_folder(root: Path, version: int | str) -> Path:
    """The logger's folder for `version` under `root` = save_dir/name (TensorBoardLogger's naming)."""
    return root / (f"version_{version}" if isinstance(version, int) else version)


def _versions(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _VERSION.fullmatch(p.name)))


def _last_checkpoint(folder: Path) -> Path | None:
    path = folder / "checkpoints" / LAST_CHECKPOINT
    return path if path.exists() else None


def plan_run(root: str | Path, version: int | str | None, ckpt_path: str | None, overwrite: bool = False) -> RunPlan:
    """Resolve the run folder and checkpoint for a logger rooted at `root` (= save_dir/name); see the module doc."""
    root = Path(root)
    if ckpt_path == "last":
        return _plan_resume_last(root, version)
    if ckpt_path is not None:
        path = Path(ckpt_path)
        if not path.exists():
            raise RunFolderError(f"--ckpt_path {ckpt_path}: no such checkpoint file or folder")
        resolved = path.resolve()
        in_this_logger = resolved.parent.name == "checkpoints" and resolved.parent.parent.parent == root.resolve()
        if version is None and in_this_logger and resolved.name == LAST_CHECKPOINT:
            match = _VERSION.fullmatch(resolved.parent.parent.name)
            if match:  # resuming one of this logger's runs from its last.ckpt: continue in its folder
                version = int(match.group(1))
        folder = None if version is None else version_folder(root, version)
        return RunPlan(version, str(path), folder, [])
    if version is None:
        return RunPlan(None, None, None, [])
    folder = version_folder(root, version)
    entries = run_entries(folder)
    if entries and not overwrite:
        raise RunFolderError(
            f"{folder} already holds a run ({', '.join(entries)}); nothing was changed. Resume it with "
            "--ckpt_path last, give this run its own folder with --trainer.logger.init_args.version null "
            "(the next version_N) or another version, or replace it with --overwrite true"
        )
    return RunPlan(version, None, folder, entries if overwrite else [])


def clear_run(plan: RunPlan) -> None:
    """Remove what `plan` lists from its folder (--overwrite); call on one rank, after the run is built."""
    if plan.folder is None:
        return
    for name in plan.to_clear:
        target = plan.folder / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)  # another node on shared storage may be clearing too
        else:
            target.unlink(missing_ok=True)


def _plan_resume_last(root: Path, version: int | str | None) -> RunPlan:
    if version is not None:
        candidates = [(version, version_folder(root, version))]
    else:
        candidates = [(n, version_folder(root, n)) for n in _versions(root)]
    found = [(v, f, c) for v, f in candidates if (c := _last_checkpoint(f)) is not None]
    if not found:
        looked = (
            f"{candidates[0][1] / 'checkpoints' / LAST_CHECKPOINT}"
            if version is not None
            else f"{root}/version_*/checkpoints/{LAST_CHECKPOINT}"
        )
        raise RunFolderError(
            f"--ckpt_path last: no checkpoint to resume ({looked} does not exist); a run killed before its first "
            "checkpoint interval has nothing to resume: start it again without --ckpt_path"
        )
    newest = max(found, key=lambda item: os.stat(item[2]).st_mtime_ns)
    return RunPlan(newest[0], str(newest[2]), newest[1], [])
