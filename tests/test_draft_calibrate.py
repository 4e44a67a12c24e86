"""`inference.measure.draft_calibrate`: acceptance by depth from the decoder's own tallies, and the report's
tau equal to the decoder's tau on the same prompts, seeds and trees."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny_toy_target
from stub_drafters import OracleDrafter

from inference.decoding.rules import ExactRule
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.measure.draft_calibrate import depth_acceptance, drafting_report, report_table

PROMPTS = ["a big green square on stripes", "a small red circle at the top left", "two blue triangles"]


def test_depth_acceptance_is_the_share_of_steps_going_one_level_deeper():
    accepted = torch.tensor([0, 1, 1, 2, 3, 3, 0, 2])  # steps reaching depth >= 0..4: 8, 6, 4, 2, 0
    assert depth_acceptance(accepted, 4)[:3] == pytest.approx((6 / 8, 4 / 6, 2 / 4))
    assert depth_acceptance(accepted, 4)[3] == 0.0
    assert math.isnan(depth_acceptance(accepted, 5)[4])  # no step reached depth 4: acceptance there is unknown


def test_the_report_decodes_fitted_and_dynamic_trees_with_the_decoders_own_tau():
    target = build_tiny_toy_target(grid=4)
    drafter, rule = OracleDrafter(target, scale=0.7), ExactRule()
    results = drafting_report(target, drafter, rule, PROMPTS, PROMPTS[:2], drafts=(3, 5), candidate_depth=3,
                              candidate_budget=1, dynamic=(2, 3, 6), seed=4)  # fmt: skip
    assert [r.name for r in results] == ["static 3", "static 5", "dynamic top-2, depth 3, 6 nodes"]
    for result in results:
        if result.paths is not None:
            assert len(result.paths) == result.drafts and max(map(len, result.paths)) == result.depth
            assert result.expected_tau is not None and result.expected_tau >= 1.0
            config = DecoderConfig(tree="static", static_tree=result.paths)
        else:
            config = DecoderConfig(tree="dynamic", top_k=2, depth=3, total_tokens=6)
        # the same batch, seed and tree decoded by hand: the report's tau and steps are the decoder's
        generation = generate_speculative(target, drafter, PROMPTS[:2], rule, config,
                                          generator=torch.Generator().manual_seed(4))  # fmt: skip
        steps, summed = generation.tally()
        assert result.tau == pytest.approx(summed / steps) and result.steps == steps
        assert 1.0 <= result.tau <= 1.0 + result.depth
        assert len(result.depth_acceptance) == result.depth
        assert all(0.0 <= a <= 1.0 for a in result.depth_acceptance if a == a)
    assert results[0].depth_acceptance[0] > 0.2  # the informed drafter gets first drafts accepted
    table = report_table(results)
    assert table.count("\n") == 4 and "| accept @1 |" in table and "static 5" in table
