"""A drafter's config: everything needed to rebuild an EAGLE-1 or EAGLE-3 drafter, saved next to its weights.

Its own module so that the drafter (`models.eagle`) and its layers (`models.eagle_layers`) both read it
without importing each other; `from models.eagle import DrafterConfig` keeps working.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ARCHITECTURES = ("eagle1", "eagle3")


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Everything needed to rebuild a drafter; saved next to its weights."""

    architecture: str
    """"eagle1" or "eagle3"."""
    hidden_size: int
    """H; must equal the width of the target's image-token embedding (and, for EAGLE-1, its hidden size)."""
    num_heads: int
    intermediate_size: int
    target_hidden_size: int
    """D_t, the target's hidden size (EAGLE-3's fc reads num_aux_layers x D_t)."""
    vocab_size: int
    """V, the target's image vocabulary."""
    num_kv_heads: int | None = None
    """Key/value heads (None = num_heads)."""
    draft_vocab_size: int | None = None
    """EAGLE-3 only: Vd, the drafter head's vocabulary (None = the full image vocabulary)."""
    num_aux_layers: int = 3
    """EAGLE-3 only: target streams fused by fc (low, mid, high)."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    fc_bias: bool = True
    """EAGLE-1 only: bias on fc (the original EAGLE-1 drafters have one; vLLM's loader expects none)."""
    target: str = ""
    """Name of the target this drafter was built for (checked when it is loaded for decoding)."""
    vocab_map_key: str = ""
    """With a reduced draft vocabulary: the fingerprint of the dataset whose token counts built d2t/t2d."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} must be even for rotary embeddings")
        if self.architecture == "eagle1":
            if self.hidden_size != self.target_hidden_size:
                raise ValueError(
                    f"EAGLE-1 predicts target features: hidden_size ({self.hidden_size}) must equal "
                    f"target_hidden_size ({self.target_hidden_size})"
                )
            if self.draft_vocab_size not in (None, self.vocab_size):
                raise ValueError("EAGLE-1 uses the target's image head: draft_vocab_size must be null")
        if not 1 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def draft_vocab(self) -> int:
        """Vd: the vocabulary of the drafter's own head (V for EAGLE-1 and full-vocabulary EAGLE-3)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_width(self) -> int:
        """Df, the width of the target features the drafter reads."""
        return self.target_hidden_size * (self.num_aux_layers if self.architecture == "eagle3" else 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "drafter config") -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown drafter config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)
