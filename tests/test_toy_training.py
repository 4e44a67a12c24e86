"""The toy target's training script: warm-starting a target on a finer codebook."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.toy.model import TOY_GPT_CONFIG, CaptionEncoderConfig, ToyTextToImage
from models.toy.train import warm_start
from models.toy.vq import PatchVQ

SMALL = dataclasses.replace(TOY_GPT_CONFIG, dim=32, num_layers=4, multiple_of=16, caption_dim=32, aux_layer_ids=None)
ENCODER = CaptionEncoderConfig(dim=32, num_layers=1, num_heads=2)


def _save_world(folder, codebook: torch.Tensor, seed: int) -> ToyTextToImage:
    torch.manual_seed(seed)
    model = ToyTextToImage(ENCODER, dataclasses.replace(SMALL, vocab_size=codebook.shape[0]))
    vq = PatchVQ(num_codes=codebook.shape[0])
    vq.codebook.copy_(codebook)
    folder.mkdir()
    model.save(folder / "toy_target.safetensors")
    vq.save(folder / "toy_vq.safetensors")
    return model


def test_warm_start_copies_the_body_and_maps_code_rows_to_the_nearest_old_code(tmp_path):
    old_codebook = torch.rand(8, 108, generator=torch.Generator().manual_seed(0))
    new_codebook = old_codebook.repeat_interleave(2, 0) + 1e-3 * torch.randn(16, 108)  # code j sits on old j // 2
    old = _save_world(tmp_path / "old", old_codebook, seed=0)
    new_vq = PatchVQ(num_codes=16)
    new_vq.codebook.copy_(new_codebook)
    torch.manual_seed(1)
    new = ToyTextToImage(ENCODER, dataclasses.replace(SMALL, vocab_size=16))
    warm_start(new, new_vq, tmp_path / "old")
    old_state, new_state = old.state_dict(), new.state_dict()
    nearest = torch.arange(16) // 2
    for name in ("gpt.tok_embeddings.weight", "gpt.output.weight"):
        torch.testing.assert_close(new_state[name], old_state[name][nearest])
    for name, value in old_state.items():
        if value.shape[0] != 8:
            torch.testing.assert_close(new_state[name], value, msg=name)


def test_warm_start_refuses_a_target_of_another_width(tmp_path):
    _save_world(tmp_path / "old", torch.rand(8, 108), seed=0)
    vq = PatchVQ(num_codes=16)
    wider = ToyTextToImage(ENCODER, dataclasses.replace(SMALL, dim=48, vocab_size=16))
    with pytest.raises(ValueError, match=r"--init-from .*old: weight '.*' has shape"):
        warm_start(wider, vq, tmp_path / "old")


def test_warm_start_names_a_missing_source_file(tmp_path):
    model = ToyTextToImage(ENCODER, dataclasses.replace(SMALL, vocab_size=16))
    with pytest.raises(FileNotFoundError, match=r"toy_target.safetensors is missing; train it with"):
        warm_start(model, PatchVQ(num_codes=16), tmp_path)
