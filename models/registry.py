"""Targets by name: the one place that maps a `--target` string to an `ImageTarget`.

target = load_target("toy")                      # the embedded toy world
target = load_target("janus-pro-7b", path="/models/Janus-Pro-7B")  # a transformers-format folder or hub id
target = load_target("llamagen-xl", gpt_checkpoint="/models/t2i_XL_stage2_512.pt",
                     vq_checkpoint="/models/vq_ds16_t2i.pt", t5_path="/models/flan-t5-xl")
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from models.checkpoint_identity import resolve_path
from models.target import ImageTarget


def _load_toy(**kwargs: object) -> ImageTarget:
    from models.toy import ToyTarget

    return ToyTarget.from_assets(**kwargs)  # type: ignore[arg-type]


def _load_janus_pro_7b(path: str | None = None, dtype: object = None, device: object = None,
                       **kwargs: object) -> ImageTarget:  # fmt: skip
    from models.janus import JanusTarget

    path = resolve_path("janus-pro-7b", path)  # None: $JANUS_PRO_PATH, else the hub id
    return JanusTarget.from_pretrained(path, dtype, device, **kwargs)  # type: ignore[arg-type]


def _load_llamagen_xl(gpt_checkpoint: str | None = None, vq_checkpoint: str | None = None, t5_path: str | None = None,
                      preset: Any = None, dtype: Any = None, device: Any = None,
                      **kwargs: Any) -> ImageTarget:  # fmt: skip
    from models.llamagen_t2i import LlamaGenT2ITarget

    return LlamaGenT2ITarget.from_pretrained(gpt_checkpoint, vq_checkpoint, t5_path, preset, dtype, device, **kwargs)


def _load_lumina_mgpt_7b(path: str | None = None, dtype: object = None, device: object = None,
                         **kwargs: object) -> ImageTarget:  # fmt: skip
    from models.lumina import LuminaTarget

    path = resolve_path("lumina-mgpt-7b", path)  # None: $LUMINA_MGPT_PATH, else the hub id
    return LuminaTarget.from_pretrained(path, dtype, device, **kwargs)  # type: ignore[arg-type]


TARGET_LOADERS: dict[str, Callable[..., ImageTarget]] = {
    "toy": _load_toy,
    "janus-pro-7b": _load_janus_pro_7b,
    "llamagen-xl": _load_llamagen_xl,
    "lumina-mgpt-7b": _load_lumina_mgpt_7b,
}


def load_target(name: str, **kwargs: object) -> ImageTarget:
    """Build the target called `name`; keyword arguments go to its loader.

    toy: `folder=`; janus-pro-7b: `path=` (local folder or hub id; None = $JANUS_PRO_PATH, else the hub id;
    lumina-mgpt-7b likewise with $LUMINA_MGPT_PATH), `dtype=`, `device=` and
    `JanusTarget` options (`max_prompt_tokens=`, ...); llamagen-xl: `gpt_checkpoint=`, `vq_checkpoint=`,
    `t5_path=`, `preset=` ("t2i-XL-stage1" / "t2i-XL-stage2"), `dtype=`, `device=`, `folder=` and
    `LlamaGenT2ITarget` options (`sampling=` "official" / "lantern", ...); unnamed files come from
    $LLAMAGEN_DIR (default `pretrained_models`) or the hub.

    Every real target also takes `random_weights="real"` or `"tiny"`: the architecture at its released
    (or a tiny) size with random weights and a stand-in tokenizer, nothing loaded or downloaded
    (`models.random_weights`; `dtype=` and `device=` still apply, other options are ignored). It sizes
    GPU latency checks and dry-runs real configs on a CPU, e.g. `--model.target_options '{random_weights: tiny}'`.
    """
    if name not in TARGET_LOADERS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(sorted(TARGET_LOADERS))}")
    random_weights = kwargs.pop("random_weights", None)
    if random_weights:
        from models.random_weights import random_target

        return random_target(name, random_weights, kwargs.get("dtype"), kwargs.get("device"))  # type: ignore[arg-type]
    return TARGET_LOADERS[name](**kwargs)


def shared_target(name: str, options: dict[str, Any] | None = None) -> ImageTarget:
    """One target instance per process, name and loader options, shared by the DataModule and the LightningModule."""
    return _shared_target(name, json.dumps(options or {}, sort_keys=True))


@functools.cache
def _shared_target(name: str, options: str) -> ImageTarget:
    return load_target(name, **json.loads(options))


shared_target.cache_clear = _shared_target.cache_clear  # type: ignore[attr-defined]
