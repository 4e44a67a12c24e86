"""Each micro-batch of an accumulated step, and each rank, draws its own noise and swaps; a rerun draws the same.

`DrafterSystem._generator(micro_batch)` seeds the step's generator from (seed, optimizer step, micro-batch
within the step, rank). Seeded by the optimizer step alone, the two micro-batches of a step accumulated over
two batches would add the same input noise and swap the same rows to the unconditional branch.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from training.system import DrafterSystem


@pytest.fixture
def system(monkeypatch: pytest.MonkeyPatch) -> DrafterSystem:
    module = DrafterSystem(target="toy", preset="tiny")
    monkeypatch.setattr(DrafterSystem, "global_step", property(lambda self: self._test_step))
    monkeypatch.setattr(DrafterSystem, "global_rank", property(lambda self: self._test_rank))
    module._test_step, module._test_rank = 7, 0  # type: ignore[attr-defined]
    return module


def draws(system: DrafterSystem, step: int, micro_batch: int, rank: int) -> torch.Tensor:
    system._test_step, system._test_rank = step, rank  # type: ignore[attr-defined]
    return torch.rand(16, generator=system._generator(micro_batch))


def test_micro_batches_ranks_and_steps_draw_differently_and_reproducibly(system: DrafterSystem):
    keys = list(itertools.product((0, 1), (0, 1), (0, 1)))  # (step, micro-batch, rank)
    values = {key: draws(system, *key) for key in keys}
    for a, b in itertools.combinations(keys, 2):
        assert not torch.equal(values[a], values[b]), f"{a} and {b} draw the same numbers"
    for key in keys:  # a resumed run recomputes the same draws
        assert torch.equal(draws(system, *key), values[key])


def test_micro_batch_index_counts_within_the_optimizer_step(system: DrafterSystem, monkeypatch: pytest.MonkeyPatch):
    assert [system._micro_batch(i) for i in range(4)] == [0, 0, 0, 0]  # no trainer: no accumulation
    system._trainer = SimpleNamespace(accumulate_grad_batches=3)  # type: ignore[assignment]
    monkeypatch.setattr(DrafterSystem, "trainer", property(lambda self: self._trainer))
    assert [system._micro_batch(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
