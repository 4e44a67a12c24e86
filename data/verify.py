"""Verify a dataset's shards once before training: size and sha256 against the manifest, remembered in a stamp.

    report = verify_shards("outputs/shards/toy", manifest)          # hashes what the stamp does not vouch for
    print(report.summary())                                          # "verified 4 shards (0.5 MB) in 0.01 s ..."

    python -m data.verify outputs/shards/toy            # the same from the shell (a pre-flight before a fit)
    python -m data.verify outputs/shards/toy --rehash   # ignore the stamp: hash every shard (a timing)
    python -m data.verify outputs/shards/toy --workers 4

The DataModule reads shards sample by sample and checks every value it decodes (NaN/Inf, token ids,
shapes), but a flipped byte inside a valid float, a valid token id changed into another or an edited
prompt decode cleanly. Only the manifest's sha256 catches those, and hashing every shard at every
fit would cost a Janus-sized dataset's full read. So a fit (`DrafterDataModule.setup`) hashes every
shard once, then writes a stamp: the manifest file's sha256 and, per shard, what git's index records of
a file (device, inode, ctime, size, mtime) when it hashed right. Later fits re-hash only shards whose
stat changed (a copy made with `cp -a` or `rsync -a` keeps the mtime but not the inode or ctime, so it is
re-hashed), and everything when the manifest changed.

Speed: shards are hashed on up to MAX_WORKERS threads (hashlib releases the GIL), and in a distributed fit
each process hashes its share (`verify_shards_shared`: rank 0's plan, split by size, results gathered), so
no process waits at a collective for more than about one shard's hashing; docs/data.md gives the costs.

The stamp is `<dataset>/.verified.json`; where the dataset folder is read-only it goes to the
fallback folder the caller names (the run folder), as `verified-<manifest digest>.json`. It is
written atomically (its temporary name carries host and pid) and only ever records shards that verified.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.errors import ManifestError, ShardError
from data.manifest import MANIFEST_NAME, Manifest, load_manifest
from data.shard_reader import REEXTRACT, iter_raw_samples
from data.shards import write_atomic

STAMP_NAME = ".verified.json"
CHUNK = 1 << 22  # 4 MiB reads
MAX_WORKERS = 8
"""Hashing threads per node at most: enough to keep an NVMe disk or a parallel file system busy."""


@dataclass
class VerifyReport:
    """What one verification pass did."""

    stamp: Path | None
    """Where the stamp was written (None: nowhere writable)."""
    hashed: list[str] = field(default_factory=list)
    """Shards hashed in this pass (they were new, changed, or the stamp was missing or stale)."""
    trusted: list[str] = field(default_factory=list)
    """Shards the stamp vouched for: same manifest, and the same device, inode, ctime, size and mtime as when they
    last verified."""
    failed: dict[str, str] = field(default_factory=dict)
    """Shard name -> what is wrong (missing, not a regular file, size, sha256)."""
    bytes_hashed: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.bytes_hashed / self.seconds / 1e6 if self.seconds > 0 else 0.0
        parts = [f"verified {len(self.hashed)} shards ({self.bytes_hashed / 1e6:.1f} MB) in {self.seconds:.2f} s"]
        if self.hashed and self.seconds > 0:
            parts[0] += f" ({rate:.0f} MB/s)"
        if self.trusted:
            parts.append(f"{len(self.trusted)} unchanged since their last verification (stamp {self.stamp}) skipped")
        if self.failed:
            parts.append(f"{len(self.failed)} failed")
        return "; ".join(parts)


def manifest_digest(folder: Path) -> str:
    """sha256 of the manifest file's bytes: any edit to it re-verifies every shard."""
    return hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest()


def _shard_problem(folder: Path, path: Path, size: int, sha256: str) -> tuple[str | None, int]:
    """(what is wrong with the shard or None, bytes hashed)."""
    if not path.exists():
        return f"{path}: listed in the manifest but missing; {REEXTRACT}", 0
    if path.is_symlink() and not path.resolve().is_relative_to(folder.resolve()):
        return (
            f"{path}: is a symbolic link to {path.resolve()}, outside the dataset folder; copy the shard into {folder}",
            0,
        )
    if path.is_dir():
        return f"{path}: is a directory, not a shard (a tar file); {REEXTRACT}", 0
    if not path.is_file():  # a FIFO would block open() forever, a device never ends: refused before opening
        return f"{path}: is not a regular file; shards must be regular files ({REEXTRACT})", 0
    found = path.stat().st_size
    if found != size:
        structural = _read_problem(path) or f"{path}: the shard was replaced"
        return f"{structural} ({path}: holds {found} bytes, the manifest says {size})", 0
    digest, hashed = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
            hashed += len(chunk)
    if digest.hexdigest() != sha256:
        reason = _read_problem(path)  # the reader's own diagnosis when the damage is structural
        mismatch = f"{path}: sha256 {digest.hexdigest()} differs from the manifest's {sha256}"
        changed = f"{mismatch}: its bytes changed since extraction; {REEXTRACT}"
        return (f"{reason} ({mismatch})" if reason else changed), hashed
    return None, hashed


def _read_problem(path: Path) -> str | None:
    """What the shard reader says of a (regular) shard file that failed its hash, or None if it reads cleanly."""
    try:
        for _ in iter_raw_samples(path):
            pass
    except ShardError as error:
        return str(error)
    return None


def _load_stamp(path: Path, digest: str) -> dict[str, dict[str, int]]:
    """The stamp's shard entries if it exists, parses and belongs to this manifest; otherwise {}."""
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(values, dict) or values.get("manifest_sha256") != digest:
        return {}
    shards = values.get("shards")
    return shards if isinstance(shards, dict) else {}


def stamp_path(folder: Path, fallback_dir: Path | None, digest: str) -> Path | None:
    """`<folder>/.verified.json` where the folder is writable, else the fallback folder's file, else None."""
    if os.access(folder, os.W_OK):
        return folder / STAMP_NAME
    if fallback_dir is not None:
        return Path(fallback_dir) / f"verified-{digest[:16]}.json"
    return None


def stat_entry(status: os.stat_result) -> dict[str, int]:
    """What a stamp remembers of a shard, as git's index does: device, inode, ctime, size, mtime.

    A copy (`cp -a`, `rsync -a`, `shutil.copy2`) keeps size and mtime but gets a new inode and ctime, so
    it is hashed again; so is a shard on another mount (its device number differs).
    """
    return {
        "dev": status.st_dev,
        "ino": status.st_ino,
        "ctime_ns": status.st_ctime_ns,
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
    }


@dataclass
class ShardCheck:
    """One shard hashed: what is wrong (None: it verified), bytes read, and its stamp entry if it verified."""

    problem: str | None
    bytes_hashed: int
    entry: dict[str, int] | None


@dataclass
class VerifyPlan:
    """What one verification pass has to do for a dataset folder, from the stamp and the shards' stat alone."""

    folder: Path
    manifest: Manifest
    digest: str
    stamp: Path | None
    trusted: dict[str, dict[str, int]]
    """Shard name -> its stamp entry, for shards whose stat equals the entry."""
    pending: list[str]
    """Shards to hash, in manifest order."""


def plan_verification(folder: str | Path, manifest: Manifest, fallback_dir: str | Path | None = None) -> VerifyPlan:
    """Which shards the stamp vouches for (same manifest, and the same stat as when they last verified)."""
    folder = Path(folder)
    digest = manifest_digest(folder)
    stamp = stamp_path(folder, Path(fallback_dir) if fallback_dir is not None else None, digest)
    known = _load_stamp(stamp, digest) if stamp is not None else {}
    trusted, pending = {}, []
    for info in manifest.shards:
        try:
            entry = stat_entry((folder / info.name).lstat())  # a symlink's own stat: trusting it never follows it
        except OSError:
            entry = None
        if entry is not None and entry["size"] == info.num_bytes and known.get(info.name) == entry:
            trusted[info.name] = entry
        else:
            pending.append(info.name)
    return VerifyPlan(folder, manifest, digest, stamp, trusted, pending)


def default_workers(processes_per_node: int = 1) -> int:
    """Hashing threads for one process: MAX_WORKERS (or the CPU count, if lower) shared by the node's processes."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1) // max(1, processes_per_node))


def hash_shards(plan: VerifyPlan, names: list[str], workers: int | None = None) -> dict[str, ShardCheck]:
    """Hash the shards `names` of `plan`'s folder against its manifest on `workers` threads (default_workers()).

    hashlib and file reads release the GIL, so threads hash several shards at once up to the disk's (or the
    cores') speed. Each shard's stat is taken before it is read, so a shard changed while it is hashed is
    hashed again next time.
    """
    infos = {info.name: info for info in plan.manifest.shards}

    def check(name: str) -> ShardCheck:
        path = plan.folder / name
        try:
            entry: dict[str, int] | None = stat_entry(path.lstat())
        except OSError:
            entry = None
        info = infos[name]
        try:
            problem, hashed = _shard_problem(plan.folder, path, info.num_bytes, info.sha256)
        except OSError as error:  # reported, never raised: in a shared verification every process must gather
            problem, hashed = f"{path}: cannot be read ({error.strerror or error}); {REEXTRACT}", 0
        return ShardCheck(problem, hashed, entry if problem is None else None)

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(workers or default_workers(), len(names))) as pool:
        return dict(zip(names, pool.map(check, names), strict=True))


def split_by_size(names: list[str], sizes: dict[str, int], parts: int) -> list[list[str]]:
    """`names` dealt into `parts` lists of nearly equal total size (largest first onto the lightest list).

    Every process computes the same split from the same list, so each hashes its own share and no process
    waits at the gather for longer than about one shard's hashing.
    """
    shares: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for name in sorted(names, key=lambda n: (-sizes.get(n, 0), n)):
        lightest = loads.index(min(loads))
        shares[lightest].append(name)
        loads[lightest] += sizes.get(name, 0)
    return shares


def finish_verification(
    plan: VerifyPlan, checks: dict[str, ShardCheck], seconds: float, write: bool = True
) -> VerifyReport:
    """The report of `plan` hashed as `checks`; with `write`, the stamp for every shard that verified."""
    report = VerifyReport(plan.stamp, seconds=seconds)
    entries = dict(plan.trusted)
    for info in plan.manifest.shards:
        if info.name in plan.trusted:
            report.trusted.append(info.name)
        elif info.name in checks:
            check = checks[info.name]
            report.hashed.append(info.name)
            report.bytes_hashed += check.bytes_hashed
            if check.problem is not None:
                report.failed[info.name] = check.problem
            elif check.entry is not None:
                entries[info.name] = check.entry
    if write and plan.stamp is not None and report.hashed:
        try:
            write_atomic(plan.stamp, json.dumps({"manifest_sha256": plan.digest, "shards": entries}, indent=1))
        except OSError as error:  # the shards verified; only the next fit's shortcut is lost
            warnings.warn(f"{plan.stamp}: the verification stamp cannot be written ({error}); the next fit hashes "
                          "these shards again", stacklevel=2)  # fmt: skip
            report.stamp = None
    return report


def verify_shards(
    folder: str | Path, manifest: Manifest, fallback_dir: str | Path | None = None, workers: int | None = None
) -> VerifyReport:
    """Hash every shard the stamp does not vouch for against the manifest; write the stamp for those that verify.

    Args:
        folder: the dataset folder (manifest.json + shards).
        manifest: its parsed manifest.
        fallback_dir: where the stamp goes when `folder` is read-only (the run folder); None = nowhere.
        workers: hashing threads; None = default_workers().

    Returns:
        The report; shards that fail are in `report.failed` (the caller raises or skips them).
    """
    plan = plan_verification(folder, manifest, fallback_dir)
    start = time.perf_counter()
    checks = hash_shards(plan, plan.pending, workers)
    return finish_verification(plan, checks, time.perf_counter() - start)


def verify_shards_shared(
    folder: str | Path,
    manifest: Manifest,
    rank: int,
    world_size: int,
    all_gather: Callable[[Any], list[Any]],
    fallback_dir: str | Path | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """`verify_shards` split across the processes of a job: each hashes its share, the results are gathered.

    Every process calls it at once (`all_gather(obj)` returns every process's `obj`, in rank order, as
    `torch.distributed.all_gather_object` does). Rank 0's plan decides what to hash; `split_by_size` deals it
    out; each process hashes its share on `workers` threads; the checks are gathered, so every process returns
    the same report (and raises, or skips, the same shards), and rank 0 writes the stamp. A process waits at a
    gather only for the difference between the shares, about one shard's hashing, however large the dataset.
    The folder must be the same files for every process (a shared file system).
    """
    plan, error = None, None
    try:
        plan = plan_verification(folder, manifest, fallback_dir)
    except OSError as caught:  # raised after both gathers, so that every process's gathers still pair up
        error = caught
    pending = all_gather(plan.pending if plan is not None else [])[0]  # rank 0's view decides for every process
    start = time.perf_counter()
    sizes = {info.name: info.num_bytes for info in manifest.shards}
    share = split_by_size(pending, sizes, world_size)[rank]
    mine = hash_shards(plan, share, workers) if plan is not None else {}
    checks: dict[str, ShardCheck] = {}
    for gathered in all_gather(mine):
        checks.update(gathered)
    if plan is None:
        raise ManifestError(f"{Path(folder) / MANIFEST_NAME}: cannot be read to verify the shards ({error})")
    plan.trusted = {name: entry for name, entry in plan.trusted.items() if name not in checks}
    return finish_verification(plan, checks, time.perf_counter() - start, write=rank == 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="dataset folder (manifest.json + shards)")
    parser.add_argument("--rehash", action="store_true", help="hash every shard, whatever the stamp says")
    parser.add_argument("--workers", type=int, default=None, help=f"hashing threads (default: up to {MAX_WORKERS})")
    args = parser.parse_args(argv)
    try:
        manifest = load_manifest(args.dataset)
        if args.rehash:
            (args.dataset / STAMP_NAME).unlink(missing_ok=True)
        report = verify_shards(args.dataset, manifest, workers=args.workers)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.dataset}: {report.summary()} on {args.workers or default_workers()} threads")
    for problem in report.failed.values():
        print(f"  {problem}", file=sys.stderr)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
