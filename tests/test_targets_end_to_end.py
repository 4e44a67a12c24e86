"""Each real target family's tiny stand-in runs the whole pipeline: extraction into shards, a few
training steps of an EAGLE-3 drafter through Lightning, and tree decoding with that drafter that
reproduces greedy AR (the same code paths the 7B targets take on GPUs)."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from conftest import build_tiny_toy_target
from test_target_janus import build_tiny_janus
from test_target_llamagen_t2i import build_target as build_tiny_llamagen
from test_target_lumina import GRID, build_tiny_lumina, tiny_decoder

from data.drafter_data import DrafterDataModule
from data.extract import ExtractConfig, run_extraction
from data.prompts import PromptSetConfig
from inference.decoding.autoregressive import generate_ar
from inference.decoding.eagle import EagleDrafter
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.verify import ExactRule
from models import registry
from models.janus import JanusTarget
from models.lumina import LuminaTarget
from models.registry import shared_target
from training.objective import ObjectiveConfig
from training.system import DrafterSystem, OptimizerConfig


def tiny_janus() -> JanusTarget:
    model, tokenizer = build_tiny_janus()
    return JanusTarget(model, tokenizer, name="tiny-janus", max_prompt_tokens=48, aux_layer_ids=(1, 2, 3))


def tiny_lumina() -> LuminaTarget:
    model, tokenizer = build_tiny_lumina()
    return LuminaTarget(model, tokenizer, name="tiny-lumina", grid=GRID, max_prompt_tokens=48,
                        aux_layer_ids=(1, 2, 3), vq_decoder=tiny_decoder(model))  # fmt: skip


FAMILIES = {
    "tiny-toy": build_tiny_toy_target,  # LlamaGen architecture, toy captions
    "tiny-janus": tiny_janus,  # transformers' Janus
    "tiny-llamagen": build_tiny_llamagen,  # LlamaGen t2i with a T5 encoder and the VQ-16 decoder
    "tiny-lumina": tiny_lumina,  # transformers' Chameleon, end-of-line layout enforced
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_extract_train_and_decode_on_a_tiny_stand_in(name, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.TARGET_LOADERS, name, lambda **kwargs: FAMILIES[name]())
    shared_target.cache_clear()
    try:
        target = shared_target(name)
        config = ExtractConfig(out_dir=str(tmp_path / "shards"), prompts=PromptSetConfig(source="toy", count=8),
                               samples_per_shard=4, batch_size=4, seed=1, store_aux=True,
                               store_uncond=True)  # fmt: skip
        assert run_extraction(config, target=target, rank=0, world_size=1, progress=False) is not None
        drafter = {"hidden_size": target.hidden_size, "target_hidden_size": target.hidden_size,
                   "vocab_size": target.image_vocab_size, "num_heads": 2, "num_kv_heads": 2,
                   "intermediate_size": 64}  # fmt: skip
        system = DrafterSystem(target=name, architecture="eagle3", preset="tiny", drafter=drafter,
                               objective=ObjectiveConfig(ttt_steps=2, cfg_loss_weight=1.0),
                               optimizer=OptimizerConfig(lr=1e-2))  # fmt: skip
        data = DrafterDataModule(train_dir=config.out_dir, num_val_shards=1, batch_size=2, target=name,
                                 load_uncond=True)  # fmt: skip
        trainer = L.Trainer(accelerator="cpu", max_steps=3, val_check_interval=3, check_val_every_n_epoch=None,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        trainer.fit(system, datamodule=data)
        assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["val/tau_sim"])

        settings = dataclasses.replace(target.sampling, temperature=0.0)
        prompts = ["a small red circle at the top left on a plain blue background"]
        tree = DecoderConfig(tree="dynamic", top_k=2, depth=3, total_tokens=6)
        result = generate_speculative(
            target, EagleDrafter(system.drafter, target), prompts, ExactRule(), tree, settings
        )
        assert torch.equal(result.tokens, generate_ar(target, prompts, settings).tokens)
    finally:
        shared_target.cache_clear()
