"""Targets by name: the one place that maps a `--target` string to an `ImageTarget`.

target = load_target("toy")                      # the embedded toy world
target = load_target("texture")                  # the embedded texture world (models/worlds.py lists the worlds)
target = load_target("janus-pro-7b", path="/models/Janus-Pro-7B")  # a transformers-format folder or hub id
target = load_target("llamagen-xl", gpt_checkpoint="/models/t2i_XL_stage2_512.pt",
                     vq_checkpoint="/models/vq_ds16_t2i.pt", t5_path="/models/flan-t5-xl")
target = shared_target("janus-pro-7b", {"path": "/models/Janus-Pro-7B"}, device=trainer.strategy.root_device)

Devices: a loader without `device=` builds on the CPU. Training passes the trainer's root device
(`shared_target(..., device=...)`, one instance per process and device); scripts run outside Lightning
use `load_target_for_process`, which puts a real checkpoint on this process's GPU (`process_device()`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import torch

from models.checkpoint_identity import resolve_path
from models.target import ImageTarget
from models.transformers_decoder import process_device
from models.worlds import embedded_world


def _load_toy(folder: Any = None, device: Any = None) -> ImageTarget:
    from models.toy import ASSETS, ToyTarget

    return ToyTarget.from_assets(folder or ASSETS, device)


def _load_texture(folder: Any = None, device: Any = None) -> ImageTarget:
    from models.texture import ASSETS, TextureTarget

    return TextureTarget.from_assets(folder or ASSETS, device)


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
    "texture": _load_texture,
    "janus-pro-7b": _load_janus_pro_7b,
    "llamagen-xl": _load_llamagen_xl,
    "lumina-mgpt-7b": _load_lumina_mgpt_7b,
}


def load_target(name: str, **kwargs: object) -> ImageTarget:
    """Build the target called `name`; keyword arguments go to its loader.

    Without `device=` every target is built on the CPU.

    toy, texture: `folder=`, `device=`; janus-pro-7b: `path=` (local folder or hub id; None = $JANUS_PRO_PATH, else the
    hub id; lumina-mgpt-7b likewise with $LUMINA_MGPT_PATH), `dtype=`, `device=` and
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


def process_target_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Loader options for a script launched outside Lightning, one process per GPU (torchrun, srun, or alone).

    A real checkpoint without `device` gets this process's GPU (`process_device()`: cuda:<local rank>) when CUDA
    is available; the embedded worlds (toy, texture) and random weights keep the CPU default (a GPU only when
    `device` names one).
    """
    keeps_cpu = embedded_world(name) is not None or options.get("random_weights")
    if "device" in options or keeps_cpu or not torch.cuda.is_available():
        return dict(options)
    return {**options, "device": process_device()}


def load_target_for_process(name: str, **kwargs: Any) -> ImageTarget:
    """`load_target` for a script launched outside Lightning: see `process_target_options`."""
    return load_target(name, **process_target_options(name, kwargs))


def target_device(options: dict[str, Any] | None, device: torch.device | str | None) -> torch.device | None:
    """The device a shared target loads on: the caller's `device` (a trainer's root device) and the loader
    options' own `device`, reconciled.

    An explicit `options["device"]` wins when it can work beside the trainer: the same device, or the same
    type without an index ("cuda" under a trainer on cuda:3 means cuda:3). None when neither names one (the CPU).

    Raises:
        ValueError: when the options name another device than the trainer's (the drafter trains on the trainer's
            device and reads the target's embedding and head there, so both must sit on one device).
    """
    explicit = (options or {}).get("device")
    if device is None:
        return None if explicit is None else torch.device(explicit)
    given = torch.device(device)
    if explicit is None:
        return given
    wanted = torch.device(explicit)
    if wanted.type == given.type and wanted.index in (None, given.index):
        return given
    raise ValueError(
        f"target_options.device={explicit!r} contradicts this process's trainer device {given}: the drafter trains "
        f"on {given} and reads the target's embedding and head there, so the target must sit on {given} too. Drop "
        "target_options.device (the trainer places the target on each rank's device), or give the trainer that "
        "device (trainer.accelerator / trainer.devices)"
    )


def shared_target(
    name: str, options: dict[str, Any] | None = None, device: torch.device | str | None = None
) -> ImageTarget:
    """One target instance per process, name, loader options and device, shared by the DataModule and the
    LightningModule (and the callbacks that read `DrafterSystem.frozen_target`).

    Args:
        name: registry name.
        options: the loader's keyword arguments (`target_options`).
        device: where the caller needs the target: the trainer passes its root device
            (`trainer.strategy.root_device`, cuda:<local rank> under torchrun and srun alike); None = the
            options' `device`, else the CPU. See `target_device` for how the two are reconciled.
    """
    placed = target_device(options, device)
    resolved = {**(options or {}), **({} if placed is None else {"device": str(placed)})}
    return _shared_target(name, json.dumps(resolved, sort_keys=True))


@functools.cache
def _shared_target(name: str, options: str) -> ImageTarget:
    return load_target(name, **json.loads(options))


shared_target.cache_clear = _shared_target.cache_clear  # type: ignore[attr-defined]
