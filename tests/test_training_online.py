"""Online features equal offline ones: token-only shards plus the target's teacher-forced forward in the training step.

On every target family's tiny stand-in (the toy's LlamaGen, transformers' Janus and Chameleon/Lumina,
LlamaGen t2i with T5), one small extraction is made twice from the same recipe and seed: `features:
full` (tokens and float16 states) and `features: tokens`. Then:

- the two hold the same tokens and prompts, sample for sample;
- the streams the training step computes online (from either folder) equal the stored ones within
  the float16 tolerance below, and the same comparison fails when the online forward sees the image
  tokens shifted by one position (the mutation the tolerance must catch);
- a few Lightning training steps from one seed give equal losses, offline against online.

Tolerance of the streams: extraction computes in float32 and rounds to float16, whose round-to-nearest
error is at most 2^-11 |x| for normal values; the online forward runs the same float32 computation
once more, but batched differently (other rows, other padding, no logits), which moves values by
float32 rounding, about 1e-6 of the row's magnitude. So |online - stored| <= 2^-11 |online| + 1e-5
max|online| holds, and a shifted sequence misses it by orders of magnitude.

The same tests run each family in bfloat16 as well (ids "...-bf16": the GPU's dtype, on the CPU), with
this tolerance. bfloat16 keeps 8 significant bits, a unit roundoff u = 2^-8 (3.9e-3) per rounded op.
Stored and online streams are the same bfloat16 computation batched differently; where the batching
changes an op's float32 accumulation order, its two results can round to neighbouring bfloat16
values, one ulp = 2u apart, relative to that op's output. So a stream differs by at most 2u |x| from
its own last rounding, plus what earlier flips carry: each layer adds two sublayer outputs (attention,
MLP) to the residual stream, each at most max|x| in size on these targets, each off by at most 2u of
it; through layers of about unit gain that is 2 x 2u x max|x| per layer, 4 layers for every tiny family.
Float16 storage of a bfloat16 value is exact (fewer bits, same range here). Hence
|online - stored| <= 2u |online| + 16 u max|online| = 2^-7 |online| + 2^-4 max|online|: loose (the CPU
computes it exactly alike, difference 0), yet the shifted-token mutation moves every stream by more
than max|x| and still fails it.

The online step does only the work it reads: the unconditional rows run only for the samples the
objective reads (every one with cfg_loss_weight, the swapped ones with uncond_rate), in one cacheless
causal pass; the streams of that pass equal the decode path's (`decode_cache=True`, every row) within
the batching tolerance (float32) or the bfloat16 one, and a training run with uncond_rate gives the
same losses online (the swap drawn before the forward) as offline (drawn by the objective).

Tolerance of the losses: the drafter reads inputs that differ by that float16 rounding (relative
2^-11 at most, zero-mean), which averages out over a batch's thousands of elements: the first
step's losses differ by at most 4e-6 relative on the four families (measured; `FIRST_LOSS_RTOL`
allows 1e-5). Later steps add AdamW's sensitivity: its first updates are nearly lr x sign(gradient),
so a gradient entry near zero can flip sign with the inputs' rounding; measured at lr 3e-3, the
tiny LlamaGen's steps 1-2 differ by 3e-4 relative (the others by at most 2e-6), and at lr 1e-2 by
1.6e-3. `LOSS_RTOL` allows 1e-3 at lr 3e-3, while every step moves the loss by more than 5e-3
relative (checked), so a run that diverged or stood still would fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_targets_end_to_end import FAMILIES

import training.online_features as online_features
import training.system as system_module
from data.data_config import DataConfig
from data.datamodule import FeatureDataModule
from data.disk import SampleShape, sample_bytes
from data.drafter_data import DrafterDataModule
from data.extract import ExtractConfig, run_extraction
from data.prompts import PromptSetConfig
from data.shards import ManifestError, load_manifest
from inference.measure.pipeline.training_bench import TrainingBatchTimer
from models import registry
from models.registry import shared_target
from models.target import teacher_forced_states
from training.objective import ObjectiveConfig, drafter_objective
from training.online_features import fill_online_features
from training.system import DrafterSystem, OptimizerConfig

STREAMS = ("hidden", "aux", "uncond_hidden", "uncond_aux")
FLOAT16_RTOL = 2.0**-11  # float16 round-to-nearest, relative
BATCHING_ATOL = 1e-5  # float32 rounding of a differently batched forward, relative to the stream's magnitude
BF16_UNIT_ROUNDOFF = 2.0**-8  # u: bfloat16's 8 significant bits, relative error of one rounded op
TINY_LAYERS = 4  # decoder layers of every tiny family (the streams read at most this deep)
BF16_RTOL = 2 * BF16_UNIT_ROUNDOFF  # one ulp of the stream's own last rounding
BF16_ATOL = TINY_LAYERS * 2 * 2 * BF16_UNIT_ROUNDOFF  # per layer two sublayer outputs, one ulp of max|x| each
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
FIRST_LOSS_RTOL = 1e-5
LOSS_RTOL = 1e-3
STEPS = 3


def extract(target: Any, out_dir: Path, features: str) -> Path:
    config = ExtractConfig(out_dir=str(out_dir), prompts=PromptSetConfig(source="toy", count=8), samples_per_shard=4,
                           batch_size=4, seed=1, store_aux=True, store_uncond=True, features=features)  # fmt: skip
    assert run_extraction(config, target=target, rank=0, world_size=1, progress=False) is not None
    return out_dir


def build_family(name: str, dtype: torch.dtype) -> Any:
    """The tiny stand-in `name` built in `dtype`, as `models.random_weights` builds targets: parameters and the
    buffers made in the default dtype take `dtype`, buffers made in float32 on purpose (rotary tables) stay."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return FAMILIES[name]()
    finally:
        torch.set_default_dtype(previous)


def tolerances(target: Any) -> tuple[float, float]:
    """(relative, of-max) tolerance of a stream computed twice, batched differently, in the target's dtype."""
    if target.image_head_weight().dtype == torch.bfloat16:
        return BF16_RTOL, BF16_ATOL
    return 0.0, BATCHING_ATOL


@pytest.fixture(scope="module", params=[(name, dtype) for name in sorted(FAMILIES) for dtype in DTYPES],
                ids=lambda param: f"{param[0]}-{param[1]}")  # fmt: skip
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, target, full dataset, token-only dataset), the target registered under its name."""
    name, dtype = request.param
    patch = pytest.MonkeyPatch()
    patch.setitem(registry.TARGET_LOADERS, name, lambda **kwargs: build_family(name, DTYPES[dtype]))
    shared_target.cache_clear()
    target = shared_target(name)
    assert target.image_head_weight().dtype == DTYPES[dtype]
    folder = tmp_path_factory.mktemp(f"{name}-{dtype}")
    yield name, target, extract(target, folder / "full", "full"), extract(target, folder / "tokens", "tokens")
    shared_target.cache_clear()
    patch.undo()


def batches(target: Any, folder: Path, features: str) -> list[dict[str, Any]]:
    """One epoch of batches of 3 (the last has 2 samples and a padding row), in the stream's order."""
    config = DataConfig(train_dir=str(folder), batch_size=3, load_uncond=True, features=features)
    data = FeatureDataModule(config, target=target)
    data.setup("fit")
    return list(data.train_dataloader())


def stream_excess(stored: torch.Tensor, online: torch.Tensor, mask: torch.Tensor, rtol: float = FLOAT16_RTOL,
                  atol: float = BATCHING_ATOL) -> float:  # fmt: skip
    """The largest amount by which |online - stored| exceeds rtol |online| + atol max|online| over real rows
    (<= 0: within it)."""
    stored, online = stored.float()[mask], online.float()[mask]  # (N, width)
    bound = rtol * online.abs() + atol * online.abs().max()
    return float(((online - stored).abs() - bound).max())


def test_token_only_shards_hold_the_tokens_and_prompts_of_the_full_extraction(family) -> None:
    name, target, full, tokens = family
    manifest, token_manifest = load_manifest(full), load_manifest(tokens)
    assert (manifest.features, token_manifest.features) == ("full", "tokens")
    assert set(token_manifest.fields) == {"tokens"}
    assert set(manifest.fields) == {"tokens", *STREAMS}
    full_batches, token_batches = batches(target, full, "online"), batches(target, tokens, "online")
    for a, b in zip(full_batches, token_batches, strict=True):
        assert a["keys"] == b["keys"] and a["prompts"] == b["prompts"]
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    # data.disk's formula (the README's disk table) against the bytes written: exact up to the json member's
    # length and each shard's end (two zero blocks and the padding to a 10 KB tar record)
    shape = SampleShape(name, target.geometry.num_tokens, target.hidden_size, len(target.aux_layer_ids),
                        target.image_vocab_size)  # fmt: skip
    for found, features in ((manifest, "full"), (token_manifest, "tokens")):
        written = sum(info.num_bytes for info in found.shards)
        formula = found.num_samples * sample_bytes(shape, features)
        slack = len(found.shards) * 10240 + found.num_samples * 512
        assert formula - slack <= written <= formula + slack, (features, written, formula)


@pytest.mark.parametrize("source", ["full", "tokens"])
def test_online_streams_equal_the_stored_ones_and_shifted_tokens_do_not(family, source: str) -> None:
    name, target, full, tokens = family
    stored = batches(target, full, "offline")
    online = batches(target, full if source == "full" else tokens, "online")
    assert len(stored) == len(online) == 3
    for offline_batch, online_batch in zip(stored, online, strict=True):
        assert online_batch["online_fields"] == list(STREAMS)
        assert not any(stream in online_batch for stream in STREAMS)  # only tokens were read
        assert offline_batch["keys"] == online_batch["keys"]
        mask = offline_batch["loss_mask"]
        shifted = dict(online_batch, tokens=online_batch["tokens"].roll(1, dims=1))  # the mutation
        computed = fill_online_features(target, dict(online_batch))
        wrong = fill_online_features(target, shifted)
        rtol, atol = tolerances(target)
        rtol, atol = rtol + FLOAT16_RTOL, max(atol, BATCHING_ATOL)  # stored in float16
        for stream in STREAMS:
            assert computed[stream].dtype == target.image_head_weight().dtype
            assert computed[stream].shape == offline_batch[stream].shape
            excess = stream_excess(offline_batch[stream], computed[stream], mask, rtol, atol)
            assert excess <= 0, f"{name} {stream}: online exceeds the tolerance by {excess:.3g}"
            # tokens shifted by one position: the states of every position after the first move
            assert stream_excess(offline_batch[stream], wrong[stream], mask, rtol, atol) > 0, f"{name} {stream}"


def test_online_cacheless_pass_on_the_rows_read_equals_the_decode_path_on_every_row(family) -> None:
    """The step's forward (B cond rows + the uncond rows of some samples, one causal pass, no KV cache) against
    the old one ([cond; uncond] for every sample through prefill + forward over a cache), stream by stream."""
    name, target, full, tokens = family
    batch = batches(target, full, "offline")[0]
    prompts, ids = list(batch["prompts"]), batch["tokens"]
    old = teacher_forced_states(target, prompts, ids, aux=True, uncond=True, decode_cache=True)
    for picked in ([False, True, False], [True, True, True], [False, False, False]):
        samples = torch.tensor(picked)
        new = teacher_forced_states(target, prompts, ids, aux=True, uncond=samples)
        assert new.uncond_hidden is not None and new.uncond_hidden.shape[0] == sum(picked)
        rtol, atol = tolerances(target)
        for stream, value in new.fields().items():
            reference = old.fields()[stream]
            reference = reference[samples] if stream.startswith("uncond") else reference
            assert value.dtype == reference.dtype == target.image_head_weight().dtype
            if value.numel():
                every = torch.ones(value.shape[:2], dtype=torch.bool)
                excess = stream_excess(reference, value, every, rtol, atol)
                assert excess <= 0, f"{name} {stream} {picked}: the cacheless pass is off by {excess:.3g}"


def fit_losses(name: str, target: Any, folder: Path, features: str, objective: ObjectiveConfig | None = None,
               seed: int = 3, accumulate: int = 1) -> list[float]:  # fmt: skip
    drafter = {"hidden_size": target.hidden_size, "target_hidden_size": target.hidden_size,
               "vocab_size": target.image_vocab_size, "num_heads": 2, "num_kv_heads": 2,
               "intermediate_size": 64}  # fmt: skip
    system = DrafterSystem(target=name, architecture="eagle3", preset="tiny", drafter=drafter, seed=seed,
                           objective=objective or ObjectiveConfig(ttt_steps=2, cfg_loss_weight=1.0),
                           optimizer=OptimizerConfig(lr=3e-3))  # fmt: skip
    data = DrafterDataModule(train_dir=str(folder), batch_size=4, target=name, load_uncond=True, features=features)
    losses: list[float] = []
    recorder = TrainingBatchTimer(losses)  # records every step's loss
    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder], accumulate_grad_batches=accumulate)  # fmt: skip
    trainer.fit(system, datamodule=data)
    return losses


def test_training_steps_give_equal_losses_offline_and_online(family) -> None:
    name, target, full, tokens = family
    offline = torch.tensor(fit_losses(name, target, full, "offline"), dtype=torch.float64)
    online = torch.tensor(fit_losses(name, target, tokens, "online"), dtype=torch.float64)
    assert len(offline) == STEPS
    if target.image_head_weight().dtype == torch.float32:  # it trains (in bf16 the tiny drafters' first steps
        # move the loss by less than 5 x LOSS_RTOL; the first step's equality still compares the features)
        assert ((offline[1:] - offline[:-1]).abs() > 5 * LOSS_RTOL * offline[:-1].abs()).all(), offline
    torch.testing.assert_close(online[0], offline[0], rtol=FIRST_LOSS_RTOL, atol=0)  # the inputs alone
    torch.testing.assert_close(online, offline, rtol=LOSS_RTOL, atol=0)


def test_online_uncond_rate_steps_run_the_swapped_samples_only_and_train_as_offline(family, monkeypatch) -> None:
    """uncond_rate: the swap mask is drawn before the online forward, which computes the unconditional rows of
    the swapped samples only; the objective uses that very mask, so the losses equal an offline run's, whose
    objective draws the mask itself from the same step generator. Each optimizer step accumulates two batches,
    which draw their own masks (the generator is keyed by the micro-batch), in the transfer hook as in the step."""
    name, target, full, tokens = family
    objective = ObjectiveConfig(ttt_steps=2, uncond_rate=0.5, noise_std=0.1)  # noise: draws after the swap
    forwarded: list[torch.Tensor] = []
    used: list[torch.Tensor] = []

    def forward(*args: Any, uncond: Any = False, **kwargs: Any) -> Any:
        forwarded.append(uncond.clone() if isinstance(uncond, torch.Tensor) else torch.tensor([uncond]))
        return teacher_forced_states(*args, uncond=uncond, **kwargs)

    def objective_of(model: Any, target_: Any, batch: dict, config: Any, **kwargs: Any) -> Any:
        if batch.get("online_fields"):
            used.append(batch["uncond_swap"].clone())
        return drafter_objective(model, target_, batch, config, **kwargs)

    offline_losses = fit_losses(name, target, full, "offline", objective, seed=5, accumulate=2)
    monkeypatch.setattr(online_features, "teacher_forced_states", forward)
    monkeypatch.setattr(system_module, "drafter_objective", objective_of)
    online_losses = fit_losses(name, target, tokens, "online", objective, seed=5, accumulate=2)
    offline = torch.tensor(offline_losses, dtype=torch.float64)
    online = torch.tensor(online_losses, dtype=torch.float64)
    assert len(forwarded) == len(used) == 2 * STEPS
    for mask, swap in zip(forwarded, used, strict=True):
        assert torch.equal(mask, swap)  # the forward computed exactly the samples the objective swapped
    swapped = torch.stack(used)
    assert swapped.any() and not swapped.all(), swapped  # some steps read some unconditional rows, not all
    torch.testing.assert_close(online[0], offline[0], rtol=FIRST_LOSS_RTOL, atol=0)
    torch.testing.assert_close(online, offline, rtol=LOSS_RTOL, atol=0)


def test_a_token_only_dataset_in_offline_mode_names_the_mode_and_the_flag(family) -> None:
    name, target, full, tokens = family
    with pytest.raises(ManifestError, match=r"image tokens only.*features: tokens.*--data.features online"):
        batches(target, tokens, "offline")


def test_an_online_fit_loads_the_target_once_and_never_trains_or_saves_it(tmp_path: Path) -> None:
    """Training step, DataModule and DecodeValidation share one target; it stays outside parameters and checkpoints."""
    from conftest import build_tiny_toy_target

    from training.callbacks import DecodeValidation

    loads: list[str] = []

    def load(**kwargs: Any) -> Any:
        loads.append("tiny-toy")
        return build_tiny_toy_target()

    patch = pytest.MonkeyPatch()
    patch.setitem(registry.TARGET_LOADERS, "tiny-toy", load)
    shared_target.cache_clear()
    try:
        folder = extract(build_tiny_toy_target(), tmp_path / "tokens", "tokens")
        system = DrafterSystem(target="tiny-toy", architecture="eagle3", preset="tiny",
                               objective=ObjectiveConfig(ttt_steps=2, cfg_loss_weight=1.0))  # fmt: skip
        data = DrafterDataModule(train_dir=str(folder), num_val_shards=1, batch_size=2, target="tiny-toy",
                                 load_uncond=True, features="online")  # fmt: skip
        decode = DecodeValidation(rules=["exact"], num_prompts=2, top_k=2, depth=2, total_tokens=4, log_images=False)
        trainer = L.Trainer(accelerator="cpu", max_steps=2, val_check_interval=2, check_val_every_n_epoch=None,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, callbacks=[decode])  # fmt: skip
        trainer.fit(system, datamodule=data)
        trainer.save_checkpoint(tmp_path / "last.ckpt")
    finally:
        shared_target.cache_clear()
        patch.undo()
    assert trainer.global_step == 2 and "decode/tau_exact" in trainer.callback_metrics
    assert loads == ["tiny-toy"]  # one target for the step, the DataModule and the decoding callback
    target = system.frozen_target
    assert target is not None and not target.network.training
    target_parameters = {id(p) for p in target.network.parameters()}
    assert not any(p.requires_grad for p in target.network.parameters())
    assert not target_parameters & {id(p) for p in system.parameters()}
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in system.drafter.parameters() if p.requires_grad}
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert saved and all(key.startswith("model.") for key in saved)  # the drafter's weights only
    assert sum(v.numel() for v in saved.values()) == sum(v.numel() for v in system.drafter.state_dict().values())
