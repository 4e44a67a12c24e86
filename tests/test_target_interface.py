"""The target interface on a tiny toy target: CFG row pairing, prefill/forward, frozen embedding and head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference.decoding.autoregressive import generate_ar
from inference.decoding.sampling import (
    Proposal,
    combine_cfg,
    filter_logits,
    processed_distribution,
    proposal_distribution,
    sample_tokens,
)
from models.target import SamplingDefaults

PROMPTS = [
    "a small red circle at the top left on a plain blue background",
    "a large green cross in the center , a small pink square at the bottom and a large blue triangle "
    "at the bottom right on a checkered yellow background",
]


def test_condition_lays_out_cond_rows_then_shared_uncond_rows(tiny_target):
    conditioning = tiny_target.condition(PROMPTS, cfg=True)
    assert conditioning.rows == 4 and conditioning.num_prompts == 2
    embeds, valid = conditioning.inputs_embeds, conditioning.valid
    torch.testing.assert_close(embeds[2], embeds[3])  # the learned unconditional caption
    assert not torch.allclose(embeds[0], embeds[1])
    assert torch.equal(valid[:2], valid[2:])  # uncond rows reuse their conditional row's mask
    assert valid[0].sum() == 13 and valid[1].sum() > valid[0].sum()
    single = tiny_target.condition(PROMPTS[1:], cfg=False)
    torch.testing.assert_close(single.inputs_embeds[0], embeds[1])


def test_cfg_rows_stay_paired_in_a_batch(tiny_target):
    """Greedy decoding of two prompts together equals decoding each alone, so cond/uncond rows pair up."""
    greedy = dataclasses.replace(tiny_target.sampling, temperature=0.0, cfg_scale=4.0)
    together = generate_ar(tiny_target, PROMPTS, greedy).tokens
    alone = torch.cat([generate_ar(tiny_target, [p], greedy).tokens for p in PROMPTS])
    assert torch.equal(together, alone)
    unguided = generate_ar(tiny_target, PROMPTS, dataclasses.replace(greedy, cfg_scale=1.0)).tokens
    assert not torch.equal(together, unguided)  # the guidance is really applied


def test_forward_logits_are_the_frozen_head_of_the_hidden_state(tiny_target):
    conditioning = tiny_target.condition(PROMPTS, cfg=False)
    cache = tiny_target.allocate_cache(2, tiny_target.prefix_length + 4)
    tiny_target.prefill(conditioning, cache)
    tokens = torch.randint(0, tiny_target.image_vocab_size, (2, 3))
    out = tiny_target.forward(tokens, tiny_target.image_positions(torch.arange(3)), cache, return_aux=True)
    assert out.logits.shape == (2, 3, tiny_target.image_vocab_size)
    torch.testing.assert_close(out.logits, tiny_target.image_head(out.hidden))
    assert out.aux.shape == (2, 3, 3 * tiny_target.hidden_size)
    embedding = tiny_target.embed_image_tokens(tokens)
    assert embedding.shape == (2, 3, tiny_target.hidden_size) and not embedding.requires_grad


def test_forward_computes_logits_only_where_asked(tiny_target):
    """`logits_at` (the tree decoder's inner nodes) runs the head on those rows only; hidden covers every token."""
    conditioning = tiny_target.condition(PROMPTS, cfg=True)
    tokens = torch.randint(0, tiny_target.image_vocab_size, (4, 5), generator=torch.Generator().manual_seed(0))
    outputs = []
    for logits_at in (None, torch.tensor([0, 2, 3])):
        cache = tiny_target.allocate_cache(4, tiny_target.prefix_length + 5)
        tiny_target.prefill(conditioning, cache)
        positions = tiny_target.image_positions(torch.arange(5))
        outputs.append(tiny_target.forward(tokens, positions, cache, return_aux=True, logits_at=logits_at))
    every, some = outputs
    assert some.logits.shape == (4, 3, tiny_target.image_vocab_size) and some.hidden.shape == every.hidden.shape
    torch.testing.assert_close(some.logits, every.logits[:, [0, 2, 3]])
    torch.testing.assert_close(some.hidden, every.hidden)
    torch.testing.assert_close(some.aux, every.aux)


def test_combine_cfg_is_u_plus_s_times_c_minus_u():
    cond, uncond = torch.tensor([[1.0, 3.0]]), torch.tensor([[2.0, 0.0]])
    torch.testing.assert_close(combine_cfg(torch.cat([cond, uncond]), 3.0), torch.tensor([[-1.0, 9.0]]))
    with pytest.raises(ValueError, match="even number of rows"):
        combine_cfg(torch.zeros(3, 2), 2.0)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = filter_logits(logits, SamplingDefaults(cfg_scale=1.0, top_k=2)).isfinite()
    assert kept_k.tolist() == [[True, True, False, False]]
    kept_p = filter_logits(logits, SamplingDefaults(cfg_scale=1.0, top_p=0.7)).isfinite()
    assert kept_p.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.8 crosses it
    generator = torch.Generator().manual_seed(0)
    draws = sample_tokens(logits.expand(2000, 4), SamplingDefaults(cfg_scale=1.0, top_k=2), generator)
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).float().mean().item() - 0.5 / 0.8) < 0.04


def test_the_drafts_proposal_keeps_exactly_top_k_tokens_and_names_them():
    settings = SamplingDefaults(cfg_scale=1.0, top_k=2, temperature=0.5)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.2, 0.2, 0.2]]))  # row 2: a tie at the k-th
    proposal = proposal_distribution(logits, settings, cfg=False)
    probs, support = proposal.dense(), proposal.support  # (2, 4), (2, k)
    assert support is not None and support.shape == (2, 2) and proposal.probs.shape == (2, 2)
    assert ((probs > 0).sum(-1) == 2).all()  # exactly k, also when tokens tie with the k-th
    assert torch.equal(probs.gather(-1, support).sum(-1), torch.ones(2))  # the support holds all the mass
    _, target_probs = processed_distribution(logits, settings, cfg=False)
    torch.testing.assert_close(probs[0], target_probs[0])  # without ties: the target's own processing
    assert (target_probs[1] > 0).sum() == 4  # the target's filter keeps the ties
    assert torch.equal(probs.gather(-1, support), proposal.probs)  # the dense q holds the support's probabilities
    dense = proposal_distribution(logits, SamplingDefaults(cfg_scale=1.0), cfg=False)  # no top-k: q over V
    assert dense.support is None and torch.equal(dense.dense(), dense.probs) and dense.probs.shape == (2, 4)


def test_a_proposal_on_its_support_ranks_and_spreads_like_the_dense_q():
    q = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])
    support = torch.tensor([[4, 1, 3]])  # the tokens with mass, in no order
    proposal = Proposal(q.gather(-1, support), support, vocab_size=6)
    assert torch.equal(proposal.dense(), q) and proposal.size == 6
    assert proposal.ranked(2).tolist() == [[1, 4]] == q.topk(2).indices.tolist()  # likeliest first
    assert proposal.ranked(4)[0, :3].tolist() == [1, 4, 3]  # more than the support holds: from the dense q
    assert torch.equal(proposal.largest(2), q.topk(2).values) and torch.equal(proposal.largest(4), q.topk(4).values)
    assert torch.equal(proposal[:, None].dense(), q[:, None])  # indexing keeps probabilities and ids together
    with pytest.raises(ValueError, match="needs vocab_size"):
        Proposal(q.gather(-1, support), support)


def test_sampling_is_reproducible_with_a_seeded_generator(tiny_target):
    settings = dataclasses.replace(tiny_target.sampling, temperature=1.0)
    first = generate_ar(tiny_target, PROMPTS, settings, torch.Generator().manual_seed(3)).tokens
    again = generate_ar(tiny_target, PROMPTS, settings, torch.Generator().manual_seed(3)).tokens
    other = generate_ar(tiny_target, PROMPTS, settings, torch.Generator().manual_seed(4)).tokens
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_sampling_settings_reject_bad_values():
    with pytest.raises(ValueError, match="top_p must lie in"):
        SamplingDefaults(cfg_scale=2.0, top_p=1.5)
