"""The LlamaGen module: KV-cache decoding, tree attention, 2D rotary, and strict loading of official keys."""

from __future__ import annotations

import pytest
import torch

from models.llamagen import (
    LLAMAGEN_PRESETS,
    LlamaGenConfig,
    LlamaGenTransformer,
    RMSNorm,
    build_rotary_table_2d,
    load_llamagen_checkpoint,
)

TINY = LLAMAGEN_PRESETS["tiny"]


def _model(seed: int = 0, config: LlamaGenConfig = TINY) -> LlamaGenTransformer:
    torch.manual_seed(seed)
    model = LlamaGenTransformer(config).eval()
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.2)
    return model


def _sequence(model: LlamaGenTransformer, batch: int = 2, num_image: int = 10):
    """Caption inputs (last two slots padded in row 0) followed by image-token embeddings."""
    config = model.config
    captions = model.embed_captions(torch.randn(batch, config.cls_token_num, config.caption_dim))
    tokens = torch.randint(0, config.vocab_size, (batch, num_image))
    inputs = torch.cat([captions, model.tok_embeddings(tokens)], dim=1)
    valid = torch.ones(batch, inputs.shape[1], dtype=torch.bool)
    valid[0, :2] = False  # left padding of row 0's caption, as LlamaGen left-pads T5 features
    return inputs, valid


@torch.no_grad()
def test_incremental_decode_with_kv_cache_equals_full_forward():
    model = _model()
    inputs, valid = _sequence(model)
    positions = torch.arange(inputs.shape[1])
    full, full_aux = model(inputs, positions, new_valid=valid, return_aux=True)

    cache = model.allocate_cache(rows=2, capacity=inputs.shape[1])
    prefix = TINY.cls_token_num + 3
    parts = [model(inputs[:, :prefix], positions[:prefix], cache, new_valid=valid[:, :prefix], return_aux=True)]
    for t in range(prefix, inputs.shape[1]):
        parts.append(model(inputs[:, t : t + 1], positions[t : t + 1], cache, return_aux=True))
    incremental = torch.cat([p[0] for p in parts], dim=1)
    incremental_aux = torch.cat([p[1] for p in parts], dim=1)

    assert cache.length == inputs.shape[1]
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(incremental_aux, full_aux, atol=1e-5, rtol=1e-4)
    assert full_aux.shape[-1] == 3 * TINY.dim


@torch.no_grad()
def test_tree_mask_forward_equals_each_branch_forward_separately():
    model = _model(1)
    inputs, valid = _sequence(model, batch=2, num_image=3)
    positions = torch.arange(inputs.shape[1])
    prefix_len = inputs.shape[1]
    # A tree of 5 nodes after the prefix: root 0 -> {1, 2}; 1 -> 3; 2 -> 4. Branches: 0-1-3 and 0-2-4.
    parents = [-1, 0, 0, 1, 2]
    depth = torch.tensor([0, 1, 1, 2, 2])
    tree_mask = torch.zeros(5, 5, dtype=torch.bool)
    for node, parent in enumerate(parents):
        tree_mask[node, node] = True
        while parent >= 0:
            tree_mask[node, parent] = True
            parent = parents[parent]
    node_tokens = torch.randint(0, TINY.vocab_size, (2, 5))
    node_positions = prefix_len + depth

    cache = model.allocate_cache(2, prefix_len + 5)
    model(inputs, positions, cache, new_valid=valid)
    tree_hidden, _ = model(model.tok_embeddings(node_tokens), node_positions, cache, tree_mask=tree_mask)

    for branch in ([0, 1, 3], [0, 2, 4]):
        branch_cache = model.allocate_cache(2, prefix_len + 3)
        model(inputs, positions, branch_cache, new_valid=valid)
        branch_hidden, _ = model(model.tok_embeddings(node_tokens[:, branch]), node_positions[branch], branch_cache)
        torch.testing.assert_close(tree_hidden[:, branch], branch_hidden, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_padded_caption_slots_do_not_change_the_image_outputs():
    model = _model(2)
    inputs, valid = _sequence(model, batch=2)
    positions = torch.arange(inputs.shape[1])
    before, _ = model(inputs, positions, new_valid=valid)
    changed = inputs.clone()
    changed[0, :2] = torch.randn_like(changed[0, :2]) * 10  # row 0's padded slots
    after, _ = model(changed, positions, new_valid=valid)
    torch.testing.assert_close(after[0, 2:], before[0, 2:])
    assert not torch.allclose(after[0, :2], before[0, :2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_llamagen_s_fp32_formula_bit_for_bit(dtype):
    """RMSNorm calls F.rms_norm (one fused kernel on CUDA); it must equal LlamaGen's own formula exactly:
    x.float() * rsqrt(mean(x^2) + eps), cast back to x's dtype, then times the weight."""
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    x_float = x.float()
    want = (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * norm.weight
    assert torch.equal(norm(x), want)


def test_rotary_table_zeroes_caption_slots_and_rotates_rows_then_columns():
    table = build_rotary_table_2d(grid_size=4, head_dim=16, base=10000.0, cls_token_num=3)
    assert table.shape == (3 + 16, 8, 2)
    assert torch.count_nonzero(table[:3]) == 0  # caption q/k become zero, as upstream
    cell = 3 + 1 * 4 + 2  # row 1, column 2
    angles = torch.atan2(table[cell, :, 1], table[cell, :, 0])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 4) * 2 / 8))
    torch.testing.assert_close(angles[:4], 1 * inv_freq)  # first half: row index
    torch.testing.assert_close(angles[4:], torch.atan2(torch.sin(2 * inv_freq), torch.cos(2 * inv_freq)))


def _official_key_shapes(config: LlamaGenConfig) -> dict[str, tuple[int, ...]]:
    """The t2i GPT key table of the official checkpoints (their state dicts' keys), at `config`'s sizes."""
    dim, ffn, caption = config.dim, config.ffn_dim, config.caption_dim
    shapes = {
        "cls_embedding.cap_proj.fc1.weight": (dim, caption),
        "cls_embedding.cap_proj.fc2.weight": (dim, dim),
        "cls_embedding.uncond_embedding": (config.cls_token_num, caption),
        "tok_embeddings.weight": (config.vocab_size, dim),
        "norm.weight": (dim,),
        "output.weight": (config.vocab_size, dim),
    }
    for i in range(config.num_layers):
        shapes |= {
            f"layers.{i}.attention.wqkv.weight": (3 * dim, dim),
            f"layers.{i}.attention.wo.weight": (dim, dim),
            f"layers.{i}.feed_forward.w1.weight": (ffn, dim),
            f"layers.{i}.feed_forward.w3.weight": (ffn, dim),
            f"layers.{i}.feed_forward.w2.weight": (dim, ffn),
            f"layers.{i}.attention_norm.weight": (dim,),
            f"layers.{i}.ffn_norm.weight": (dim,),
        }
    return shapes


def test_official_xl_key_layout_and_feed_forward_width():
    xl = LLAMAGEN_PRESETS["t2i-XL-stage2"]
    assert xl.ffn_dim == 3584
    with torch.device("meta"):
        model = LlamaGenTransformer(xl)
    ours = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert ours == _official_key_shapes(xl)
    assert abs(sum(v.numel() for v in model.state_dict().values()) / 1e6 - 777.7) < 1.0


@pytest.mark.parametrize("wrapper", ["model", "module", None])
def test_synthetic_official_checkpoint_loads_strictly(tmp_path, wrapper):
    torch.manual_seed(0)
    state = {key: torch.randn(shape) for key, shape in _official_key_shapes(TINY).items()}
    path = tmp_path / "t2i_tiny.pt"
    torch.save({wrapper: state, "steps": 10} if wrapper else state, path)
    model = load_llamagen_checkpoint(path, TINY)
    for key, value in state.items():
        torch.testing.assert_close(model.state_dict()[key], value)


def test_checkpoint_with_wrong_keys_names_them(tmp_path):
    state = {key: torch.randn(shape) for key, shape in _official_key_shapes(TINY).items()}
    state["cls_embedding.embedding_table.weight"] = state.pop("cls_embedding.cap_proj.fc1.weight")  # a c2i key
    path = tmp_path / "c2i.pt"
    torch.save({"model": state}, path)
    with pytest.raises(ValueError, match=r"missing keys \['cls_embedding.cap_proj.fc1.weight'\].*embedding_table"):
        load_llamagen_checkpoint(path, TINY)


def test_config_rejects_head_size_not_divisible_by_four():
    with pytest.raises(ValueError, match="divisible by 4"):
        LlamaGenConfig(dim=36, num_heads=6)
