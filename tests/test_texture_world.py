"""The texture world: its caption grammar and held-out split, deterministic drawing, and a tiny target end to end."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from inference.decoding.autoregressive import generate_ar
from inference.measure.world_calibrate import token_statistics
from models.texture import (
    IMAGE_SIZE,
    TextureTarget,
    network_from_checkpoint,
    parse_texture_caption,
    render_texture_dataset,
    texture_caption,
    texture_captions,
)
from models.texture.model import TEXTURE_GPT_CONFIG, texture_network
from models.texture.reader import READER_FILE, TextureSceneReader
from models.texture.scenes import (
    FREQUENCY_BANDS,
    render_texture_dataset_with_coverage,
    render_texture_scene,
    texture_field,
)
from models.texture.target import TARGET_FILE
from models.texture.train import (
    PARTIAL_FILE,
    TargetRun,
    check_texture_reader,
    train_texture_target,
    train_texture_vq,
)
from models.texture.world import MAX_CAPTION_WORDS, TEXTURE_COLOURS, TEXTURES, WORDS, TextureScene
from models.toy import COLOURS, PatchVQ, ShapeSpec, is_held_out

TINY_GPT = dataclasses.replace(
    TEXTURE_GPT_CONFIG, dim=16, caption_dim=16, num_layers=4, multiple_of=16, aux_layer_ids=None
)


def test_captions_parse_back_and_respect_the_held_out_split():
    train, held_out = texture_captions(300, seed=3), texture_captions(40, seed=3, split="heldout")
    assert not any(is_held_out(c) for c in train) and all(is_held_out(c) for c in held_out)
    for caption in train + held_out:
        assert texture_caption(parse_texture_caption(caption)) == caption
        words = caption.split()
        assert len(words) <= MAX_CAPTION_WORDS and set(words) <= set(WORDS), caption
    share = np.mean([is_held_out(c) for c in texture_captions(2000, seed=4, split="any")])
    assert 0.03 < share < 0.08  # one caption in 20


def test_bad_captions_and_scenes_name_the_problem():
    with pytest.raises(ValueError, match=r"does not end with 'on <fine\|coarse> <tone> <texture>'"):
        parse_texture_caption("a small red circle at the top left on a plain blue background")
    with pytest.raises(ValueError, match=r"unknown texture 'velvet'; the texture world knows clouds"):
        TextureScene((ShapeSpec("red", "circle", "small", "top"),), "velvet", "fine", "grey")
    with pytest.raises(ValueError, match="two objects share a position"):
        TextureScene((ShapeSpec("red", "circle", "small", "top"),) * 2, "wood", "fine", "grey")


def test_scenes_are_fixed_by_the_seed_and_objects_are_drawn_where_and_how_the_caption_says():
    captions, images = render_texture_dataset(6, seed=11)
    again_captions, again = render_texture_dataset(6, seed=11)
    assert captions == again_captions and np.array_equal(images, again)
    assert images.shape == (6, IMAGE_SIZE, IMAGE_SIZE, 3) and images.dtype == np.uint8
    assert not np.array_equal(images, render_texture_dataset(6, seed=12)[1])
    scene = TextureScene((ShapeSpec("red", "square", "large", "center"),), "sand", "fine", "blue")
    pixels = render_texture_scene(scene, np.random.default_rng(0)).astype(float)
    core = pixels[20:28, 20:28].mean(axis=(0, 1))  # the middle of the centre cell: the square, shaded
    red = np.asarray(COLOURS["red"], dtype=float)
    assert np.dot(core, red) / (np.linalg.norm(core) * np.linalg.norm(red)) > 0.98
    corner = pixels[:8, :8].mean(axis=(0, 1))  # texture only: bluish grey
    assert corner[2] > corner[0]


def test_textures_are_smooth_at_coarse_scale_and_vary_from_image_to_image():
    """Codes must depend on their neighbours: neighbouring texture pixels correlate, and each image draws its own
    frequency and phase, so two draws of one caption differ."""
    low, high = FREQUENCY_BANDS["coarse"]
    for texture in ("clouds", "marble", "wood"):
        field = texture_field(texture, (low + high) / 2, 0.3, np.random.default_rng(1), IMAGE_SIZE)
        neighbour = np.corrcoef(field[:, :-1].ravel(), field[:, 1:].ravel())[0, 1]
        assert neighbour > 0.7, (texture, neighbour)
    scene = TextureScene((ShapeSpec("red", "circle", "small", "top"),), "clouds", "coarse", "grey")
    first, second = (render_texture_scene(scene, np.random.default_rng(seed)) for seed in (0, 1))
    assert np.abs(first[32:].astype(float) - second[32:].astype(float)).mean() > 5


def test_fine_detail_is_shared_across_neighbouring_pixels_not_drawn_per_pixel():
    """A patch's spread over near-duplicate codes must depend on its context: the detail left after removing the
    smooth texture (pixel minus its 5 x 5 mean) is coherent over neighbouring pixels, where independent per-pixel
    grain would leave neighbours uncorrelated (or anti-correlated, after the mean is removed)."""
    for texture in TEXTURES:
        scene = TextureScene((ShapeSpec("red", "circle", "small", "top left"),), texture, "coarse", "grey")
        grey = render_texture_scene(scene, np.random.default_rng(3)).astype(float).mean(-1)[16:, 16:]  # no object
        smooth = np.lib.stride_tricks.sliding_window_view(np.pad(grey, 2, mode="edge"), (5, 5)).mean((-1, -2))
        detail = grey - smooth
        neighbour = np.corrcoef(detail[:, :-1].ravel(), detail[:, 1:].ravel())[0, 1]
        # granite's crystals are single pixels drawn independently (its speckle), so less of its detail is shared;
        # independent per-pixel grain alone scores about -0.03 here
        assert neighbour > (0.15 if texture == "granite" else 0.3), (texture, neighbour)
        assert detail.std() > 4.0, (texture, detail.std())  # and it is strong enough to move a patch's code


def test_plain_background_draws_the_same_objects_over_the_flat_tone():
    """The first training stage's images: the same draws, so the same objects in the same places, and the
    captioned tone where no object or shadow falls."""
    textured = render_texture_dataset_with_coverage(6, seed=4, split="train")
    plain = render_texture_dataset_with_coverage(6, seed=4, split="train", background="plain")
    assert textured[0] == plain[0]
    np.testing.assert_array_equal(textured[2], plain[2])  # object coverage
    for caption, image, covered in zip(plain[0], plain[1], plain[2], strict=True):
        tone = TEXTURE_COLOURS[parse_texture_caption(caption).tone]
        background = image[covered == 0].reshape(-1, 3)
        colours, counts = np.unique(background, axis=0, return_counts=True)
        assert tuple(colours[counts.argmax()]) == tone, caption
        assert counts.max() > 0.5 * len(background)
    with pytest.raises(ValueError, match="unknown background 'grass'; use one of texture, plain"):
        render_texture_dataset(1, seed=0, background="grass")


def _tiny_world(folder, steps: int, max_minutes: float | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    vq = train_texture_vq(folder, seed=0, num_codes=32, num_images=20, iterations=3)
    run = TargetRun(steps, batch_size=2, warmup=2, gpt_config=TINY_GPT, eval_every=3, checkpoint_every=2)
    return vq, train_texture_target(folder, vq, run, max_minutes=max_minutes)


def test_target_training_resumes_to_the_same_weights_and_loads_as_a_target(tmp_path):
    _, straight = _tiny_world(tmp_path / "straight", steps=4)
    assert straight is not None and not (tmp_path / "straight" / PARTIAL_FILE).exists()
    vq, stopped = _tiny_world(tmp_path / "resumed", steps=4, max_minutes=0.0)  # stops after one step
    assert stopped is None
    partial = network_from_checkpoint(tmp_path / "resumed" / PARTIAL_FILE)
    assert partial.gpt.config.vocab_size == 32
    _, resumed = _tiny_world(tmp_path / "resumed", steps=4)
    assert resumed is not None
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    target = TextureTarget.from_assets(tmp_path / "resumed")
    assert target.name == "texture" and target.geometry.num_tokens == 144
    # a second round starts from finished weights (at learning rate 0 they stay as they were)
    second = TargetRun(1, batch_size=2, lr=0.0, warmup=1, seed=5, gpt_config=TINY_GPT)
    again = train_texture_target(tmp_path / "round2", vq, second, init_from=tmp_path / "resumed" / TARGET_FILE)
    assert again is not None
    for (name, a), (_, b) in zip(resumed.state_dict().items(), again.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_a_round_can_start_from_a_target_of_a_smaller_codebook(tmp_path):
    """`--init-from FOLDER`: the body is copied, and each new code's rows come from the old code nearest to it."""
    old_vq, old = _tiny_world(tmp_path / "small", steps=2)
    assert old is not None
    noise = 1e-4 * torch.randn(64, old_vq.codebook.shape[1], generator=torch.Generator().manual_seed(0))
    vq = PatchVQ(num_codes=64, patch=4, image_size=IMAGE_SIZE)
    vq.codebook.copy_(old_vq.codebook.repeat_interleave(2, 0) + noise)  # new code j sits on old code j // 2
    run = TargetRun(1, batch_size=2, lr=0.0, warmup=1, seed=5, gpt_config=TINY_GPT)
    new = train_texture_target(tmp_path / "large", vq, run, init_from=tmp_path / "small")
    assert new is not None and new.gpt.config.vocab_size == 64
    old_state, new_state = old.state_dict(), new.state_dict()
    for name, value in old_state.items():
        by_code = new_state[name].shape[0] == 64 and value.shape[0] == 32  # token embedding, output head
        expected = value[torch.arange(64) // 2] if by_code else value
        torch.testing.assert_close(new_state[name], expected, msg=name)


def test_reader_check_scores_the_folders_reader_on_held_out_ground_truth(tmp_path, capsys, monkeypatch):
    vq, _ = _tiny_world(tmp_path, steps=1)
    with pytest.raises(SystemExit, match="texture_reader.safetensors is missing; train it with --stage reader"):
        check_texture_reader(tmp_path, vq, seed=0, count=8)
    TextureSceneReader().save(tmp_path / READER_FILE)
    seen = []

    def share_of_circles(captions) -> float:
        return sum(" circle" in c for c in captions) / len(captions)

    def stand_in(reader, pixels, captions):  # a score that says which scenes were read
        seen.append(tuple(pixels.shape))
        return share_of_circles(captions)

    monkeypatch.setattr(TextureSceneReader, "fidelity", stand_in)
    clean, through_vq = check_texture_reader(tmp_path, vq, seed=0, background="plain", count=8)
    captions, _ = render_texture_dataset(8, seed=99, split="heldout", background="plain")  # seed + 99, held out
    assert clean == through_vq == share_of_circles(captions)
    assert seen[:2] == [(8, IMAGE_SIZE, IMAGE_SIZE, 3)] * 2  # clean, then through the VQ
    assert "(plain background)" in capsys.readouterr().out


def test_object_coverage_comes_with_the_same_pixels_and_marks_the_object_tokens():
    from models.texture.scenes import render_texture_dataset_with_coverage, render_texture_scene_with_coverage
    from models.texture.train import object_token_weights
    from models.toy.vq import image_to_patches

    scene = TextureScene((ShapeSpec("red", "square", "large", "center"),), "wood", "coarse", "grey")
    pixels, coverage = render_texture_scene_with_coverage(scene, np.random.default_rng(3))
    np.testing.assert_array_equal(pixels, render_texture_scene(scene, np.random.default_rng(3)))
    assert coverage[24, 24] == 1.0 and coverage[0, 0] == 0.0 and coverage.dtype == np.float32
    captions, images, covered = render_texture_dataset_with_coverage(4, seed=11)
    plain_captions, plain_images = render_texture_dataset(4, seed=11)
    assert captions == plain_captions
    np.testing.assert_array_equal(images, plain_images)

    weights = object_token_weights(torch.from_numpy(covered), patch=4, object_weight=5.0)  # (4, 144)
    share = image_to_patches(torch.from_numpy(covered)[..., None], 4).mean(-1)  # (4, 144), the VQ's token order
    torch.testing.assert_close(weights, torch.where(share >= 0.25, 5.0, 1.0))
    assert 0 < (weights == 5.0).float().mean() < 0.5  # objects are some of the tokens, not most


def test_weighted_target_loss_is_the_weighted_mean_of_the_token_cross_entropies():
    import torch.nn.functional as F

    from models.toy.train import target_loss

    torch.manual_seed(0)
    network = texture_network(32, TINY_GPT).eval()
    captions = ["a small red circle at the top left on fine grey sand"] * 2
    tokens = torch.randint(0, 32, (2, 144))
    weights = torch.ones(2, 144)
    weights[:, :20] = 4.0

    def loss(w):
        return target_loss(network, captions, tokens, 0.0, torch.Generator().manual_seed(0), w)

    torch.testing.assert_close(loss(torch.ones(2, 144)), loss(None))
    features, valid = network.caption_features(captions)
    per_token = F.cross_entropy(network(features, valid, tokens).flatten(0, 1), tokens.flatten(), reduction="none")
    torch.testing.assert_close(loss(weights), (weights.flatten() * per_token).sum() / weights.sum())
    assert not torch.allclose(loss(weights), loss(None))


def test_tiny_target_samples_images_and_the_calibration_reads_the_distributions_it_drew_from(tmp_path):
    vq, network = _tiny_world(tmp_path, steps=2)
    target = TextureTarget(network, vq)
    prompts = texture_captions(3, seed=0, split="heldout")
    generation = generate_ar(target, prompts, generator=torch.Generator().manual_seed(0))
    assert generation.tokens.shape == (3, 144)
    assert target.decode_images(generation.tokens).shape == (3, IMAGE_SIZE, IMAGE_SIZE, 3)
    settings = dataclasses.replace(target.sampling, top_k=8)
    stats, tokens = token_statistics(target, prompts, settings, seed=0, batch_size=2)
    assert tokens.shape == (3, 144)
    # the one-pass recomputation agrees with what AR decoding measured step by step
    assert stats["mean_entropy"] == pytest.approx(stats["ar_mean_entropy"], abs=1e-3)
    assert 0 < stats["mean_entropy"] <= np.log(8) + 1e-4
    assert 0 <= stats["share_top1_below_0.05"] <= 1 and stats["mean_top1"] >= 1 / 8


def test_scene_reader_labels_every_attribute_and_a_match_needs_all_of_them():
    from models.texture.reader import TextureSceneReader

    captions = [
        "a large red circle at the top left and a small blue square in the center on coarse brown wood",
        "a small green triangle at the bottom right on fine grey marble",
    ]
    reader = TextureSceneReader()
    labels = reader.labels(captions)
    assert labels["present"].tolist() == [[1, 0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 1]]
    assert labels["colour"][0, 0] == 0 and labels["shape"][1, 8] == 2 and labels["size"][0, 4] == 0
    assert labels["colour"][0, 1] == -100  # nothing at the top centre: its attributes are ignored
    assert labels["texture"].tolist() == [2, 1] and labels["scale"].tolist() == [1, 0]
    assert labels["tone"].tolist() == [0, 1]
    logits = reader(torch.zeros(2, IMAGE_SIZE, IMAGE_SIZE, 3, dtype=torch.uint8))
    assert logits["present"].shape == (2, 9, 2) and logits["shape"].shape == (2, 9, 3)
    assert logits["texture"].shape == (2, 5) and logits["tone"].shape == (2, 4)
    assert reader.embed(torch.zeros(2, IMAGE_SIZE, IMAGE_SIZE, 3, dtype=torch.uint8)).shape == (2, 256)
    assert torch.isfinite(reader.loss(torch.zeros(2, IMAGE_SIZE, IMAGE_SIZE, 3, dtype=torch.uint8), labels))

    images = torch.zeros(2, IMAGE_SIZE, IMAGE_SIZE, 3, dtype=torch.uint8)
    perfect = {name: value.clamp_min(0) for name, value in labels.items()}  # what the captions say, read back
    reader.read = lambda _images: perfect  # type: ignore[method-assign]
    assert reader.matches(images, captions).tolist() == [True, True]
    for name, row, cell in (("tone", 1, None), ("colour", 0, 4), ("shape", 1, 8), ("present", 0, 2)):
        wrong = {key: value.clone() for key, value in perfect.items()}
        if cell is None:
            wrong[name][row] += 1
        else:
            wrong[name][row, cell] = 1 - wrong[name][row, cell] if name == "present" else wrong[name][row, cell] + 1
        reader.read = lambda _images, wrong=wrong: wrong  # type: ignore[method-assign]
        assert reader.matches(images, captions)[row].item() is False, name
        assert reader.matches(images, captions)[1 - row].item() is True, name
    errors = reader.attribute_errors(images, captions)
    assert errors["spurious"] == 0.5 and errors["tone"] == 0.0  # the last planted error: a spurious object
    wrong = {key: value.clone() for key, value in perfect.items()}
    wrong["texture"][0], wrong["scale"][1] = 4, 1  # the texture's kind and scale are reported, not matched
    reader.read = lambda _images: wrong  # type: ignore[method-assign]
    assert reader.matches(images, captions).tolist() == [True, True]
    assert reader.attribute_errors(images, captions)["texture"] == 0.5


def test_calibration_command_prints_entropy_fidelity_and_lossless_tau_and_writes_the_fitted_trees(tmp_path, capsys):
    import json

    from inference.measure import world_calibrate
    from models.eagle import EagleDraftModel, drafter_preset
    from models.texture.reader import READER_FILE, TextureSceneReader

    _tiny_world(tmp_path, steps=2)
    TextureSceneReader().save(tmp_path / READER_FILE)  # an untrained reader: fidelity is measured, not good
    torch.manual_seed(0)
    config = drafter_preset("tiny", "eagle1", hidden_size=16, target_hidden_size=16, intermediate_size=32,
                            vocab_size=32, target="texture")  # fmt: skip
    drafter = EagleDraftModel(config).save_pretrained(tmp_path / "drafter")
    out = tmp_path / "calibration"
    world_calibrate.main(["--folder", str(tmp_path), "--num-prompts", "2", "--top-k", "8", "--drafter", str(drafter),
                          "--drafts", "2,3", "--dynamic", "2,2,4", "--tune-prompts", "2", "--report-prompts", "2",
                          "--out", str(out), "--threads", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "mean_entropy" in printed and "prompt_fidelity" in printed and "| accept @1 |" in printed
    record = json.loads((out / "calibration.json").read_text())
    assert record["command"][:3] == ["python", "-m", "inference.world_calibrate"]
    assert 0.0 <= record["tokens"]["prompt_fidelity"] <= 1.0 and record["tokens"]["mean_entropy"] > 0
    trees = record["drafting"]["trees"]
    assert [t["name"] for t in trees] == ["static 2", "static 3", "dynamic top-2, depth 2, 4 nodes"]
    assert all(1.0 <= t["tau"] <= 1.0 + t["depth"] for t in trees)
    fitted = json.loads((out / "static3.json").read_text())
    assert [tuple(p) for p in fitted["paths"]] == [tuple(p) for p in trees[1]["paths"]] and len(fitted["paths"]) == 3
