"""The LlamaGen t2i target on tiny random pieces with the real parameter names.

A tiny `T5EncoderModel` (transformers' real class) with an in-memory word-level tokenizer feeds a
tiny LlamaGen GPT; a tiny VQ-16 decoder decodes. Checks: the VQ-16 key table against the official
architecture (and transformers' independent Janus VQ port of the same tokenizer, numerically),
strict checkpoint loading, upstream's caption padding, the `ImageTarget` contract, cached ==
uncached, tree mask == branch by branch, speculative greedy == AR greedy, and loading through the
registry from files in the official formats.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from conftest import depths_of, path_to, prefilled, tree_mask_of
from stub_drafters import OracleDrafter

from inference.decoding.autoregressive import generate_ar
from inference.decoding.eagle import EagleDrafter
from inference.decoding.sampling import combine_cfg
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.verify import ExactRule
from models import registry
from models.eagle import EagleDraftModel, drafter_preset
from models.llamagen import LLAMAGEN_PRESETS, LlamaGenConfig, LlamaGenTransformer, build_rotary_table_2d
from models.llamagen_t2i import (
    LANTERN_SAMPLING,
    OFFICIAL_SAMPLING,
    LlamaGenT2ITarget,
    clean_caption,
    preprocess_caption,
    resolve_file,
    resolve_preset,
)
from models.vq16 import VQ16Config, VQ16Decoder, load_vq16_checkpoint
from training.callbacks import build_rule

transformers = pytest.importorskip("transformers")

PROMPTS = ["A red fox in the snow", "a small blue house under a big green tree at night, with stars"]
LONG = " ".join(["long"] * 30)
WIDTH = 32  # GPT width D
CAPTION = 32  # T5 d_model = caption_dim F
SLOTS = 16  # caption slots C (120 for the real model)
GPT_CONFIG = LlamaGenConfig(dim=WIDTH, num_layers=4, num_heads=2, multiple_of=32, vocab_size=64, caption_dim=CAPTION,
                            cls_token_num=SLOTS, grid_size=4, aux_layer_ids=(1, 2, 3))  # fmt: skip
VQ_CONFIG = VQ16Config(codebook_size=64, codebook_embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 2), num_res_blocks=1)


# ---------------------------------------------------------------- tiny pieces


def build_tiny_tokenizer():
    """A T5-like word-level tokenizer: <pad> 0, </s> 1 appended to every caption, <unk> 2, right padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    splitter = pre_tokenizers.Whitespace()
    words = sorted({w for p in [*PROMPTS, LONG] for w, _ in splitter.pre_tokenize_str(preprocess_caption(p))})
    vocab = {token: i for i, token in enumerate(["<pad>", "</s>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = splitter
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def build_tiny_t5(vocab_size: int, seed: int = 0):
    """transformers' T5EncoderModel at a tiny size, gated-GELU like FLAN-T5."""
    config = transformers.T5Config(vocab_size=vocab_size, d_model=CAPTION, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16, dropout_rate=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.T5EncoderModel(config).eval()


def build_tiny_gpt(seed: int = 0, config: LlamaGenConfig = GPT_CONFIG) -> LlamaGenTransformer:
    torch.manual_seed(seed)
    gpt = LlamaGenTransformer(dataclasses.replace(config))
    for parameter in gpt.parameters():  # larger weights than the init, so greedy tokens vary along the image
        parameter.data.normal_(0, 0.15)
    return gpt


def build_tiny_vq(seed: int = 0) -> VQ16Decoder:
    torch.manual_seed(seed)
    vq = VQ16Decoder(VQ_CONFIG)
    for name, parameter in vq.named_parameters():
        if "norm" not in name:
            parameter.data.normal_(0, 0.2)
    return vq


def build_target(**kwargs) -> LlamaGenT2ITarget:
    tokenizer = build_tiny_tokenizer()
    return LlamaGenT2ITarget(build_tiny_gpt(), build_tiny_vq(), build_tiny_t5(len(tokenizer)), tokenizer,
                             name="tiny-llamagen", **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def llamagen() -> LlamaGenT2ITarget:
    return build_target()


# ---------------------------------------------------------------- (a) VQ-16: the official key table


def official_vq_shapes(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=256, embed=8, codes=16384):
    """Every key of an official `VQ_16` checkpoint with its shape, following upstream's VQModel.__init__.

    Returns (decoder_path, encoder_path): the keys decoding uses, and the rest (encoder, quant_conv,
    codebook_used) which the loader must skip.
    """
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name, c_in, c_out, k):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (c_out, c_in, k, k), (c_out,)

    def norm(name, c):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (c,), (c,)

    def res(name, c_in, c_out):
        norm(f"{name}.norm1", c_in), conv(f"{name}.conv1", c_in, c_out, 3)
        norm(f"{name}.norm2", c_out), conv(f"{name}.conv2", c_out, c_out, 3)
        if c_in != c_out:
            conv(f"{name}.nin_shortcut", c_in, c_out, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for projection in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{projection}", c, c, 1)

    def mid(prefix, c):
        res(f"{prefix}.mid.0", c, c), attn(f"{prefix}.mid.1", c), res(f"{prefix}.mid.2", c, c)

    levels = len(ch_mult)
    # encoder: conv_blocks in order of resolution, num_res_blocks each, attention at the deepest level
    conv("encoder.conv_in", 3, ch, 3)
    c_in = ch
    for i in range(levels):
        c_out = ch * ch_mult[i]
        for j in range(num_res_blocks):
            res(f"encoder.conv_blocks.{i}.res.{j}", c_in, c_out)
            c_in = c_out
            if i == levels - 1:
                attn(f"encoder.conv_blocks.{i}.attn.{j}", c_out)
        if i != levels - 1:
            conv(f"encoder.conv_blocks.{i}.downsample.conv", c_out, c_out, 3)
    mid("encoder", c_in)
    norm("encoder.norm_out", c_in), conv("encoder.conv_out", c_in, z, 3)
    conv("quant_conv", z, embed, 1)
    shapes["quantize.codebook_used"] = (65536,)
    encoder_path = dict(shapes)
    shapes.clear()
    # decoder: conv_blocks from the deepest level up, num_res_blocks + 1 each
    c_in = ch * ch_mult[-1]
    conv("decoder.conv_in", z, c_in, 3)
    mid("decoder", c_in)
    for i, level in enumerate(reversed(range(levels))):
        c_out = ch * ch_mult[level]
        for j in range(num_res_blocks + 1):
            res(f"decoder.conv_blocks.{i}.res.{j}", c_in, c_out)
            c_in = c_out
            if level == levels - 1:
                attn(f"decoder.conv_blocks.{i}.attn.{j}", c_out)
        if level != 0:
            conv(f"decoder.conv_blocks.{i}.upsample.conv", c_out, c_out, 3)
    norm("decoder.norm_out", c_in), conv("decoder.conv_out", c_in, 3, 3)
    conv("post_quant_conv", embed, z, 1)
    shapes["quantize.embedding.weight"] = (codes, embed)
    return dict(shapes), encoder_path


def shape_table(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in module.state_dict().items()}


def janus_to_official(key: str) -> str:
    """transformers' Janus VQ names -> original names (the inverse of convert_janus_weights_to_hf's renames)."""
    key = re.sub(r"decoder\.up\.(\d+)\.block\.", r"decoder.conv_blocks.\1.res.", key)
    key = re.sub(r"decoder\.up\.(\d+)\.", r"decoder.conv_blocks.\1.", key)
    for new, old in (("block_1", "0"), ("attn_1", "1"), ("block_2", "2")):
        key = key.replace(f"decoder.mid.{new}.", f"decoder.mid.{old}.")
    return key


def test_vq16_key_table_matches_the_official_architecture():
    ours = shape_table(VQ16Decoder())  # the official VQ-16 (42.6 M decoder-path parameters; meta init is slower)
    decoder_path, encoder_path = official_vq_shapes()
    assert ours == decoder_path
    total = sum(torch.Size(s).numel() for s in [*decoder_path.values(), *encoder_path.values()])
    assert 71.5e6 < total - 65536 < 72.5e6  # the README's "72M" VQ tokenizer
    assert ours["decoder.conv_in.weight"] == (512, 256, 3, 3) and ours["decoder.conv_out.weight"] == (3, 128, 3, 3)
    assert ours["decoder.conv_blocks.1.res.0.nin_shortcut.weight"] == (256, 512, 1, 1)
    assert ours["decoder.conv_blocks.0.attn.2.proj_out.weight"] == (512, 512, 1, 1)
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in ours
    assert VQ16Config().downsample == 16


def test_vq16_key_table_matches_transformers_janus_vq_port():
    """transformers' JanusVQVAE is an independent port of the same tokenizer (Janus reuses LlamaGen's VQ-16).

    Official levels and res blocks at reduced widths (ch 32, z 32, 64 codes), to stay fast.
    """
    config = transformers.JanusVQVAEConfig(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32)
    assert tuple(config.channel_multiplier) == (1, 1, 2, 2, 4) and config.num_res_blocks == 2
    janus = transformers.JanusVQVAE(config)
    ours = shape_table(VQ16Decoder(VQ16Config(codebook_size=64, z_channels=32, ch=32)))
    theirs = {janus_to_official(k): s for k, s in shape_table(janus).items()
              if k.startswith(("decoder.", "post_quant_conv.", "quantize."))}  # fmt: skip
    assert theirs == ours
    assert ours == official_vq_shapes(ch=32, z=32, codes=64)[0]


def test_vq16_decode_equals_transformers_janus_vq_decode():
    vq = build_tiny_vq()
    config = transformers.JanusVQVAEConfig(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32,
                                           channel_multiplier=[1, 2], num_res_blocks=1, num_patches=4)  # fmt: skip
    janus = transformers.JanusVQVAE(config).eval()
    renamed = {k: k2 for k in janus.state_dict() if (k2 := janus_to_official(k)) in vq.state_dict()}
    assert len(renamed) == len(vq.state_dict())
    janus.load_state_dict({k: vq.state_dict()[k2] for k, k2 in renamed.items()}, strict=False)
    codes = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = vq.decode_code(codes, (4, 4)), janus.decode(codes)
    assert ours.shape == (3, 3, 8, 8)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def official_checkpoint(vq: VQ16Decoder) -> dict[str, torch.Tensor]:
    """A random checkpoint in the official layout: our decoder weights plus encoder-path keys."""
    config = vq.config
    _, encoder_path = official_vq_shapes(config.ch, config.ch_mult, config.num_res_blocks, config.z_channels,
                                         config.codebook_embed_dim, config.codebook_size)  # fmt: skip
    state = {k: torch.randn(s) for k, s in encoder_path.items()}
    return {**state, **{k: v.clone() for k, v in vq.state_dict().items()}}


def test_vq16_checkpoint_loads_strictly_and_names_bad_keys(tmp_path):
    vq = build_tiny_vq()
    state = official_checkpoint(vq)
    path = tmp_path / "vq_ds16_t2i.pt"
    torch.save({"model": state, "args": argparse.Namespace(vq_model="VQ-16")}, path)  # as training saves it
    loaded = load_vq16_checkpoint(path, VQ_CONFIG)
    for key, value in vq.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())

    broken = dict(state)
    del broken["decoder.conv_blocks.0.attn.1.q.bias"]
    broken["decoder.conv_blocks.0.res.7.conv1.weight"] = torch.zeros(1)
    torch.save({"model": broken}, path)
    with pytest.raises(ValueError, match=r"missing keys \['decoder\.conv_blocks\.0\.attn\.1\.q\.bias'\]") as error:
        load_vq16_checkpoint(path, VQ_CONFIG)
    assert "unexpected keys ['decoder.conv_blocks.0.res.7.conv1.weight']" in str(error.value)
    torch.save(state, path)  # a bare state dict is fine; a wrong codebook size is named with both shapes
    with pytest.raises(ValueError, match=r"quantize\.embedding\.weight \(64, 8\) vs \(128, 8\)"):
        load_vq16_checkpoint(path, dataclasses.replace(VQ_CONFIG, codebook_size=128))


# ---------------------------------------------------------------- (b) captions as upstream


def test_caption_cleaning_of_plain_text_prompts():
    assert clean_caption("A Red FOX in the snow") == "a red fox in the snow"
    assert clean_caption("a cat,sitting on a mat") == "a cat, sitting on a mat"
    assert clean_caption("Visit https://example.com/cats for a cat") == "visit for a cat"
    assert clean_caption("<b>Bold</b> text &amp; more") == "bold text & more"
    assert clean_caption("\u201cQuoted\u201d  words") == '"quoted" words'
    assert clean_caption("3.5 apples, 2 pears") == "3.5 apples, 2 pears"  # decimals stay whole
    assert preprocess_caption("  A Dog  ") == "a dog" and preprocess_caption("A,b", clean=False) == "a,b"


def upstream_caption_features(target: LlamaGenT2ITarget, prompts: list[str]):
    """upstream T5Embedder.get_text_embeddings + sample_t2i.py's left padding, line by line."""
    texts = [preprocess_caption(p) for p in prompts]
    tokens = target.tokenizer(texts, max_length=SLOTS, padding="max_length", truncation=True,
                              return_attention_mask=True, add_special_tokens=True, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        embs = target.text_encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    caption_embs, emb_masks = embs["last_hidden_state"], tokens["attention_mask"]
    new_emb_masks = torch.flip(emb_masks, dims=[-1])
    new_caption_embs = []
    for caption_emb, emb_mask in zip(caption_embs, emb_masks, strict=True):
        valid_num = int(emb_mask.sum().item())
        new_caption_embs.append(torch.cat([caption_emb[valid_num:], caption_emb[:valid_num]]))
    return torch.stack(new_caption_embs) * new_emb_masks[:, :, None], new_emb_masks, tokens


def test_caption_features_are_upstreams_left_padded_t5_states(llamagen):
    prompts = [*PROMPTS, LONG]
    features, valid = llamagen.caption_features(prompts)
    want, want_mask, tokens = upstream_caption_features(llamagen, prompts)
    torch.testing.assert_close(features, want)
    assert torch.equal(valid, want_mask.bool())
    lengths = valid.sum(1).tolist()
    assert lengths == [7, 15, SLOTS]  # 6 words + </s>; 14 (the comma too) + </s>; truncated
    assert tokens["input_ids"][2, -1] == 1  # truncation keeps </s>, as T5's tokenizer does
    assert valid[:, -1].all() and features[~valid].eq(0).all() and not features[valid].eq(0).all(-1).any()
    alone = llamagen.caption_features(PROMPTS[:1])[0]
    torch.testing.assert_close(alone[0], features[0], atol=1e-6, rtol=1e-5)  # padding does not leak in
    # upstream cleans captions: case and glued punctuation do not change the features
    torch.testing.assert_close(llamagen.caption_features(["a RED fox in the Snow"])[0][0], features[0])


def test_condition_lays_out_cond_rows_then_the_learned_uncond_caption(llamagen):
    conditioning = llamagen.condition(PROMPTS, cfg=True)
    assert conditioning.rows == 4 and conditioning.num_prompts == 2 and conditioning.cfg
    assert conditioning.inputs_embeds.shape == (4, SLOTS, WIDTH)
    features, valid = llamagen.caption_features(PROMPTS)
    gpt = llamagen.gpt
    torch.testing.assert_close(conditioning.inputs_embeds[:2], gpt.cls_embedding.cap_proj(features))
    uncond = gpt.cls_embedding.cap_proj(gpt.cls_embedding.uncond_embedding)  # zeros_like(cond) + uncond_embedding
    for row in (2, 3):
        torch.testing.assert_close(conditioning.inputs_embeds[row], uncond)
    assert torch.equal(conditioning.valid, torch.cat([valid, valid]))  # uncond rows reuse their cond row's mask
    assert torch.equal(conditioning.positions, torch.arange(SLOTS))
    single = llamagen.condition(PROMPTS[1:], cfg=False)
    assert single.rows == 1
    torch.testing.assert_close(single.inputs_embeds[0], conditioning.inputs_embeds[1], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- (c) the ImageTarget contract


def test_prefill_and_forward_keep_the_contract(llamagen):
    conditioning = llamagen.condition(PROMPTS, cfg=True)
    cache = llamagen.allocate_cache(4, SLOTS + 4)
    assert cache.keys.shape == (4, 4, 2, SLOTS + 4, WIDTH // 2)
    first = llamagen.prefill(conditioning, cache, return_aux=True)
    assert first.logits.shape == (4, SLOTS, 64) and first.logits.dtype == torch.float32
    assert first.hidden.shape == (4, SLOTS, WIDTH) and first.aux.shape == (4, SLOTS, 3 * WIDTH)
    # the last caption slot predicts image token 0: the first greedy token is its guided argmax
    greedy = dataclasses.replace(llamagen.sampling, temperature=0.0)
    token0 = generate_ar(llamagen, PROMPTS, greedy).tokens[:, 0]
    assert torch.equal(combine_cfg(first.logits[:, -1], OFFICIAL_SAMPLING.cfg_scale).argmax(-1), token0)

    tokens = torch.cat([token0, token0])[:, None].repeat(1, 3)
    out = llamagen.forward(tokens, llamagen.image_positions(torch.arange(3)), cache, return_aux=True)
    assert out.logits.shape == (4, 3, 64) and out.hidden.shape == (4, 3, WIDTH) and out.aux.shape == (4, 3, 3 * WIDTH)
    torch.testing.assert_close(out.logits, llamagen.image_head(out.hidden))
    torch.testing.assert_close(out.logits, llamagen.gpt.output(out.hidden))
    assert llamagen.forward(tokens[:, :1], llamagen.image_positions(torch.tensor([3])), cache).aux is None
    assert cache.length == SLOTS + 4
    embedding = llamagen.embed_image_tokens(tokens)
    torch.testing.assert_close(embedding, llamagen.gpt.tok_embeddings(tokens))
    assert embedding.shape == (4, 3, WIDTH) and not embedding.requires_grad
    assert torch.equal(llamagen.image_positions(torch.arange(3)), torch.arange(SLOTS, SLOTS + 3))


def test_geometry_sampling_presets_and_decode(llamagen):
    assert llamagen.sampling == OFFICIAL_SAMPLING
    assert (OFFICIAL_SAMPLING.cfg_scale, OFFICIAL_SAMPLING.top_k, OFFICIAL_SAMPLING.top_p) == (7.5, 1000, 1.0)
    assert (LANTERN_SAMPLING.cfg_scale, LANTERN_SAMPLING.top_k, LANTERN_SAMPLING.temperature) == (3.0, 2000, 1.0)
    assert build_target(sampling="cascade").sampling == LANTERN_SAMPLING
    with pytest.raises(ValueError, match="unknown sampling preset"):
        build_target(sampling="fast")
    assert llamagen.geometry.grid == (4, 4) and llamagen.geometry.image_size == (8, 8)
    assert llamagen.num_layers == 4 and llamagen.hidden_size == WIDTH and llamagen.image_vocab_size == 64
    assert llamagen.prefix_length == SLOTS and llamagen.aux_layer_ids == (1, 2, 3) and llamagen.family == "llamagen"
    assert build_target(aux_layer_ids=(0, 2, 4)).aux_layer_ids == (0, 2, 4)
    default = LlamaGenConfig(**{**dataclasses.asdict(GPT_CONFIG), "aux_layer_ids": None})
    assert default.aux_layer_ids == (2, 2, 1)  # (2, L // 2, L - 3)
    assert LLAMAGEN_PRESETS["t2i-XL-stage2"].aux_layer_ids == (2, 18, 33)
    assert LLAMAGEN_PRESETS["t2i-XL-stage1"].grid_size == 16 and LLAMAGEN_PRESETS["t2i-XL-stage2"].grid_size == 32

    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(4))
    images = llamagen.decode_images(tokens)
    assert images.shape == (3, 8, 8, 3) and images.dtype == torch.uint8 and images.device.type == "cpu"
    with torch.no_grad():
        pixels = llamagen.vq.decode_code(tokens, (4, 4))
    assert torch.equal(images, torch.clamp(127.5 * pixels + 128.0, 0, 255).permute(0, 2, 3, 1).to(torch.uint8))
    assert len(images.unique()) > 10
    # LANTERN's neighbour table reads the raw codebook
    rule = build_rule("lantern", llamagen)
    distance = torch.cdist(llamagen.vq.codebook, llamagen.vq.codebook)
    assert torch.equal(rule.neighbours[:, 0], distance.fill_diagonal_(float("inf")).argmin(-1))


def test_pieces_must_fit_together():
    tokenizer = build_tiny_tokenizer()
    t5 = build_tiny_t5(len(tokenizer))
    with pytest.raises(ValueError, match="VQ codebook has 64 codes but the GPT's vocabulary is 128"):
        LlamaGenT2ITarget(build_tiny_gpt(config=dataclasses.replace(GPT_CONFIG, vocab_size=128)), build_tiny_vq(),
                          t5, tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="d_model=32 differs from the GPT's caption_dim=48"):
        LlamaGenT2ITarget(build_tiny_gpt(config=dataclasses.replace(GPT_CONFIG, caption_dim=48)), build_tiny_vq(),
                          t5, tokenizer)  # fmt: skip


# ---------------------------------------------------------------- (d) cache, tree masks, speculative decoding


def test_cached_forward_equals_full_uncached_forward(llamagen):
    conditioning = llamagen.condition(PROMPTS, cfg=True)
    rows = conditioning.rows
    tokens = torch.randint(0, 64, (rows, 7), generator=torch.Generator().manual_seed(1))
    cache = llamagen.allocate_cache(rows, SLOTS + 8)
    outputs = [llamagen.prefill(conditioning, cache, return_aux=True)]
    for start, end in [(0, 1), (1, 4), (4, 5), (5, 7)]:
        positions = llamagen.image_positions(torch.arange(start, end))
        outputs.append(llamagen.forward(tokens[:, start:end], positions, cache, return_aux=True))
    inputs = torch.cat([conditioning.inputs_embeds, llamagen.embed_image_tokens(tokens)], dim=1)
    valid = torch.cat([conditioning.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
    with torch.no_grad():  # everything at once, no cache
        hidden, aux = llamagen.gpt(inputs, torch.arange(SLOTS + 7), new_valid=valid, return_aux=True)
    got = {name: torch.cat([getattr(o, name) for o in outputs], dim=1) for name in ("logits", "hidden", "aux")}
    torch.testing.assert_close(got["hidden"][valid], hidden[valid], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got["aux"][valid], aux[valid], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got["logits"][valid], llamagen.image_head(hidden)[valid], atol=2e-5, rtol=1e-4)
    assert cache.length == SLOTS + 7


PARENTS = [-1, 0, 0, 1, 2, 3]  # a; b, c under a; d under b; e under c; f under d


def test_tree_forward_equals_branch_by_branch(llamagen):
    generator = torch.Generator().manual_seed(2)
    rows, done = 2 * len(PROMPTS), 3
    committed = torch.randint(0, 64, (rows, done), generator=generator)
    nodes = torch.randint(0, 64, (rows, len(PARENTS)), generator=generator)
    chain = list(range(-1, len(PARENTS) - 1))  # rows 1 and 3 verify a chain instead: per-row (R, T, T) masks
    row_parents = [PARENTS, chain, PARENTS, chain]
    mask = torch.stack([tree_mask_of(p) for p in row_parents])  # (R, T, T)
    positions = torch.stack([llamagen.image_positions(done + depths_of(p)) for p in row_parents])  # (R, T)
    tree = llamagen.forward(nodes, positions, prefilled(llamagen, PROMPTS, committed, len(PARENTS)), tree_mask=mask,
                            return_aux=True)  # fmt: skip
    for row, parents in enumerate(row_parents):
        for node in range(len(PARENTS)):
            path = path_to(parents, node)
            branch = llamagen.forward(nodes[:, path], llamagen.image_positions(torch.arange(done, done + len(path))),
                                      prefilled(llamagen, PROMPTS, committed, len(path)), return_aux=True)  # fmt: skip
            torch.testing.assert_close(tree.logits[row, node], branch.logits[row, -1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(tree.aux[row, node], branch.aux[row, -1], atol=2e-5, rtol=1e-4)
    fresh = prefilled(llamagen, PROMPTS, committed, len(PARENTS))
    positions = llamagen.image_positions(done + depths_of(PARENTS))
    shared = llamagen.forward(nodes, positions, fresh, tree_mask=tree_mask_of(PARENTS))
    torch.testing.assert_close(shared.logits[0], tree.logits[0], atol=2e-5, rtol=1e-4)


def tiny_eagle_drafter(target: LlamaGenT2ITarget, architecture: str) -> EagleDrafter:
    torch.manual_seed(0)
    model = EagleDraftModel(drafter_preset("tiny", architecture, num_kv_heads=1))
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.3)
    return EagleDrafter(model, target)


@pytest.mark.parametrize(
    "config, make_drafter",
    [
        (DecoderConfig(tree="static"), lambda t: OracleDrafter(t, wrong_every=3)),
        (DecoderConfig(tree="dynamic", top_k=4, depth=3, total_tokens=14), lambda t: OracleDrafter(t, scale=0.3)),
        (DecoderConfig(tree="dynamic", top_k=4, depth=3, total_tokens=14), lambda t: tiny_eagle_drafter(t, "eagle3")),
        (DecoderConfig(tree="static"), lambda t: tiny_eagle_drafter(t, "eagle1")),
    ],
    ids=["oracle-static-partial", "oracle-dynamic-blurred", "eagle3-dynamic-random", "eagle1-static-random"],
)
def test_greedy_speculative_decoding_equals_greedy_ar(llamagen, config, make_drafter):
    greedy = dataclasses.replace(llamagen.sampling, temperature=0.0)
    expected = generate_ar(llamagen, PROMPTS, greedy).tokens
    assert expected.shape == (2, 16) and len(expected.unique()) > 4  # a non-degenerate image
    drafter = make_drafter(llamagen)
    result = generate_speculative(llamagen, drafter, PROMPTS, ExactRule(), config, greedy)
    assert torch.equal(result.tokens, expected)
    if isinstance(drafter, OracleDrafter):
        assert result.tau > 1.5
    alone = torch.cat([generate_ar(llamagen, [prompt], greedy).tokens for prompt in PROMPTS])
    assert torch.equal(expected, alone)  # cond/uncond rows pair up and padding changes nothing


# ---------------------------------------------------------------- (e) loading official-format files


def save_official_files(target: LlamaGenT2ITarget, folder):
    gpt_path, vq_path, t5_path = folder / "t2i_tiny_stage2_512.pt", folder / "vq_ds16_t2i.pt", folder / "flan-t5"
    args = argparse.Namespace(gpt_model="GPT-XL", image_size=512)
    torch.save({"model": target.gpt.state_dict(), "steps": 0, "args": args}, gpt_path)  # as upstream's training saves
    torch.save({"model": official_checkpoint(target.vq)}, vq_path)
    target.text_encoder.save_pretrained(t5_path)
    target.tokenizer.save_pretrained(t5_path)
    return gpt_path, vq_path, t5_path


def test_registry_loads_official_format_files(llamagen, tmp_path):
    gpt_path, vq_path, t5_path = save_official_files(llamagen, tmp_path)
    options = dict(  # JSON-able, as training configs pass loader options
        gpt_checkpoint=str(gpt_path),
        vq_checkpoint=str(vq_path),
        t5_path=str(t5_path),
        preset=dataclasses.asdict(llamagen.gpt.config),
        vq_config=dataclasses.asdict(VQ_CONFIG),
        device="cpu",
        sampling="official",
    )
    target = registry.load_target("llamagen-xl", dtype="float32", **options)
    assert isinstance(target, LlamaGenT2ITarget) and target.name == "llamagen-xl"
    greedy = dataclasses.replace(llamagen.sampling, temperature=0.0)
    assert torch.equal(generate_ar(target, PROMPTS, greedy).tokens, generate_ar(llamagen, PROMPTS, greedy).tokens)
    codes = torch.randint(0, 64, (1, 16))
    assert torch.equal(target.decode_images(codes), llamagen.decode_images(codes))

    half = registry.load_target("llamagen-xl", dtype="bfloat16", **options)  # upstream's --precision bf16
    assert half.gpt.output.weight.dtype == torch.bfloat16 and half.text_encoder.dtype == torch.bfloat16
    assert half.vq.post_quant_conv.weight.dtype == torch.float32  # the VQ decoder stays fp32
    rotary = build_rotary_table_2d(4, WIDTH // 2, 10000.0, SLOTS)
    assert half.gpt.rotary_table.dtype == torch.float32 and torch.equal(half.gpt.rotary_table, rotary)
    conditioning = half.condition(PROMPTS)
    out = half.prefill(conditioning, half.allocate_cache(4, SLOTS), return_aux=True)
    assert out.logits.dtype == torch.float32 and out.aux.dtype == torch.bfloat16


def test_official_presets_and_files_resolve(tmp_path):
    assert resolve_preset(None, "pretrained_models/t2i_XL_stage1_256.pt").grid_size == 16
    assert resolve_preset(None, "t2i_XL_stage2_512.pt").grid_size == 32
    assert resolve_preset(None, None).grid_size == 32
    assert resolve_preset("t2i-XL-stage1", "whatever.pt").num_layers == 36
    with pytest.raises(ValueError, match="cannot tell the stage"):
        resolve_preset(None, "model.pt")
    with pytest.raises(ValueError, match="unknown LlamaGen preset"):
        resolve_preset("XXL", None)
    resolve_preset("t2i-XL-stage2", None).aux_layer_ids = (1, 2, 3)  # a copy: the shared preset is untouched
    assert LLAMAGEN_PRESETS["t2i-XL-stage2"].aux_layer_ids == (2, 18, 33)

    (tmp_path / "vq_ds16_t2i.pt").write_bytes(b"")
    assert resolve_file("vq_ds16_t2i.pt", tmp_path) == tmp_path / "vq_ds16_t2i.pt"
    fetched = resolve_file("t2i_XL_stage2_512.pt", tmp_path, download=lambda name: f"/hub/{name}")
    assert fetched == Path("/hub/t2i_XL_stage2_512.pt")

    def offline(name: str) -> str:
        raise OSError("offline")

    with pytest.raises(FileNotFoundError, match="t2i_XL_stage1_256.pt is neither in .* nor fetchable .*offline"):
        resolve_file("t2i_XL_stage1_256.pt", tmp_path, download=offline)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_file(tmp_path / "missing" / "vq.pt", tmp_path)
