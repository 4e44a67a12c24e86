"""Targets by name: the one place that maps a `--target` string to an `ImageTarget`.

target = load_target("toy")                      # the embedded toy world
"""

from __future__ import annotations

from collections.abc import Callable

from models.target import ImageTarget


def _load_toy(**kwargs: object) -> ImageTarget:
    from models.toy_target import ToyTarget

    return ToyTarget.from_assets(**kwargs)  # type: ignore[arg-type]


TARGET_LOADERS: dict[str, Callable[..., ImageTarget]] = {"toy": _load_toy}


def load_target(name: str, **kwargs: object) -> ImageTarget:
    """Build the target called `name`; keyword arguments go to its loader (toy: `folder=`)."""
    if name not in TARGET_LOADERS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(sorted(TARGET_LOADERS))}")
    return TARGET_LOADERS[name](**kwargs)
