"""What the drafter DataModule reads and how it batches it (`DataConfig`), and its error policy."""

from __future__ import annotations

from dataclasses import dataclass

ON_ERROR = ("raise", "skip")
FEATURE_SOURCES = ("offline", "online")


class SkippedSamplesWarning(UserWarning):
    """Samples were dropped under on_error="skip" (and replaced by masked padding rows)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where the features are and how to batch them."""

    train_dir: str
    """Dataset folder (manifest.json + shards) for training."""
    val_dir: str | None = None
    """Dataset folder for validation; None takes the last `num_val_shards` shards of train_dir."""
    num_val_shards: int = 0
    """With val_dir None: shards of train_dir held out for validation (0 = no validation data)."""
    batch_size: int = 8
    """Samples per batch on each rank."""
    num_workers: int = 0
    """DataLoader worker processes per rank (on 2 CPU cores, 0 is fastest: samples are MBs each)."""
    shuffle_buffer: int = 16
    """Samples mixed across shards; memory is shuffle_buffer x sample size (4.7 MB for Janus hidden only)."""
    seed: int = 0
    """Fixes, with the epoch, the shard order and the shuffle."""
    load_aux: bool = True
    """Load the EAGLE-3 auxiliary streams (EAGLE-3 drafters need them; EAGLE-1 does not)."""
    load_uncond: bool = False
    """Load the unconditional features: uncond_hidden, and uncond_aux too when load_aux is on and the dataset has it."""
    features: str = "offline"
    """offline: read the target's states from the shards; online: read only the tokens and let the training step
    recompute the states with the frozen target (token-only datasets need it; full ones allow it)."""
    verify: bool = True
    """Hash every shard against the manifest's sha256 before training, once: a stamp remembers the shards that
    verified (size, mtime), so later fits hash only what changed (`data.verify`)."""
    on_error: str = "raise"
    """raise: a corrupt or truncated shard stops training with its name; skip: warn, pad and count."""

    def __post_init__(self) -> None:
        if self.features not in FEATURE_SOURCES:
            raise ValueError(f"data.features={self.features!r}; use one of {', '.join(FEATURE_SOURCES)}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}; use one of {', '.join(ON_ERROR)}")
        for name in ("batch_size", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0 or self.num_val_shards < 0:
            raise ValueError(
                f"num_workers and num_val_shards must be >= 0, got {self.num_workers}, {self.num_val_shards}"
            )
