"""The embedded-world registry (`models.worlds`) and what it wires: prompts, readers, the texture target and preset."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

import models.texture
import models.toy
from data.prompts import PromptSetConfig, load_prompts
from inference.decoding.eagle import check_compatible
from models.checkpoint_identity import checkpoint_identity
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import TARGET_LOADERS, load_target, process_target_options
from models.texture import TextureTarget, parse_texture_caption
from models.texture.model import texture_network
from models.toy import PatchVQ, is_held_out, toy_captions
from models.worlds import EMBEDDED_WORLDS, caption_world, embedded_world, reading_world
from training.fit import check_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_toy_world_is_the_toy_packages_captions_scenes_and_reader() -> None:
    world = embedded_world("toy")
    assert world is not None and world.name == "toy" and world.image_size == models.toy.IMAGE_SIZE
    assert world.captions(12, 5, "heldout") == toy_captions(12, seed=5, split="heldout")
    captions, images = world.render_dataset(3, 2, "train")
    expected_captions, expected_images = models.toy.render_dataset(3, 2, "train")
    assert captions == expected_captions and np.array_equal(images, expected_images)
    reader, shipped = world.scene_reader(), models.toy.scene_reader()
    assert type(reader) is type(shipped)
    ours, theirs = reader.state_dict(), shipped.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_real_targets_have_no_world_and_draw_the_toys_captions() -> None:
    assert embedded_world("janus-pro-7b") is None and embedded_world("tiny-toy") is None
    assert caption_world("janus-pro-7b") is EMBEDDED_WORLDS["toy"]  # the tools' default prompts, as before
    assert caption_world("texture") is EMBEDDED_WORLDS["texture"]
    assert reading_world("tiny-toy", (36, 36)) is EMBEDDED_WORLDS["toy"]  # toy-sized test targets are read
    assert reading_world("llamagen-xl", (256, 256)) is None
    assert set(EMBEDDED_WORLDS) <= set(TARGET_LOADERS)  # every world is a registered target


def test_texture_world_captions_follow_its_grammar_and_split() -> None:
    world = embedded_world("texture")
    assert world is not None and world.image_size == models.texture.IMAGE_SIZE
    held_out = world.captions(8, 3, "heldout")
    assert held_out == models.texture.texture_captions(8, 3, "heldout")
    assert all(is_held_out(caption) for caption in held_out)
    assert not any(is_held_out(caption) for caption in world.captions(8, 3, "train"))
    for caption in held_out:
        parse_texture_caption(caption)  # raises on a caption outside the grammar
    captions, images = world.render_dataset(2, 0, "any")
    assert len(captions) == 2 and images.shape == (2, 48, 48, 3) and images.dtype == np.uint8


def test_texture_scene_reader_is_the_texture_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    world = embedded_world("texture")
    assert world is not None
    marker = object()
    monkeypatch.setattr(models.texture, "scene_reader", lambda: marker)
    assert world.scene_reader() is marker
    monkeypatch.undo()
    monkeypatch.setattr(models.texture, "ASSETS", Path("no-such-folder"))  # weights missing: a clear error
    with pytest.raises(FileNotFoundError, match="texture_reader.safetensors.*--stage reader"):
        world.scene_reader()


def test_texture_prompt_source() -> None:
    prompts = load_prompts(PromptSetConfig(source="texture", split="heldout", count=4, seed=11))
    assert [p.id for p in prompts] == [f"texture-heldout-s11:{i}" for i in range(4)]
    assert [p.text for p in prompts] == models.texture.texture_captions(4, 11, "heldout")
    with pytest.raises(ValueError, match="prompts.source=texture needs prompts.count"):
        PromptSetConfig(source="texture")


def test_texture_target_is_registered_and_names_its_missing_weights(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="texture_target.safetensors"):
        load_target("texture", folder=tmp_path)
    assert process_target_options("texture", {}) == {}  # the CPU default, like the toy
    for name in ("texture_target.safetensors", "texture_vq.safetensors"):
        (tmp_path / name).write_bytes(b"weights")
    first = checkpoint_identity("texture", {"folder": str(tmp_path)})
    (tmp_path / "texture_vq.safetensors").write_bytes(b"other weights")
    second = checkpoint_identity("texture", {"folder": str(tmp_path)})
    assert first.fingerprint is not None and first.mismatch(second) is not None  # hashed by content


def random_texture_target() -> TextureTarget:
    """The texture target's architecture with random weights (a test never needs the trained one)."""
    torch.manual_seed(0)
    return TextureTarget(texture_network(8192), PatchVQ(num_codes=8192, patch=4, image_size=48))


def test_texture_drafter_preset_fits_a_texture_target() -> None:
    target = random_texture_target()
    config = drafter_preset("texture", "eagle3")
    assert (config.hidden_size, config.target_hidden_size) == (target.hidden_size, target.hidden_size)
    assert config.vocab_size == target.image_vocab_size == 8192
    assert config.num_heads == target.network.gpt.config.num_heads
    assert embedded_world(target.name) is EMBEDDED_WORLDS["texture"]
    check_compatible(EagleDraftModel(config), target)  # what the decoder checks before drafting


def flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.0.c": leaf} of nested mappings and lists."""
    if isinstance(values, dict | list):
        items = values.items() if isinstance(values, dict) else enumerate(values)
        return {k: v for key, value in items for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): values}


def test_demo_texture_is_the_demo_recipe_for_the_texture_target() -> None:
    demo, texture = (flatten(yaml.safe_load((CONFIGS / f"{n}.yaml").read_text())) for n in ("demo", "demo_texture"))
    differing = {key for key in demo.keys() | texture.keys() if demo.get(key) != texture.get(key)}
    assert differing == {"trainer.logger.init_args.name", "model.target", "model.preset", "data.train_dir",
                         "data.extract_config"}, differing  # fmt: skip
    assert texture["model.target"] == texture["model.preset"] == "texture"
    extraction = yaml.safe_load((CONFIGS / f"{texture['data.extract_config']}.yaml").read_text())
    assert extraction["target"] == "texture" and extraction["prompts"]["source"] == "texture"
    system = check_config(["--config", "demo_texture"]).model  # parses and validates; builds nothing heavy
    check_compatible(EagleDraftModel(system.drafter_config), random_texture_target())


def test_tools_draw_and_read_with_the_targets_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference.evaluation.evaluate import read_captions
    from inference.measure.report import Quality
    from training.callbacks import DecodeValidation, held_out_prompts

    target = random_texture_target()
    assert held_out_prompts(target, 3, 7) == models.texture.texture_captions(3, 7, "heldout")
    assert read_captions("3", toy_seed=7, target="texture") == models.texture.texture_captions(3, 7, "heldout")
    assert read_captions("texture", 2, toy_seed=7) == models.texture.texture_captions(2, 7, "heldout")
    assert read_captions("3", toy_seed=7, target="janus-pro-7b") == toy_captions(3, 7, "heldout")  # as before
    monkeypatch.setattr(models.texture, "ASSETS", Path("no-such-folder"))  # no reader weights: no quality columns
    assert Quality.for_target(target) is None
    callback = DecodeValidation()
    with pytest.warns(UserWarning, match="no decode/fidelity"):
        assert callback._scene_reader(target) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not retried at every validation
        assert callback._scene_reader(target) is None
    reader = object()
    monkeypatch.setattr(models.texture, "scene_reader", lambda: reader)
    quality = Quality.for_target(target)
    assert quality is not None and quality.reader is reader
    assert DecodeValidation()._scene_reader(target) is reader
