"""The Lumina-mGPT target on a tiny random `ChameleonConfig` built with transformers' real classes.

Checks our adapter (our KV cache, explicit positions, tree masks, image vocabulary with layout
tokens) against transformers' own Chameleon code: a full uncached `ChameleonModel` forward with
`output_hidden_states`, the unmasked LM head, branch-by-branch forwards of a tree, an emulation of
upstream's sampler (separate unpadded cond / uncond contexts, CFG on raw logits, layout forcing),
the vocabulary map and the `ImageTarget` contract.
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
from models.lumina import LuminaTarget
from models.lumina_layout import END_OF_TURN, PROMPT_TEMPLATE

transformers = pytest.importorskip("transformers")

PROMPTS = ["a red fox in the snow", "a small blue house under a big green tree at night"]
HIDDEN = 32
CODES = 16  # tiny VQ codebook
GRID = (4, 4)  # codes; G = 4 x (4 + 1) = 20 with the end-of-line column
CFG = 3.0


def img_name(i: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z"


def build_vocab() -> dict[str, int]:
    """Chameleon-like vocabulary: specials, 16 image codes at a *shuffled* set of BPE ids, layout tokens, words."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    order = torch.randperm(CODES, generator=torch.Generator().manual_seed(5)).tolist()
    vocab |= {img_name(code): 4 + order[code] for code in range(CODES)}  # code k -> BPE 4 + perm[k], not identity
    specials = ["<eoss>", "<racm3:break>", "<image>", END_OF_TURN, "<reserved08799>", "<reserved08801>",
                "<reserved08802>", "<reserved08824>"]  # fmt: skip
    vocab |= {name: 4 + CODES + i for i, name in enumerate(specials)}
    text = PROMPT_TEMPLATE.format(width=64, height=64, prompt=" ".join(PROMPTS)) + " long"
    words = sorted(set(transformers_pre_tokens(text)))
    vocab |= {word: len(vocab) + i for i, word in enumerate(w for w in words if w not in vocab)}
    return vocab


def transformers_pre_tokens(text: str) -> list[str]:
    from tokenizers import pre_tokenizers

    return [piece for piece, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)]


def build_tiny_lumina(seed: int = 0, vocab_size: int = 96):
    vocab = build_vocab()
    assert len(vocab) <= vocab_size
    config = transformers.ChameleonConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, vocabulary_map=vocab,
        bos_token_id=1, pad_token_id=0, eos_token_id=2,
        vq_config=dict(embed_dim=8, num_embeddings=CODES, latent_channels=8, resolution=8, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[]),
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.ChameleonForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the init, so greedy tokens vary along the image
        for name, parameter in model.named_parameters():
            if "norm" not in name and "vqmodel" not in name:
                parameter.normal_(0, 0.3)
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    return model, tokenizer


def tiny_decoder(model):
    """A stand-in VQ decoder (transformers has none): codebook lookup, post-quant conv, 2x upsampling."""

    def decode(codes: torch.Tensor) -> torch.Tensor:  # (B, h, w) -> (B, 3, 2h, 2w)
        vq = model.model.vqmodel
        latents = vq.quantize.embedding(codes).permute(0, 3, 1, 2)
        pixels = vq.post_quant_conv(latents)[:, :3].tanh()
        return torch.nn.functional.interpolate(pixels, scale_factor=2)

    return decode


@pytest.fixture(scope="module")
def lumina():
    model, tokenizer = build_tiny_lumina()
    return LuminaTarget(model, tokenizer, name="tiny-lumina", grid=GRID, max_prompt_tokens=32,
                        aux_layer_ids=(1, 2, 3), vq_decoder=tiny_decoder(model))  # fmt: skip


def full_forward(target: LuminaTarget, prefix_embeds, prefix_valid, tokens):
    """transformers' ChameleonModel over prefix + image tokens at once, no cache: (logits, hidden, hidden_states)."""
    embeds = torch.cat([prefix_embeds, target.embed_image_tokens(tokens)], dim=1)
    mask = torch.cat([prefix_valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1).long()
    with torch.no_grad():
        out = target.language_model(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True)
    return target.image_head(out.last_hidden_state), out.last_hidden_state, out.hidden_states


def random_tokens(target: LuminaTarget, shape, seed: int) -> torch.Tensor:
    return torch.randint(0, target.image_vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- cached forward == full uncached forward


@pytest.mark.parametrize("aux_layer_ids", [(1, 2, 3), (0, 2, 4)])
def test_cached_forward_equals_full_uncached_forward(lumina, aux_layer_ids):
    target = LuminaTarget(lumina.model, lumina.tokenizer, grid=GRID, max_prompt_tokens=32, aux_layer_ids=aux_layer_ids)
    rows = 2 * len(PROMPTS)
    tokens = random_tokens(target, (rows, 7), 1)
    assert_chunked_cache_matches_full_forward(target, full_forward, PROMPTS, tokens, aux_layer_ids, HIDDEN)


# ---------------------------------------------------------------- image logits = unmasked LM head rows


def test_image_logits_equal_the_unmasked_lm_head_rows(lumina):
    conditioning = lumina.condition(PROMPTS, cfg=True)
    tokens = random_tokens(lumina, (4, 5), 4)
    ids = torch.cat([lumina.prompt_ids(PROMPTS, cfg=True)[0], lumina.to_chameleon_ids(tokens)], dim=1)
    mask = torch.cat([conditioning.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1).long()
    with torch.no_grad():
        out = lumina.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    full = lumina.model.lm_head(out.hidden_states[-1])  # (R, S, vocab) unmasked
    cache = lumina.allocate_cache(4, lumina.prefix_length + 5)
    lumina.prefill(conditioning, cache)
    ours = lumina.forward(tokens, lumina.image_positions(torch.arange(5)), cache).logits
    torch.testing.assert_close(ours, full[:, -5:, lumina.token_ids], atol=2e-5, rtol=1e-4)
    # transformers masks the code logits (finfo.min) but not end-of-line / end-of-image: ours are real numbers
    masked = out.logits[:, -5:, lumina.token_ids]
    assert (masked[..., : lumina.num_codes] == torch.finfo(masked.dtype).min).all()
    torch.testing.assert_close(masked[..., lumina.num_codes :], ours[..., lumina.num_codes :], atol=2e-5, rtol=1e-4)
    assert ours[..., : lumina.num_codes].abs().max() < 1e3


# ---------------------------------------------------------------- tree mask == branch by branch

PARENTS = [-1, 0, 0, 1, 2, 3]


def test_tree_forward_equals_branch_by_branch(lumina):
    rows, done = 2 * len(PROMPTS), 3
    committed = random_tokens(lumina, (rows, done), 2)
    nodes = random_tokens(lumina, (rows, len(PARENTS)), 3)
    chain = list(range(-1, len(PARENTS) - 1))
    row_parents = [PARENTS, chain, PARENTS, chain]
    mask = torch.stack([tree_mask_of(p) for p in row_parents])  # (R, T, T)
    positions = torch.stack([lumina.image_positions(done + depths_of(p)) for p in row_parents])
    cache = prefilled(lumina, PROMPTS, committed, len(PARENTS))
    tree = lumina.forward(nodes, positions, cache, tree_mask=mask, return_aux=True)
    for row, parents in enumerate(row_parents):
        for node in range(len(PARENTS)):
            path = path_to(parents, node)
            fresh = prefilled(lumina, PROMPTS, committed, len(path))
            branch = lumina.forward(nodes[:, path], lumina.image_positions(torch.arange(done, done + len(path))),
                                    fresh, return_aux=True)  # fmt: skip
            torch.testing.assert_close(tree.logits[row, node], branch.logits[row, -1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(tree.aux[row, node], branch.aux[row, -1], atol=2e-5, rtol=1e-4)
    shared = lumina.forward(nodes, lumina.image_positions(done + depths_of(PARENTS)),
                            prefilled(lumina, PROMPTS, committed, len(PARENTS)),
                            tree_mask=tree_mask_of(PARENTS))  # fmt: skip
    torch.testing.assert_close(shared.logits[0], tree.logits[0], atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- upstream's sampler, emulated


def upstream_greedy(target: LuminaTarget, prompt: str) -> list[int]:
    """Lumina-mGPT's loop with transformers' Chameleon: cond = full unpadded prompt + header, uncond = header
    alone in its own cache from position 0, CFG on raw full-vocab logits, then MultiModalLogitsProcessor, argmax."""
    model = target.model
    cond = target.prompt_ids([prompt], cfg=False)[0]
    cond = cond[:, target.prompt_ids([prompt], cfg=False)[1][0]]  # drop padding
    uncond = torch.tensor([target.header_ids])
    caches = [transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)]
    inputs = [cond, uncond]
    image_ids = torch.tensor(sorted(model.model.vocabulary_mapping.image_tokens))
    suppress = torch.ones(model.config.vocab_size, dtype=torch.bool)
    suppress[image_ids] = False
    out_ids: list[int] = []
    width = target.cols
    for step in range(target.geometry.num_tokens + 1):
        logits = []
        for i in range(2):
            with torch.no_grad():
                out = model.model(input_ids=inputs[i], cache=caches[i], use_cache=True)
            logits.append(model.lm_head(out.last_hidden_state[:, -1]))
        scores = CFG * (logits[0] - logits[1]) + logits[1]
        if (step + 1) % (width + 1) == 0:
            token = target.eol_id
        elif step + 1 == (width + 1) * target.rows + 1:
            token = target.eoi_id
        else:
            token = int(scores.masked_fill(suppress, float("-inf")).argmax(-1))
        out_ids.append(token)
        inputs = [torch.tensor([[token]])] * 2
    return out_ids


def test_greedy_tokens_with_the_layout_rule_equal_upstreams_sampler(lumina):
    """Our prefix (left-padded [cond; uncond] rows, forced header) + CFG + `apply_layout` == upstream's loop."""
    conditioning = lumina.condition(PROMPTS, cfg=True)
    num = lumina.geometry.num_tokens
    cache = lumina.allocate_cache(conditioning.rows, lumina.prefix_length + num + 1)
    logits = lumina.prefill(conditioning, cache).logits[:, -1]
    tokens = []
    for index in range(num + 1):
        guided = lumina.apply_layout(combine_cfg(logits, CFG), torch.tensor(index))
        token = guided.argmax(-1)
        tokens.append(token)
        step = torch.cat([token, token])[:, None]  # (R, 1): the same token in both halves
        logits = lumina.forward(step, lumina.image_positions(torch.tensor([index])), cache).logits[:, -1]
    ours = torch.stack(tokens, dim=1)  # (B, G + 1) interface indices, the last one end-of-image
    assert ours[:, -1].eq(lumina.eoi_index).all()
    for row, prompt in enumerate(PROMPTS):
        assert lumina.chameleon_ids(ours[row : row + 1, :num])[0, 3:].tolist() == upstream_greedy(lumina, prompt)
    assert len(ours[:, :num].unique()) > 4  # a non-degenerate image
    codes = lumina.image_codes(ours[:, :num])
    assert codes.shape == (2, *GRID)


def assert_layout(target: LuminaTarget, tokens: torch.Tensor) -> None:
    """End-of-line exactly at the row ends, VQ codes everywhere else."""
    row_end = torch.arange(target.geometry.num_tokens) % (target.cols + 1) == target.cols
    assert tokens[:, row_end].eq(target.eol_index).all()
    assert tokens[:, ~row_end].lt(target.num_codes).all()


def test_generate_ar_applies_the_layout_rule(lumina):
    greedy = dataclasses.replace(lumina.sampling, temperature=0.0, top_k=None)
    assert greedy.cfg_scale == CFG
    tokens = generate_ar(lumina, PROMPTS, greedy).tokens
    assert tokens.shape == (2, lumina.geometry.num_tokens)
    assert_layout(lumina, tokens)
    for row, prompt in enumerate(PROMPTS):  # greedy AR = upstream greedy loop
        assert lumina.chameleon_ids(tokens[row : row + 1])[0, 3:].tolist() == upstream_greedy(lumina, prompt)
    sampled = generate_ar(lumina, PROMPTS * 4, generator=torch.Generator().manual_seed(0)).tokens  # official top-k
    assert_layout(lumina, sampled)


def test_speculative_decoding_applies_the_layout_rule(lumina):
    greedy = dataclasses.replace(lumina.sampling, temperature=0.0, top_k=None)
    expected = generate_ar(lumina, PROMPTS, greedy).tokens
    drafter = OracleDrafter(lumina, scale=0.5)
    config = DecoderConfig(tree="dynamic", top_k=3, depth=4, total_tokens=12)
    result = generate_speculative(lumina, drafter, PROMPTS, ExactRule(), config, greedy)
    assert torch.equal(result.tokens, expected)
    assert result.tau > 1.0  # the forced end-of-line tokens are drafted and accepted
    sampled = generate_speculative(
        lumina, drafter, PROMPTS, ExactRule(), config, generator=torch.Generator().manual_seed(0)
    ).tokens
    assert_layout(lumina, sampled)


# ---------------------------------------------------------------- vocabulary, layout and decoding


def test_vocabulary_map_round_trips(lumina):
    mapping = lumina.model.model.vocabulary_mapping
    V, K = lumina.image_vocab_size, lumina.num_codes
    assert V == CODES + 2 and K == CODES
    every = torch.arange(V)
    assert torch.equal(lumina.from_chameleon_ids(lumina.to_chameleon_ids(every)), every)
    assert [int(lumina.token_ids[k]) for k in range(K)] == [mapping.img2bpe[k] for k in range(K)]
    assert not torch.equal(lumina.token_ids[:K], lumina.token_ids[:K].sort().values)  # shuffled: not an offset map
    vocab = lumina.model.config.vocabulary_map
    assert int(lumina.token_ids[lumina.eol_index]) == vocab["<reserved08799>"]
    assert int(lumina.token_ids[lumina.eoi_index]) == vocab["<eoss>"]
    assert lumina.header_ids == (vocab["<racm3:break>"], vocab["<reserved08802>"], vocab["<reserved08802>"])
    with pytest.raises(ValueError, match="outside the image vocabulary"):
        lumina.from_chameleon_ids(torch.tensor([lumina.bos_id]))
    # the VQ encoder's codes (transformers' get_image_tokens gives BPE ids) come back through our map
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bpe = lumina.model.model.get_image_tokens(pixels)  # (2, 16) BPE ids
        codes = lumina.model.model.vqmodel.encode(pixels).image_tokens.view(2, -1)
    assert torch.equal(lumina.from_chameleon_ids(bpe), codes)


def test_layout_mask_follows_upstreams_processor(lumina):
    G, K, cols = lumina.geometry.num_tokens, lumina.num_codes, lumina.cols
    assert lumina.geometry.grid == (4, 5) and G == 20 and lumina.geometry.image_size == (8, 8)
    mask = lumina.layout_mask(torch.arange(G + 1))
    assert mask.shape == (G + 1, lumina.image_vocab_size)
    for j in range(G + 1):
        if j == G:
            assert mask[j].nonzero().flatten().tolist() == [lumina.eoi_index]
        elif j % (cols + 1) == cols:
            assert mask[j].nonzero().flatten().tolist() == [lumina.eol_index]
        else:
            assert mask[j, :K].all() and not mask[j, K:].any()
    logits = torch.zeros(3, lumina.image_vocab_size)
    forced = lumina.apply_layout(logits, torch.tensor([0, cols, G]))
    assert forced.argmax(-1).tolist() == [0, lumina.eol_index, lumina.eoi_index]
    with pytest.raises(ValueError):
        lumina.layout_mask(torch.tensor(G + 1))


def test_decode_images_strips_the_layout_and_decodes(lumina):
    codes = torch.randint(0, CODES, (2, *GRID), generator=torch.Generator().manual_seed(6))
    eol = torch.full((2, GRID[0], 1), lumina.eol_index)
    tokens = torch.cat([codes, eol], dim=2).flatten(1)  # (2, G)
    assert torch.equal(lumina.image_codes(tokens), codes)
    images = lumina.decode_images(tokens)
    assert images.shape == (2, 8, 8, 3) and images.dtype == torch.uint8
    want = ((tiny_decoder(lumina.model)(codes).clamp(-1, 1) + 1) / 2 * 255).to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(images, want)
    bad = tokens.clone()
    bad[0, 0] = lumina.eol_index
    with pytest.raises(ValueError, match="not a VQ code"):
        lumina.decode_images(bad)
    bare = LuminaTarget(lumina.model, lumina.tokenizer, grid=GRID, max_prompt_tokens=32)
    with pytest.raises(NotImplementedError, match="no VQ decoder"):
        bare.decode_images(tokens)


# ---------------------------------------------------------------- the ImageTarget contract


def test_prompt_rows_follow_the_official_format_and_cfg_rule(lumina):
    ids, valid = lumina.prompt_ids(PROMPTS, cfg=True)
    assert ids.shape == valid.shape == (4, lumina.prefix_length)
    vocab = lumina.model.config.vocabulary_map
    header = [vocab["<racm3:break>"], vocab["<reserved08802>"], vocab["<reserved08802>"]]
    for row, prompt in enumerate(PROMPTS):
        text = f"Generate an image of 64x64 according to the following prompt:\n{prompt}"
        assert lumina.prompt_text(prompt) == text
        body = lumina.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert vocab["<unk>"] not in body
        assert ids[row, valid[row]].tolist() == [1, *body, vocab[END_OF_TURN], *header]
        assert ids[2 + row, valid[2 + row]].tolist() == header  # uncond: the header alone, no BOS, no text
    assert valid[:, -3:].all() and valid[2:].sum(1).eq(3).all()
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        lumina.prompt_ids([" ".join(["long"] * 40)])
    # the real layout: the default 48 x 48 codes give "768x768" in the prompt, 2352 tokens, a 2356-token span
    real = LuminaTarget(lumina.model, lumina.tokenizer, max_prompt_tokens=32)
    assert real.prompt_text("x") == "Generate an image of 768x768 according to the following prompt:\nx"
    assert real.geometry.grid == (48, 49) and real.geometry.num_tokens == 2352
    assert real.header_ids == (vocab["<racm3:break>"], vocab["<reserved08824>"], vocab["<reserved08824>"])
    laid_out = real.layout_mask(torch.arange(2352)).long().argmax(-1)[None]  # code 0, EOL at each row end
    span = real.chameleon_ids(laid_out)
    assert span.shape == (1, 2356) and span[0, -1] == vocab["<eoss>"] and span[0, 3 + 48] == vocab["<reserved08799>"]
    assert PROMPT_TEMPLATE.format(width=768, height=768, prompt="x") == real.prompt_text("x")


def test_condition_prefill_and_forward_keep_the_contract(lumina):
    conditioning = lumina.condition(PROMPTS, cfg=True)
    assert conditioning.rows == 4 and conditioning.num_prompts == 2 and conditioning.cfg
    assert conditioning.inputs_embeds.shape == (4, lumina.prefix_length, HIDDEN)
    ids, valid = lumina.prompt_ids(PROMPTS, cfg=True)
    torch.testing.assert_close(conditioning.inputs_embeds, lumina.model.get_input_embeddings()(ids))
    assert torch.equal(conditioning.valid, valid)
    single = lumina.condition(PROMPTS[1:], cfg=False)
    assert single.rows == 1 and not single.cfg
    torch.testing.assert_close(single.inputs_embeds[0], conditioning.inputs_embeds[1])

    cache = lumina.allocate_cache(4, lumina.prefix_length + 4)
    assert cache.keys.shape == (4, 4, 2, lumina.prefix_length + 4, HIDDEN // 4)
    first = lumina.prefill(conditioning, cache, return_aux=True)
    assert first.logits.shape == (4, lumina.prefix_length, lumina.image_vocab_size)
    assert first.hidden.shape == (4, lumina.prefix_length, HIDDEN)
    assert first.aux.shape == (4, lumina.prefix_length, 3 * HIDDEN)
    # the prefill's last output predicts image token 0: the same logits as the unpadded cond prompt, and as
    # upstream's separate uncond context (the header alone at positions 0, 1, 2)
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            cond_ids, cond_valid = lumina.prompt_ids([prompt], cfg=False)
            alone = lumina.model.model(input_ids=cond_ids[:, cond_valid[0]]).last_hidden_state[:, -1]
            torch.testing.assert_close(first.logits[row, -1], lumina.image_head(alone)[0], atol=2e-5, rtol=1e-4)
        header = lumina.model.model(input_ids=torch.tensor([lumina.header_ids])).last_hidden_state[:, -1]
        for row in (2, 3):
            torch.testing.assert_close(first.logits[row, -1], lumina.image_head(header)[0], atol=2e-5, rtol=1e-4)
    step = lumina.forward(torch.zeros(4, 1, dtype=torch.long), lumina.image_positions(torch.tensor([0])), cache)
    assert step.logits.shape == (4, 1, lumina.image_vocab_size) and step.aux is None
    assert lumina.image_positions(torch.tensor([0, 5])).tolist() == [lumina.prefix_length, lumina.prefix_length + 5]
    assert lumina.embed_image_tokens(torch.tensor([[0, lumina.eol_index]])).shape == (1, 2, HIDDEN)
    assert lumina.sampling.cfg_scale == 3.0 and lumina.sampling.top_k == 2000 and lumina.sampling.temperature == 1.0
    assert lumina.aux_layer_ids == (1, 2, 3) and lumina.family == "lumina"
    assert LuminaTarget(lumina.model, lumina.tokenizer, grid=GRID, max_prompt_tokens=32).aux_layer_ids == (2, 2, 1)


def test_registry_knows_lumina(lumina, monkeypatch):
    assert "lumina-mgpt-7b" in registry.TARGET_LOADERS
    seen = {}

    def fake(cls, path, dtype=None, device=None, **kwargs):
        seen.update(path=path, dtype=dtype, device=device, **kwargs)
        return lumina

    monkeypatch.setattr(LuminaTarget, "from_pretrained", classmethod(fake))
    assert registry.load_target("lumina-mgpt-7b", path="/models/lumina", dtype="bfloat16") is lumina
    assert seen["path"] == "/models/lumina" and seen["dtype"] == "bfloat16"
    registry.load_target("lumina-mgpt-7b")
    assert seen["path"] == "Alpha-VLLM/Lumina-mGPT-7B-768"


def test_rejects_attention_that_ignores_masks_and_bad_grids():
    model, tokenizer = build_tiny_lumina()
    with pytest.raises(ValueError, match="even"):
        LuminaTarget(model, tokenizer, grid=(3, 4))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation"):
        LuminaTarget(model, tokenizer, grid=GRID)
