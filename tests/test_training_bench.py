"""The Lightning-overhead benchmark (inference/measure/pipeline/training_bench.py): it compares like with like,
and its CLI prints the figures. Tiny settings (batch 2, 2 TTT steps, a few steps): a few seconds in all."""

from __future__ import annotations

import logging
import time
import warnings

import pytest
import torch

from inference.measure.pipeline import training_bench as bench
from models.registry import shared_target
from training.objective import drafter_objective
from training.system import DrafterSystem, OptimizerConfig


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build_system(architecture: str = "eagle3", cfg_loss: bool = False) -> DrafterSystem:
    objective = bench.objective_for(architecture, 2, cfg_loss)
    system = DrafterSystem(architecture=architecture, objective=objective, optimizer=OptimizerConfig(lr=1e-3))
    system.setup("fit")
    return system


@pytest.mark.parametrize("cfg", [False, True])
def test_synthetic_batch_has_the_collated_shapes(cfg: bool):
    target = shared_target("toy")
    batch = bench.synthetic_batch(target, 3, cfg=cfg)
    length, width = target.geometry.num_tokens, target.hidden_size
    assert batch["tokens"].shape == (3, length) and batch["tokens"].dtype == torch.int64
    assert batch["hidden"].shape == (3, length, width) and batch["hidden"].dtype == torch.float16
    assert batch["aux"].shape == (3, length, 3 * width)
    assert batch["loss_mask"].shape == (3, length) and bool(batch["loss_mask"].all())
    assert len(batch["keys"]) == 3
    assert ("uncond_hidden" in batch) == cfg and ("uncond_aux" in batch) == cfg
    if cfg:
        assert batch["uncond_aux"].shape == batch["aux"].shape


@pytest.mark.parametrize(("architecture", "cfg_loss"), [("eagle3", False), ("eagle3", True), ("eagle1", False)])
def test_the_objective_runs_on_the_synthetic_batch(architecture: str, cfg_loss: bool):
    system = build_system(architecture, cfg_loss)
    batch = bench.synthetic_batch(system.frozen_target, 2, cfg=cfg_loss)
    out = drafter_objective(system.drafter, system.frozen_target, batch, system.objective, training=True)
    assert torch.isfinite(out.loss) and len(out.ce) == 2
    assert bool(out.cfg_ce) == cfg_loss


def test_plain_and_lightning_steps_do_the_same_work():
    """From the same weights, on the same batch, both loops give the same losses step after step."""
    batch = bench.synthetic_batch(shared_target("toy"), 2, cfg=False)
    plain_losses: list[float] = []
    lightning_losses: list[float] = []
    plain = bench.plain_steps(build_system(), batch, warmup=1, steps=3, losses=plain_losses)
    steps, periods = bench.lightning_steps(build_system(), batch, warmup=1, steps=3, losses=lightning_losses)
    assert len(plain) == len(steps) == 3 and len(periods) == 2  # the last step has no next start
    assert all(t > 0 for t in plain + steps + periods)
    assert len(plain_losses) == len(lightning_losses) == 4
    assert plain_losses[0] != plain_losses[-1]  # the optimizer did step
    assert plain_losses == pytest.approx(lightning_losses, rel=1e-4)


PLANTED_SECONDS = 0.25
"""A sleep planted into every Lightning training step: far above the tiny step itself (tens of ms) and above what a
busy 2-core machine adds to a median of a few steps."""


def printed_median_ms(out: str, name: str) -> float:
    """The median the CLI printed for one arm ("  plain    12.34 ms   IQR ...")."""
    words = next(w for w in map(str.split, out.splitlines()) if len(w) > 3 and w[0] == name and w[2:4] == ["ms", "IQR"])
    return float(words[1])


def test_the_cli_measures_a_slowdown_planted_into_the_lightning_arm(monkeypatch, capsys: pytest.CaptureFixture[str]):
    """Only the Lightning arm calls DrafterSystem.training_step (the plain loop calls the objective itself): a sleep
    planted there must show up in the lightning median and the printed ratio, and not in the plain one."""
    argv = ["--batch-size", "2", "--steps", "3", "--warmup", "1", "--rounds", "1", "--ttt-steps", "2", "--cfg-loss"]
    real_step = DrafterSystem.training_step

    def slowed(self, batch, batch_idx):
        time.sleep(PLANTED_SECONDS)
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(DrafterSystem, "training_step", slowed)
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for text in (f"torch {torch.__version__}", "threads: torch 1", "aux (2, 36, 384)", "uncond_aux (2, 36, 384)",
                 "ttt_steps 2", "ratio lightning / plain:"):  # fmt: skip
        assert text in out, out
    plain, lightning = printed_median_ms(out, "plain"), printed_median_ms(out, "lightning")
    planted = PLANTED_SECONDS * 1e3
    assert plain < planted, out  # the plain arm does not sleep
    assert lightning - plain >= 0.9 * planted, out  # the sleep is inside the timed window
    ratio = float(out.split("ratio lightning / plain:")[1].split()[0])
    assert ratio == pytest.approx(lightning / plain, rel=0.01), out  # the ratio is of the printed medians


def test_the_summary_is_median_and_quartiles():
    assert bench.summary([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 2.0, 4.0)
    assert bench.summary([2.0]) == (2.0, 2.0, 2.0)
