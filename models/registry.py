"""Targets by name: the one place that maps a `--target` string to an `ImageTarget`.

target = load_target("toy")                      # the embedded toy world
target = load_target("janus-pro-7b", path="/models/Janus-Pro-7B")  # a transformers-format folder or hub id
"""

from __future__ import annotations

from collections.abc import Callable

from models.target import ImageTarget


def _load_toy(**kwargs: object) -> ImageTarget:
    from models.toy_target import ToyTarget

    return ToyTarget.from_assets(**kwargs)  # type: ignore[arg-type]


def _load_janus_pro_7b(path: str | None = None, dtype: object = None, device: object = None,
                       **kwargs: object) -> ImageTarget:  # fmt: skip
    from models.janus import DEFAULT_HUB_ID, JanusTarget

    return JanusTarget.from_pretrained(path or DEFAULT_HUB_ID, dtype, device, **kwargs)  # type: ignore[arg-type]


TARGET_LOADERS: dict[str, Callable[..., ImageTarget]] = {"toy": _load_toy, "janus-pro-7b": _load_janus_pro_7b}


def load_target(name: str, **kwargs: object) -> ImageTarget:
    """Build the target called `name`; keyword arguments go to its loader.

    toy: `folder=`; janus-pro-7b: `path=` (local folder or hub id), `dtype=`, `device=` and
    `JanusTarget` options (`max_prompt_tokens=`, ...).
    """
    if name not in TARGET_LOADERS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(sorted(TARGET_LOADERS))}")
    return TARGET_LOADERS[name](**kwargs)
