"""The toy world: deterministic scenes, the caption grammar, the held-out split, the patch VQ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.toy_scenes import render_dataset, sample_scenes
from models.toy_world import (
    COLOUR_NAMES,
    POSITIONS,
    caption_of,
    caption_word_ids,
    is_held_out,
    parse_caption,
)
from models.vq import PatchVQ, reconstruction_error


def test_same_seed_gives_the_same_scenes_and_pixels():
    captions_a, images_a = render_dataset(32, seed=5)
    captions_b, images_b = render_dataset(32, seed=5)
    captions_c, images_c = render_dataset(32, seed=6)
    assert captions_a == captions_b and np.array_equal(images_a, images_b)
    assert captions_a != captions_c and not np.array_equal(images_a, images_c)
    assert images_a.shape == (32, 32, 32, 3) and images_a.dtype == np.uint8


def test_world_covers_its_attributes():
    scenes = sample_scenes(500, seed=0, split="any")
    colours = {s.colour for scene in scenes for s in scene.shapes}
    positions = {s.position for scene in scenes for s in scene.shapes}
    counts = {len(scene.shapes) for scene in scenes}
    assert colours == set(COLOUR_NAMES) and len(COLOUR_NAMES) >= 8
    assert positions == set(POSITIONS)
    assert counts == {1, 2, 3}


def test_caption_grammar_round_trips():
    for scene in sample_scenes(200, seed=1, split="any"):
        caption = caption_of(scene)
        assert parse_caption(caption) == scene
        assert parse_caption(caption.upper().replace(" , ", ", ")) == scene


def test_caption_example_from_the_docs_parses():
    scene = parse_caption("a small red circle at the top left on a striped blue background")
    assert [(s.size, s.colour, s.shape, s.position) for s in scene.shapes] == [("small", "red", "circle", "top left")]
    assert (scene.background, scene.background_colour) == ("striped", "blue")


@pytest.mark.parametrize(
    ("caption", "message"),
    [
        ("a red circle", "does not end with"),
        ("a small red blob at the top on a plain blue background", "unknown shape 'blob'"),
        ("two things on a plain blue background", "names no shape"),
    ],
)
def test_parse_caption_explains_what_is_wrong(caption, message):
    with pytest.raises(ValueError, match=message):
        parse_caption(caption)


def test_held_out_split_is_disjoint_from_training():
    train = {caption_of(s) for s in sample_scenes(400, seed=2, split="train")}
    held_out = {caption_of(s) for s in sample_scenes(100, seed=2, split="heldout")}
    assert not any(is_held_out(c) for c in train)
    assert all(is_held_out(c) for c in held_out)
    assert not train & held_out


def test_caption_words_are_left_padded():
    ids, length = caption_word_ids("a small red circle at the top on a plain blue background", length=16)
    assert length == 12 and len(ids) == 16
    assert ids[:4] == [0, 0, 0, 0] and 0 not in ids[4:]


def test_vq_round_trip_error_is_bounded():
    _, images = render_dataset(300, seed=3)
    vq = PatchVQ(num_codes=128, patch=4, image_size=32)
    errors = vq.fit(torch.from_numpy(images), iterations=8, seed=0)
    assert errors[-1] <= errors[0]
    _, fresh = render_dataset(64, seed=4)
    tokens = vq.encode(torch.from_numpy(fresh))
    assert tokens.shape == (64, 64) and int(tokens.max()) < 128
    assert reconstruction_error(vq, fresh) < 8.0  # mean |error| in 0..255 units, 128 codes
    assert reconstruction_error(vq, vq.decode(tokens).numpy()) == 0.0  # decoded images are fixed points


def test_shipped_vq_reconstructs_held_out_scenes(tmp_path):
    vq = PatchVQ.load("models/assets/toy_vq.safetensors")
    _, images = render_dataset(128, seed=11, split="heldout")
    assert reconstruction_error(vq, images) < 4.0
    vq.save(tmp_path / "copy.safetensors")
    torch.testing.assert_close(PatchVQ.load(tmp_path / "copy.safetensors").codebook, vq.codebook)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        vq.decode(torch.tensor([[512]]))
