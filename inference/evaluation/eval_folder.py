"""The output folder of `python -m inference.evaluate`: its layout, run identity, crash-safe writes and merge.

    OUT/
      run.json              the run's identity (target, dtype, drafter digest, rule, tree, sampling, seed,
                            captions digest) and how it was started; a rerun with another identity is refused
      images/00000.png      one PNG per caption, named by the caption's index in the prompt list
      records/00000.json    that image's record (caption, seed, tau, forwards, time); written after its PNG,
                            so a record is the mark that image i is finished
      images.jsonl          every record, one JSON line per image in index order (written once all exist)
      summary.json          tau, forwards and latency over all images (written with images.jsonl)
      scores.json           FID / CLIP score (`inference.evaluate score`)

Every file is written to a temporary name and renamed (`os.replace`), so a process killed at any
moment leaves either the whole file or none of it; the temporary names carry host and pid, and a
rerun removes those of dead processes. Ranks write disjoint images (index i belongs to rank
i mod W) and merge the same records into byte-identical images.jsonl / summary.json, so whichever
rank finishes last writes them and a race between two writers is harmless.

Shapes: none (files and JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inference.decoding.files import TEMP_NAME, host_name, write_atomic, write_json
from inference.decoding.generate import TAU_DEFINITION

RUN_FILE = "run.json"
IMAGES_DIR, RECORDS_DIR = "images", "records"
MERGED_FILE, SUMMARY_FILE, SCORES_FILE = "images.jsonl", "summary.json", "scores.json"
TIMING_KEYS = ("seconds", "wall_seconds")  # the only record fields that differ between two runs of one identity


class RunFolderError(ValueError):
    """A folder that is not, or not this, evaluation run; the message names the file."""


def image_name(index: int) -> str:
    return f"{index:05d}.png"


def record_name(index: int) -> str:
    return f"{index:05d}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out: Path, mine: Iterable[int] = ()) -> int:
    """Delete temporary files left by killed writers: those of dead processes on this host, and any for the
    images `mine` (which only this process writes). Returns how many were removed."""
    owned = {image_name(i) for i in mine} | {record_name(i) for i in mine}
    removed = 0
    for folder in (out, out / IMAGES_DIR, out / RECORDS_DIR):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            match = TEMP_NAME.match(path.name)
            if match is None:
                continue
            dead = match["host"] == host_name() and not _alive(int(match["pid"]))
            if dead or (folder != out and match["name"] in owned):
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def file_digest(paths: Sequence[Path]) -> str:
    """sha256 over the bytes of `paths`, in order (a drafter's config.json and weights)."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def captions_digest(captions: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(captions).encode("utf-8")).hexdigest()


def claim_folder(out: Path, identity: dict[str, Any], info: dict[str, Any]) -> None:
    """Create `out/run.json` with `identity`, or check that the one there holds the same identity.

    Raises:
        RunFolderError: run.json names another identity (the differing fields are listed), or `out` holds
            files but no run.json; nothing is written in either case.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_FILE
    if not path.exists():
        foreign = sorted(p.name for p in out.iterdir() if p.name != RUN_FILE and not TEMP_NAME.match(p.name))
        if foreign:
            raise RunFolderError(
                f"{out} holds {', '.join(foreign[:5])} but no {RUN_FILE}: it is not an inference.evaluate run "
                "folder; choose an empty or new folder (nothing was written)"
            )
        tmp = path.with_name(f".{RUN_FILE}.{host_name()}.{os.getpid()}.tmp")  # link, not rename: exclusive
        tmp.write_text(json.dumps({"identity": identity, **info}, indent=2) + "\n", encoding="utf-8")
        try:
            os.link(tmp, path)  # exclusive create: another rank may have written it a moment ago
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    stored = read_run(out)["identity"]
    if stored != identity:
        keys = sorted(k for k in set(stored) | set(identity) if stored.get(k) != identity.get(k))
        details = "; ".join(f"{k}: folder has {stored.get(k)!r}, this run {identity.get(k)!r}" for k in keys)
        raise RunFolderError(
            f"{path} belongs to another run ({details}); nothing was written. Use another --out, "
            "or the same target, drafter, rule, tree, sampling, seed and captions to resume"
        )


def read_run(out: Path) -> dict[str, Any]:
    path = out / RUN_FILE
    if not path.exists():
        raise RunFolderError(f"{path} not found: {out} is not an inference.evaluate run folder")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RunFolderError(f"{path} is not valid JSON ({error})") from error
    if "identity" not in run:
        raise RunFolderError(f"{path} has no 'identity' field: not written by inference.evaluate")
    return run


def is_done(out: Path, index: int) -> bool:
    """Image `index` is finished when its record exists (written after its PNG) and so does the PNG."""
    return (out / RECORDS_DIR / record_name(index)).exists() and (out / IMAGES_DIR / image_name(index)).exists()


def save_image(out: Path, index: int, png: bytes, record: dict[str, Any]) -> None:
    """The PNG first, then the record that marks the image as done (each written atomically)."""
    (out / IMAGES_DIR).mkdir(exist_ok=True)
    (out / RECORDS_DIR).mkdir(exist_ok=True)
    write_atomic(out / IMAGES_DIR / image_name(index), png)
    write_atomic(out / RECORDS_DIR / record_name(index), json.dumps(record) + "\n")


def read_record(out: Path, index: int) -> dict[str, Any]:
    path = out / RECORDS_DIR / record_name(index)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RunFolderError(f"{path} is not a valid record ({error})") from error


def summarise_records(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """tau (over all verification steps), forwards per image and latency of `records`."""
    if not records:
        raise ValueError("no image records to summarise")
    steps = sum(int(r["verification_steps"]) for r in records)
    plus_one = sum(float(r["tau"]) * int(r["verification_steps"]) for r in records)
    wall = np.array([float(r["wall_seconds"]) for r in records])
    return {
        "images": len(records),
        "tau": plus_one / max(steps, 1),
        "verification_steps": steps,
        "target_forwards_per_image": float(np.mean([r["target_forwards"] for r in records])),
        "drafter_forwards_per_image": float(np.mean([r["drafter_forwards"] for r in records])),
        "seconds_per_image": float(np.mean([r["seconds"] for r in records])),
        "wall_seconds_per_image": float(wall.mean()),
        "wall_seconds_median": float(np.median(wall)),
        "tau_definition": TAU_DEFINITION,
        "latency_definition": "wall_seconds: token generation + VQ decoding of one image (batch 1), "
        "synchronised; seconds: the decoder's own clock (tokens only)",
    }


def finalise(out: Path, count: int) -> dict[str, Any] | None:
    """Write images.jsonl and summary.json once all `count` images are done; None (nothing written) before."""
    if not all(is_done(out, i) for i in range(count)):
        return None
    records = [read_record(out, i) for i in range(count)]
    write_atomic(out / MERGED_FILE, "".join(json.dumps(r) + "\n" for r in records))
    summary = {"identity": read_run(out)["identity"], **summarise_records(records)}
    write_json(summary, out / SUMMARY_FILE)
    return summary


def load_finished(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(run.json, every record) of a complete run, merging first when images.jsonl is missing.

    Raises:
        RunFolderError: the run is unfinished (how many images are missing is said) or unreadable.
    """
    run = read_run(out)
    count = int(run["identity"]["prompts"]["count"])
    if not (out / MERGED_FILE).exists() and finalise(out, count) is None:
        missing = [i for i in range(count) if not is_done(out, i)]
        raise RunFolderError(
            f"{out / MERGED_FILE} not written: {len(missing)} of {count} images are not finished "
            f"(first missing: {image_name(missing[0])}); rerun the generate command to complete the run"
        )
    path = out / MERGED_FILE
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(records) != count:
        raise RunFolderError(f"{path} holds {len(records)} records, {RUN_FILE} says {count} captions")
    return run, records
