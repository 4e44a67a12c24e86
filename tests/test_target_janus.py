"""The Janus-Pro target on a tiny random `JanusConfig` built with transformers' real classes.

Checks our adapter (our KV cache, explicit positions, tree masks) against transformers' own Janus
code: image `generate()` (greedy and seeded sampling), a full uncached `LlamaModel` forward with
`output_hidden_states`, branch-by-branch forwards of a tree, the tree decoder end to end, and the
`ImageTarget` contract.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_chunked_cache_matches_full_forward, depths_of, path_to, prefilled, tree_mask_of
from stub_drafters import OracleDrafter

from inference.decoding.autoregressive import generate_ar
from inference.decoding.sampling import combine_cfg
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.verify import ExactRule
from models import registry
from models.janus import PROMPT_TEMPLATE, JanusTarget

transformers = pytest.importorskip("transformers")

PROMPTS = ["a red fox in the snow", "a small blue house under a big green tree at night"]
HIDDEN = 32
CFG = 5.0  # the official guidance scale


def build_tiny_tokenizer():
    """A word-level tokenizer with Janus' special tokens (real ids come from the checkpoint's tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<bos>", "<eos>", "<unk>", "<begin_of_image>", "<|User|>", "<|Assistant|>"]
    words = sorted({word for prompt in PROMPTS for word in prompt.split()} | {":", "long"})
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=special[4:],
    )  # fmt: skip


def build_tiny_janus(seed: int = 0):
    """JanusForConditionalGeneration at a tiny size: 4 layers, width 32, GQA, 64 codes, 4x4 grid, 8 px."""
    config = transformers.JanusConfig(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
                           projection_dim=HIDDEN, num_image_tokens=16, mlp_ratio=2.0),
        vq_config=dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=HIDDEN,
                       image_token_embed_dim=HIDDEN, num_hidden_layers=2),
        image_token_id=60,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.JanusForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the init, so greedy tokens vary along the image
        for module in (model.model.language_model, model.model.generation_embeddings,
                       model.model.generation_aligner, model.model.generation_head):  # fmt: skip
            for name, parameter in module.named_parameters():
                if "norm" not in name:
                    parameter.normal_(0, 0.3)
    tokenizer = build_tiny_tokenizer()
    generation = model.generation_config  # what transformers' image generate() reads
    generation.bos_token_id, generation.pad_token_id = tokenizer.bos_token_id, tokenizer.pad_token_id
    generation.generation_kwargs = {"boi_token_id": tokenizer.convert_tokens_to_ids("<begin_of_image>")}
    return model, tokenizer


@pytest.fixture(scope="module")
def janus():
    model, tokenizer = build_tiny_janus()
    return JanusTarget(model, tokenizer, name="tiny-janus", max_prompt_tokens=20, aux_layer_ids=(1, 2, 3))


def full_forward(target: JanusTarget, prefix_embeds, prefix_valid, tokens):
    """transformers' LlamaModel over prefix + image tokens at once, no cache: (logits, hidden, hidden_states)."""
    embeds = torch.cat([prefix_embeds, target.embed_image_tokens(tokens)], dim=1)
    mask = torch.cat([prefix_valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1).long()
    with torch.no_grad():
        out = target.language_model(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True)
    return target.image_head(out.last_hidden_state), out.last_hidden_state, out.hidden_states


def hf_generate(target: JanusTarget, prompts, **kwargs):
    ids, valid = target.prompt_ids(prompts, cfg=False)
    return target.model.generate(input_ids=ids, attention_mask=valid.long(), generation_mode="image", **kwargs)


# ---------------------------------------------------------------- (a) parity with transformers' image generate()


def test_greedy_tokens_equal_transformers_image_generate(janus):
    greedy = dataclasses.replace(janus.sampling, temperature=0.0)  # CFG 5, argmax
    ours = generate_ar(janus, PROMPTS, greedy).tokens
    theirs = hf_generate(janus, PROMPTS, do_sample=False, guidance_scale=CFG)
    assert ours.shape == (2, janus.geometry.num_tokens)
    assert torch.equal(ours, theirs)
    assert len(ours.unique()) > 4  # a non-degenerate image, so the comparison means something
    alone = torch.cat([generate_ar(janus, [prompt], greedy).tokens for prompt in PROMPTS])
    assert torch.equal(ours, alone)  # left padding changes nothing


def test_seeded_sampling_equals_transformers_image_generate(janus):
    ours = generate_ar(janus, PROMPTS, janus.sampling, torch.Generator().manual_seed(11)).tokens
    torch.manual_seed(11)  # transformers samples from the global generator
    theirs = hf_generate(janus, PROMPTS, do_sample=True, guidance_scale=CFG)
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------- (b) cached forward == full uncached forward


@pytest.mark.parametrize("aux_layer_ids", [(1, 2, 3), (0, 2, 4)])
def test_cached_forward_equals_full_uncached_forward(janus, aux_layer_ids):
    target = JanusTarget(janus.model, janus.tokenizer, max_prompt_tokens=20, aux_layer_ids=aux_layer_ids)
    rows = 2 * len(PROMPTS)
    tokens = torch.randint(0, target.image_vocab_size, (rows, 7), generator=torch.Generator().manual_seed(1))
    assert_chunked_cache_matches_full_forward(target, full_forward, PROMPTS, tokens, aux_layer_ids, HIDDEN)


# ---------------------------------------------------------------- (c) tree mask == branch by branch

PARENTS = [-1, 0, 0, 1, 2, 3]  # a; b, c under a; d under b; e under c; f under d


def test_tree_forward_equals_branch_by_branch(janus):
    generator = torch.Generator().manual_seed(2)
    rows, done = 2 * len(PROMPTS), 3
    committed = torch.randint(0, janus.image_vocab_size, (rows, done), generator=generator)
    nodes = torch.randint(0, janus.image_vocab_size, (rows, len(PARENTS)), generator=generator)
    chain = list(range(-1, len(PARENTS) - 1))  # rows 1 and 3 verify a chain instead: per-row (R, T, T) masks
    row_parents = [PARENTS, chain, PARENTS, chain]
    mask = torch.stack([tree_mask_of(p) for p in row_parents])  # (R, T, T)
    positions = torch.stack([janus.image_positions(done + depths_of(p)) for p in row_parents])  # (R, T)
    cache = prefilled(janus, PROMPTS, committed, len(PARENTS))
    tree = janus.forward(nodes, positions, cache, tree_mask=mask, return_aux=True)
    for row, parents in enumerate(row_parents):
        for node in range(len(PARENTS)):
            path = path_to(parents, node)
            fresh = prefilled(janus, PROMPTS, committed, len(path))
            branch = janus.forward(nodes[:, path], janus.image_positions(torch.arange(done, done + len(path))),
                                   fresh, return_aux=True)  # fmt: skip
            torch.testing.assert_close(tree.logits[row, node], branch.logits[row, -1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(tree.aux[row, node], branch.aux[row, -1], atol=2e-5, rtol=1e-4)
    # a (T, T) mask means the same tree in every row
    shared = janus.forward(nodes, janus.image_positions(done + depths_of(PARENTS)),
                           prefilled(janus, PROMPTS, committed, len(PARENTS)),
                           tree_mask=tree_mask_of(PARENTS))  # fmt: skip
    torch.testing.assert_close(shared.logits[0], tree.logits[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "config, make_drafter",
    [
        (DecoderConfig(tree="static"), lambda t: OracleDrafter(t, wrong_every=3)),
        (DecoderConfig(tree="dynamic", top_k=4, depth=3, total_tokens=14), lambda t: OracleDrafter(t, scale=0.3)),
    ],
    ids=["static-partial", "dynamic-blurred"],
)
def test_tree_decoder_reproduces_greedy_ar(janus, config, make_drafter):
    """End to end: the speculative tree decoder (tree masks, keep_columns) over Janus equals greedy AR."""
    greedy = dataclasses.replace(janus.sampling, temperature=0.0)
    expected = generate_ar(janus, PROMPTS, greedy).tokens
    result = generate_speculative(janus, make_drafter(janus), PROMPTS, ExactRule(), config, greedy)
    assert torch.equal(result.tokens, expected) and result.tau > 1.5


def test_committing_a_branch_with_keep_columns_matches_the_linear_sequence(janus):
    """Keys carry their rotary position: moving the accepted path's columns into place changes nothing."""
    generator = torch.Generator().manual_seed(3)
    rows, done = 2 * len(PROMPTS), 2
    committed = torch.randint(0, janus.image_vocab_size, (rows, done), generator=generator)
    nodes = torch.randint(0, janus.image_vocab_size, (rows, len(PARENTS)), generator=generator)
    cache = prefilled(janus, PROMPTS, committed, len(PARENTS) + 1)
    janus.forward(nodes, janus.image_positions(done + depths_of(PARENTS)), cache, tree_mask=tree_mask_of(PARENTS))
    path = path_to(PARENTS, 4)  # a, c, e
    start = janus.prefix_length + done
    columns = (start + torch.tensor(path)).expand(rows, -1)
    cache.keep_columns(start, columns, torch.ones(rows, len(path), dtype=torch.bool))
    after = torch.randint(0, janus.image_vocab_size, (rows, 1), generator=generator)
    got = janus.forward(after, janus.image_positions(torch.tensor([done + len(path)])), cache)
    linear = torch.cat([committed, nodes[:, path], after], dim=1)
    conditioning = janus.condition(PROMPTS, cfg=True)
    logits, _, _ = full_forward(janus, conditioning.inputs_embeds, conditioning.valid, linear)
    torch.testing.assert_close(got.logits[:, 0], logits[:, -1], atol=2e-5, rtol=1e-4)
    cache.truncate(start)  # dropping the committed path again and re-running it gives the same logits
    again = janus.forward(linear[:, done:], janus.image_positions(torch.arange(done, linear.shape[1])), cache)
    torch.testing.assert_close(again.logits[:, -1], logits[:, -1], atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- (d) the ImageTarget contract


def test_prompt_rows_follow_the_official_format_and_cfg_rule(janus):
    ids, valid = janus.prompt_ids(PROMPTS, cfg=True)
    assert ids.shape == valid.shape == (4, janus.prefix_length)
    bos, boi, pad = janus.bos_id, janus.boi_id, janus.pad_id
    for row, prompt in enumerate(PROMPTS):
        body = janus.tokenizer(PROMPT_TEMPLATE.format(prompt=prompt), add_special_tokens=False)["input_ids"]
        want = [bos, *body, boi]
        assert ids[row, valid[row]].tolist() == want  # BOS + "<|User|>: {prompt}\n\n<|Assistant|>:" + BOI
        assert ids[row, ~valid[row]].eq(pad).all()  # left padding
        assert ids[2 + row, valid[row]].tolist() == [bos] + [pad] * len(body) + [boi]  # uncond: prompt -> pad
    assert torch.equal(valid[:2], valid[2:])
    assert valid[0].sum() < valid[1].sum() and valid[:, -1].all()
    assert PROMPT_TEMPLATE.format(prompt="x") == "<|User|>: x\n\n<|Assistant|>:"
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        janus.prompt_ids([" ".join(["long"] * 40)])


def test_condition_prefill_and_forward_keep_the_contract(janus):
    conditioning = janus.condition(PROMPTS, cfg=True)
    assert conditioning.rows == 4 and conditioning.num_prompts == 2 and conditioning.cfg
    assert conditioning.inputs_embeds.shape == (4, janus.prefix_length, HIDDEN)
    ids, valid = janus.prompt_ids(PROMPTS, cfg=True)
    torch.testing.assert_close(conditioning.inputs_embeds, janus.model.get_input_embeddings()(ids))
    assert torch.equal(conditioning.valid, valid)
    single = janus.condition(PROMPTS[1:], cfg=False)
    torch.testing.assert_close(single.inputs_embeds[0], conditioning.inputs_embeds[1])

    cache = janus.allocate_cache(4, janus.prefix_length + 4)
    assert cache.keys.shape == (4, 4, 2, janus.prefix_length + 4, HIDDEN // 4)
    first = janus.prefill(conditioning, cache, return_aux=True)
    assert first.logits.shape == (4, janus.prefix_length, janus.image_vocab_size)
    assert first.aux.shape == (4, janus.prefix_length, 3 * HIDDEN)
    # the last prefix slot (BOI) predicts image token 0: the first greedy token is its guided argmax
    greedy = dataclasses.replace(janus.sampling, temperature=0.0)
    token0 = generate_ar(janus, PROMPTS, greedy).tokens[:, 0]
    assert torch.equal(combine_cfg(first.logits[:, -1], CFG).argmax(-1), token0)

    tokens = torch.cat([token0, token0])[:, None].repeat(1, 3)
    out = janus.forward(tokens, janus.image_positions(torch.arange(3)), cache, return_aux=True)
    assert out.logits.shape == (4, 3, janus.image_vocab_size) and out.hidden.shape == (4, 3, HIDDEN)
    assert out.aux.shape == (4, 3, 3 * HIDDEN)
    torch.testing.assert_close(out.logits, janus.image_head(out.hidden))
    torch.testing.assert_close(out.logits, janus.model.model.generation_head(out.hidden))
    assert janus.forward(tokens[:, :1], janus.image_positions(torch.tensor([3])), cache).aux is None
    embedding = janus.embed_image_tokens(tokens)
    torch.testing.assert_close(embedding, janus.model.prepare_embeddings_for_image_generation(tokens))
    assert embedding.shape == (4, 3, HIDDEN) and not embedding.requires_grad


def test_geometry_sampling_and_decode(janus):
    assert janus.sampling.cfg_scale == 5.0 and janus.sampling.temperature == 1.0
    assert janus.sampling.top_k is None and janus.sampling.top_p is None
    assert janus.geometry.grid == (4, 4) and janus.geometry.image_size == (8, 8)
    assert janus.num_layers == 4 and janus.hidden_size == HIDDEN and janus.image_vocab_size == 64
    assert janus.aux_layer_ids == (1, 2, 3) and janus.family == "janus"
    tokens = torch.randint(0, 64, (3, 16))
    images = janus.decode_images(tokens)
    assert images.shape == (3, 8, 8, 3) and images.dtype == torch.uint8
    with torch.no_grad():
        reference = janus.model.decode_image_tokens(tokens)  # (B, H, W, 3) in about [-1, 1]
    assert torch.equal(images, ((reference + 1) / 2 * 255).clamp(0, 255).to(torch.uint8))
    model, tokenizer = build_tiny_janus()
    assert JanusTarget(model, tokenizer).aux_layer_ids == (2, 2, 1)  # (2, L // 2, L - 3); (2, 15, 27) for 30


def test_registry_loads_a_local_transformers_folder(janus, tmp_path):
    janus.model.save_pretrained(tmp_path)
    janus.tokenizer.save_pretrained(tmp_path)
    target = registry.load_target("janus-pro-7b", path=str(tmp_path), dtype=torch.float32, device="cpu",
                                  max_prompt_tokens=20, aux_layer_ids=(1, 2, 3))  # fmt: skip
    assert isinstance(target, JanusTarget) and "toy" in registry.TARGET_LOADERS
    assert (target.bos_id, target.boi_id, target.pad_id) == (janus.bos_id, janus.boi_id, janus.pad_id)
    greedy = dataclasses.replace(janus.sampling, temperature=0.0)
    assert torch.equal(generate_ar(target, PROMPTS, greedy).tokens, generate_ar(janus, PROMPTS, greedy).tokens)
