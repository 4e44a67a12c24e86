"""Verify a dataset's shards once before training: size and sha256 against the manifest, remembered in a stamp.

    report = verify_shards("outputs/shards/toy", manifest)          # hashes what the stamp does not vouch for
    print(report.summary())                                          # "verified 4 shards (0.5 MB) in 0.01 s ..."

    python -m data.verify outputs/shards/toy            # the same from the shell (what fit.py runs first)
    python -m data.verify outputs/shards/toy --rehash   # ignore the stamp: hash every shard (a timing)

The DataModule reads shards sample by sample and checks every value it decodes (NaN/Inf, token ids,
shapes), but a flipped byte inside a valid float, a valid token id changed into another or an edited
prompt decode cleanly. Only the manifest's sha256 catches those, and hashing every shard at every
fit would cost a Janus-sized dataset's full read. So `fit.py` (through `DrafterDataModule.prepare_data`)
hashes every shard once, then writes a stamp: the manifest file's sha256 and, per shard, the size and
mtime it had when it hashed right. Later fits re-hash only shards whose size or mtime changed, and
everything when the manifest changed. Hashing runs at disk speed (sha256 reads about 1-2 GB/s per
core; a Janus dataset of 30k full samples is 1.1 TB, a token-only one 92 MB).

The stamp is `<dataset>/.verified.json`; where the dataset folder is read-only it goes to the
fallback folder the caller names (the run folder), as `verified-<manifest digest>.json`. It is
written atomically and only ever records shards that verified.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from data.errors import ShardError
from data.manifest import MANIFEST_NAME, Manifest, load_manifest
from data.shard_reader import REEXTRACT, iter_raw_samples
from data.shards import write_atomic

STAMP_NAME = ".verified.json"
CHUNK = 1 << 22  # 4 MiB reads


@dataclass
class VerifyReport:
    """What one verification pass did."""

    stamp: Path | None
    """Where the stamp was written (None: nowhere writable)."""
    hashed: list[str] = field(default_factory=list)
    """Shards hashed in this pass (they were new, changed, or the stamp was missing or stale)."""
    trusted: list[str] = field(default_factory=list)
    """Shards the stamp vouched for: same manifest, size and mtime as when they last verified."""
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


def verify_shards(folder: str | Path, manifest: Manifest, fallback_dir: str | Path | None = None) -> VerifyReport:
    """Hash every shard the stamp does not vouch for against the manifest; write the stamp for those that verify.

    Args:
        folder: the dataset folder (manifest.json + shards).
        manifest: its parsed manifest.
        fallback_dir: where the stamp goes when `folder` is read-only (the run folder); None = nowhere.

    Returns:
        The report; shards that fail are in `report.failed` (the caller raises or skips them).
    """
    folder = Path(folder)
    digest = manifest_digest(folder)
    stamp = stamp_path(folder, Path(fallback_dir) if fallback_dir is not None else None, digest)
    known = _load_stamp(stamp, digest) if stamp is not None else {}
    report, entries = VerifyReport(stamp), {}
    start = time.perf_counter()
    for info in manifest.shards:
        path = folder / info.name
        try:
            status = path.lstat()  # a symlink's own size and mtime: trusting it never follows it
        except OSError:
            status = None
        entry = known.get(info.name)
        if status is not None and isinstance(entry, dict) and entry.get("size") == status.st_size == info.num_bytes:
            if entry.get("mtime_ns") == status.st_mtime_ns:
                report.trusted.append(info.name)
                entries[info.name] = entry
                continue
        problem, hashed = _shard_problem(folder, path, info.num_bytes, info.sha256)
        report.hashed.append(info.name)
        report.bytes_hashed += hashed
        if problem is not None:
            report.failed[info.name] = problem
        elif status is not None:
            entries[info.name] = {"size": status.st_size, "mtime_ns": status.st_mtime_ns}
    report.seconds = time.perf_counter() - start
    if stamp is not None and report.hashed:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(stamp, json.dumps({"manifest_sha256": digest, "shards": entries}, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="dataset folder (manifest.json + shards)")
    parser.add_argument("--rehash", action="store_true", help="hash every shard, whatever the stamp says")
    args = parser.parse_args(argv)
    try:
        manifest = load_manifest(args.dataset)
        if args.rehash:
            (args.dataset / STAMP_NAME).unlink(missing_ok=True)
        report = verify_shards(args.dataset, manifest)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.dataset}: {report.summary()}")
    for problem in report.failed.values():
        print(f"  {problem}", file=sys.stderr)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
