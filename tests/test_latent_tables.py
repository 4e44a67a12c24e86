"""Every target's proximity tables (`ImageTarget.latent_table`, `lm_embedding_table`) are its model's own, and
LANTERN, LANTERN++ and GSD build from them through `build_rule` and decode on each family's tiny stand-in."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_toy_target
from stub_drafters import OracleDrafter
from test_chameleon_vqgan import TINY, random_state, skipped_keys, tiny_shapes
from test_target_lumina import GRID, build_tiny_lumina
from test_targets_end_to_end import build_tiny_llamagen, tiny_janus, tiny_lumina

from inference.decoding.generate import build_rule
from inference.decoding.rules import GSDRule, LanternRule
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.verify import build_latent_neighbours
from inference.measure.step_latency import stand_in_latent_table
from models.lumina import LuminaTarget
from models.lumina_layout import layout_rows
from models.target import ImageTarget

FAMILIES = {
    "tiny-toy": build_tiny_toy_target,
    "tiny-janus": tiny_janus,
    "tiny-llamagen": build_tiny_llamagen,
    "tiny-lumina": tiny_lumina,
}


@pytest.fixture(scope="module")
def targets() -> dict[str, ImageTarget]:
    return {name: build() for name, build in FAMILIES.items()}


def same_storage(table: torch.Tensor, parameter: torch.Tensor) -> bool:
    """`table` is `parameter` itself (a detached view of the same memory, same shape), not a copy."""
    return table.data_ptr() == parameter.data_ptr() and table.shape == parameter.shape


# ---------------------------------------------------------------- which table each target gives


def test_toy_gives_its_patch_codebook_and_gpt_embeddings(targets):
    target = targets["tiny-toy"]
    assert target.latent_table() is target.vq.codebook  # (V, P*P*3) buffer
    assert same_storage(target.lm_embedding_table(), target.network.gpt.tok_embeddings.weight)


def test_llamagen_gives_its_vq16_codebook_and_gpt_embeddings(targets):
    target = targets["tiny-llamagen"]
    codebook = target.vq.quantize.embedding.weight
    assert same_storage(target.latent_table(), codebook)
    assert target.latent_table().shape == (target.image_vocab_size, target.vq.config.codebook_embed_dim)
    assert same_storage(target.lm_embedding_table(), target.gpt.tok_embeddings.weight)


def test_janus_gives_its_generation_vq_codebook_and_aligned_generation_embeddings(targets):
    target = targets["tiny-janus"]
    model = target.model.model
    table = target.latent_table()
    assert same_storage(table, model.vqmodel.quantize.embedding.weight)
    assert table.shape == (target.image_vocab_size, target.model.config.vq_config.embed_dim)
    with torch.no_grad():
        aligned = model.generation_aligner(model.generation_embeddings.weight)  # (V, D): what the LM reads
    lm_table = target.lm_embedding_table()
    assert lm_table.shape == (target.image_vocab_size, target.hidden_size)
    torch.testing.assert_close(lm_table, aligned)


def test_lumina_gives_the_chameleon_vq_codebook_with_two_layout_rows(targets):
    target = targets["tiny-lumina"]
    codebook = target.model.model.vqmodel.quantize.embedding.weight  # (K, e)
    assert same_storage(target.vq_codebook(), codebook)
    table = target.latent_table()
    assert table.shape == (target.num_codes + 2, codebook.shape[1]) == (target.image_vocab_size, 8)
    assert torch.equal(table[: target.num_codes], codebook)
    assert torch.equal(table[target.num_codes :], layout_rows(codebook, 2))
    embed = target.language_model.embed_tokens.weight
    assert torch.equal(target.lm_embedding_table(), embed[target.token_ids])
    assert target.token_ids[target.eol_index] == target.eol_id and target.token_ids[target.eoi_index] == target.eoi_id


def test_lumina_layout_rows_are_never_a_codes_neighbour(targets):
    target = targets["tiny-lumina"]
    table, codes = target.latent_table(), target.num_codes
    distance = torch.cdist(table, table)
    farthest_codes = distance[:codes, :codes].max()
    assert distance[:codes, codes:].min() > farthest_codes  # end-of-line / end-of-image vs every code
    assert distance[codes, codes + 1] > farthest_codes  # and vs each other
    neighbours = build_latent_neighbours(table, codes - 1)  # every other code
    assert (neighbours[:codes] < codes).all()
    assert (distance[:codes, codes:] ** 2 > 0.5).all()  # never inside GSD's distance threshold either


def test_lumina_takes_the_codebook_of_the_vqgan_it_decodes_with(tmp_path):
    model, tokenizer = build_tiny_lumina()
    path = tmp_path / "vqgan.ckpt"
    torch.save({"state_dict": random_state(tiny_shapes() | skipped_keys(32, 8), seed=3)}, path)
    target = LuminaTarget(model, tokenizer, grid=GRID, max_prompt_tokens=48, vqgan_path=path, vqgan_config=TINY)
    table = target.latent_table()
    vqgan = target.vq_decoder  # loaded by latent_table, as decode_images would
    assert vqgan is not None and same_storage(target.vq_codebook(), vqgan.quantize.embedding.weight)
    assert torch.equal(table[:16], vqgan.quantize.embedding.weight)
    assert not torch.equal(table[:16], model.model.vqmodel.quantize.embedding.weight)


def test_lumina_checkpoint_without_a_vq_codebook_needs_the_vqgan(tmp_path):
    model, tokenizer = build_tiny_lumina()
    folder = tmp_path / "lumina"
    state = {key: value for key, value in model.state_dict().items() if ".vqmodel." not in key}
    model.save_pretrained(folder, state_dict=state)  # as Lumina-mGPT's release: no VQ model weights
    tokenizer.save_pretrained(folder)
    target = LuminaTarget.from_pretrained(str(folder), device="cpu", grid=GRID, max_prompt_tokens=48)
    assert not target.vq_codebook_loaded
    with pytest.raises(NotImplementedError, match="vqgan_path"):
        target.latent_table()
    with pytest.raises(ValueError, match="rule 'lantern' needs the target's latent table.*vqgan_path"):
        build_rule("lantern", target)
    assert isinstance(build_rule("gsd", target), GSDRule)  # GSD reads the LM embeddings, which it has
    assert stand_in_latent_table(target) is not None  # a latency run falls back to a random table

    model.save_pretrained(folder)  # with them: transformers' quantizer is the codebook
    assert LuminaTarget.from_pretrained(str(folder), device="cpu", grid=GRID, max_prompt_tokens=48).vq_codebook_loaded


def test_a_target_without_a_latent_table_is_a_named_error(targets, monkeypatch):
    target = targets["tiny-toy"]
    monkeypatch.setattr(target, "latent_table", lambda: ImageTarget.latent_table(target))
    with pytest.raises(NotImplementedError, match=f"target {target.name!r} \\(ToyTarget\\) exposes no latent"):
        target.latent_table()
    with pytest.raises(ValueError, match="rule 'lantern\\+\\+' needs the target's latent table"):
        build_rule("lantern++", target)
    stand_in = stand_in_latent_table(target)
    assert stand_in is not None and stand_in.shape == (target.image_vocab_size, 8)
    assert isinstance(build_rule("lantern", target, latent_table=stand_in), LanternRule)


# ---------------------------------------------------------------- the rules get them, and decode


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_rules_receive_the_targets_tables(targets, name):
    target = targets[name]
    latent, lm_table = target.latent_table(), target.lm_embedding_table()
    for rule_name in ("lantern", "lantern++"):
        rule = build_rule(rule_name, target)
        assert isinstance(rule, LanternRule)
        assert torch.equal(rule.neighbours, build_latent_neighbours(latent, rule.k + 1))
    gsd = build_rule("gsd", target)
    assert isinstance(gsd, GSDRule) and gsd.embeddings.dtype == torch.float32
    assert torch.equal(gsd.embeddings, lm_table.float())
    assert (gsd.token_ids is not None) == (name == "tiny-lumina")  # Chameleon ids for GSD's id bound
    assert stand_in_latent_table(target) is None  # latency runs use the target's own table


@pytest.mark.parametrize("rule_name", ["lantern", "lantern++", "gsd"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_peer_rules_decode_on_every_tiny_target(targets, name, rule_name):
    target = targets[name]
    rule = build_rule(rule_name, target)
    prompts = ["a small red circle at the top left on a plain blue background"]
    tree = DecoderConfig(tree="dynamic-sampled", top_k=2, depth=3, total_tokens=6)  # drafts drawn from q = p
    settings = dataclasses.replace(target.sampling, top_k=None)
    generator = torch.Generator().manual_seed(0)
    result = generate_speculative(target, OracleDrafter(target), prompts, rule, tree, settings, generator)
    count, vocab = target.geometry.num_tokens, target.image_vocab_size
    assert result.tokens.shape == (1, count)
    index = torch.arange(count)[None]  # (1, G)
    allowed = torch.isfinite(target.constrain_logits(torch.zeros(1, count, vocab), index))  # (1, G, V)
    assert allowed.gather(-1, result.tokens[..., None].cpu()).all()  # the layout holds (Lumina's end-of-line column)
    assert result.target_forwards < count  # the oracle drafter's drafts are accepted: fewer forwards than AR


@pytest.mark.parametrize("name", ["janus-pro-7b", "lumina-mgpt-7b", "llamagen-xl"])
def test_latency_runs_use_a_random_weight_targets_own_table(name):
    from models.random_weights import random_target

    target = random_target(name, "tiny")
    assert stand_in_latent_table(target) is None  # no random V x 8 stand-in: the target's VQ codebook, its shape
    rule = build_rule("lantern", target)
    assert torch.equal(rule.neighbours, build_latent_neighbours(target.latent_table(), rule.k + 1))
