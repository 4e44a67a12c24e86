"""Which weights a target's options name, told from the files alone: the checkpoint a dataset's manifest records.

    identity = checkpoint_identity("janus-pro-7b", {"path": "/models/Janus-Pro-7B", "dtype": "bfloat16"})
    identity.source        # "/models/Janus-Pro-7B"
    identity.fingerprint   # sha256 over the sorted (file name, size) of its weight files and index json
    identity.mismatch(other)   # None when both name the same weights, else what differs

Nothing is loaded or downloaded: a local folder is listed (names and sizes of `*.safetensors`, `*.bin`,
`*.pt`, `*.pth` and the `*.index.json` files), a hub id is looked up in the huggingface_hub cache (its
snapshot folder, whose commit is the revision), and a hub id that is not cached is recorded by id with
`fingerprint` None. Sizes, not contents, are hashed: listing a 15 GB folder costs microseconds, and a
different release or a different conversion of a model changes its files' sizes or names.

Per target (the registry's loader options, `models.registry`):

    janus-pro-7b, lumina-mgpt-7b   `path`; None = $JANUS_PRO_PATH / $LUMINA_MGPT_PATH, else the hub id
    llamagen-xl                    `gpt_checkpoint`, `vq_checkpoint`, `t5_path`, `preset`, `folder`
                                   (None = $LLAMAGEN_DIR, else `pretrained_models`), as the loader resolves them
    toy, texture                   `folder`: sha256 of its two asset files' bytes (they are small)
    random_weights: "real"/"tiny"  "random:<size>" (the same seeded architecture every time)
    any other name                 the name and its options, fingerprint None (a target registered by a test)

`resolve_path` is where the loaders of Janus and Lumina read their environment variable, so extraction
and training that leave `path` unset both load the folder the variable names.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED_ASSETS = {  # embedded world -> its target and VQ files (models.toy.target, models.texture.target)
    "toy": ("toy_target.safetensors", "toy_vq.safetensors"),
    "texture": ("texture_target.safetensors", "texture_vq.safetensors"),
}
PATH_ENV = {"janus-pro-7b": "JANUS_PRO_PATH", "lumina-mgpt-7b": "LUMINA_MGPT_PATH"}
"""Environment variable a target's `path` falls back to when the options leave it unset."""
HUB_IDS = {"janus-pro-7b": "deepseek-community/Janus-Pro-7B", "lumina-mgpt-7b": "Alpha-VLLM/Lumina-mGPT-7B-768"}
"""The hub id a target's `path` falls back to when neither the options nor the environment name one."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_SUFFIX = ".index.json"


@dataclass(frozen=True)
class CheckpointIdentity:
    """The weights a target is loaded from, as the manifest records them (`checkpoint` in manifest.json)."""

    source: str
    """The local path(s) or hub id(s) the options resolve to; "random:<size>" for random weights."""
    revision: str | None = None
    """The hub snapshot's commit, where the weights come from the huggingface_hub cache; None otherwise."""
    fingerprint: str | None = None
    """sha256 over the sorted (name, size) of the weight files and index json; None when no file was found."""

    def describe(self) -> str:
        """`source (revision r, fingerprint 1a2b3c4d5e6f)` for messages."""
        details = [f"revision {self.revision}"] if self.revision else []
        details.append(f"fingerprint {self.fingerprint[:12]}" if self.fingerprint else "no local files: unverified")
        return f"{self.source} ({', '.join(details)})"

    def mismatch(self, other: CheckpointIdentity) -> str | None:
        """None when `self` and `other` name the same weights, else why they may not.

        Both fingerprinted: the fingerprints decide (the same files under another path match). Otherwise the
        sources and revisions must be equal, since nothing else can show the weights are the same.
        """
        if self.fingerprint is not None and other.fingerprint is not None:
            return None if self.fingerprint == other.fingerprint else "their weight files differ (fingerprint)"
        if self.source != other.source:
            return "they name different checkpoints and the files of one cannot be found to compare"
        if self.revision != other.revision and None not in (self.revision, other.revision):
            return "they name different revisions"
        return None


def resolve_path(target: str, path: str | None) -> str:
    """The `path` a Janus or Lumina loader reads: as given, else $JANUS_PRO_PATH / $LUMINA_MGPT_PATH, else the hub."""
    return path or os.environ.get(PATH_ENV[target]) or HUB_IDS[target]


def checkpoint_identity(target: str, options: dict[str, Any] | None = None) -> CheckpointIdentity:
    """The identity of the weights `load_target(target, **options)` would load, without loading them."""
    options = dict(options or {})
    if options.get("random_weights"):
        size = str(options["random_weights"])
        return CheckpointIdentity(f"random:{size}", None, f"random:{size}")
    if target in PATH_ENV:
        return _folder_or_hub(resolve_path(target, options.get("path")))
    if target == "llamagen-xl":
        return _llamagen(options)
    if target in EMBEDDED_ASSETS:
        return _embedded(target, options.get("folder"))
    shown = json.dumps(options, sort_keys=True, default=str)
    return CheckpointIdentity(f"{target} {shown}" if options else target)


def _fingerprint(files: list[tuple[str, int | str]]) -> str | None:
    """sha256 over sorted (name, size) pairs; None for no files."""
    if not files:
        return None
    return hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()


def _weight_files(folder: Path) -> list[tuple[str, int | str]]:
    """(name relative to `folder`, size) of its weight files and index json; sizes follow the hub cache's links."""
    found: list[tuple[str, int | str]] = []
    for path in sorted(folder.rglob("*")):
        name = path.name
        if (name.endswith(WEIGHT_SUFFIXES) or name.endswith(INDEX_SUFFIX)) and path.is_file():
            found.append((path.relative_to(folder).as_posix(), path.stat().st_size))
    return found


def _hub_snapshot(repo_id: str, filename: str = "config.json") -> tuple[Path, str] | None:
    """(snapshot folder, commit) of a cached hub repo holding `filename`, or None (not cached, or no hub library)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(repo_id, filename)
    except Exception:  # an id that is not a valid repo name
        return None
    if not isinstance(cached, str):
        return None
    snapshot = Path(cached).parent
    while snapshot.parent.name != "snapshots":  # a file in a subfolder of the snapshot
        snapshot = snapshot.parent
    return snapshot, snapshot.name


def _folder_or_hub(path: str) -> CheckpointIdentity:
    """A transformers-format checkpoint: a local folder, else a hub id (from the cache where it is there)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return CheckpointIdentity(str(folder.resolve()), None, _fingerprint(_weight_files(folder)))
    snapshot = _hub_snapshot(path)
    if snapshot is None:
        return CheckpointIdentity(path)
    return CheckpointIdentity(path, snapshot[1], _fingerprint(_weight_files(snapshot[0])))


def _llamagen(options: dict[str, Any]) -> CheckpointIdentity:
    """LlamaGen-XL t2i: its GPT checkpoint, VQ checkpoint and FLAN-T5-XL, resolved as the loader resolves them."""
    from models.llamagen_t2i import DEFAULT_DIR_ENV, GPT_FILES, HUB_REPO, T5_HUB_ID, T5_SUBDIR, VQ_FILE

    folder = Path(options.get("folder") or os.environ.get(DEFAULT_DIR_ENV) or "pretrained_models")
    preset = options.get("preset")
    gpt = options.get("gpt_checkpoint")
    if gpt is None:
        gpt = GPT_FILES.get(preset if isinstance(preset, str) else "t2i-XL-stage2", str(preset))
    sources: list[str] = []
    revisions: list[str] = []
    files: list[tuple[str, int | str]] = []
    for role, name in (("gpt", gpt), ("vq", options.get("vq_checkpoint") or VQ_FILE)):
        local = next((p for p in (Path(name), folder / name) if p.is_file()), None)
        if local is None and Path(name).parent == Path("."):
            snapshot = _hub_snapshot(HUB_REPO, Path(name).name)
            if snapshot is not None:
                local = snapshot[0] / Path(name).name
                revisions.append(snapshot[1])
        sources.append(f"{role}={local.resolve() if local else f'{HUB_REPO}/{name}'}")
        if local is not None:
            files.append((f"{role}/{local.name}", local.stat().st_size))
    t5 = options.get("t5_path") or (folder / T5_SUBDIR if (folder / T5_SUBDIR).is_dir() else T5_HUB_ID)
    t5_identity = _folder_or_hub(str(t5))
    sources.append(f"t5={t5_identity.source}")
    if t5_identity.revision:
        revisions.append(t5_identity.revision)
    fingerprint = None
    if len(files) == 2 and t5_identity.fingerprint is not None:  # every part found: the whole is fingerprinted
        fingerprint = _fingerprint([*files, ("t5", t5_identity.fingerprint)])
    return CheckpointIdentity(";".join(sources), ",".join(revisions) or None, fingerprint)


def _embedded(target: str, folder: str | None) -> CheckpointIdentity:
    """An embedded world's two asset files (a few MB at most): hashed by content."""
    if folder is None:
        from models import texture, toy

        folder = str((toy if target == "toy" else texture).ASSETS)
    path = Path(folder)
    digest = hashlib.sha256()
    for name in EMBEDDED_ASSETS[target]:
        if not (path / name).is_file():
            return CheckpointIdentity(str(path.resolve()))
        digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    return CheckpointIdentity(str(path.resolve()), None, digest.hexdigest())
