"""The KV cache: keys and values in one tensor, written per layer or as one block, moved together on commit."""

from __future__ import annotations

import pytest
import torch

from models.kv_cache import KVCache


def filled_pair(generator: torch.Generator) -> tuple[KVCache, KVCache, torch.Tensor, torch.Tensor]:
    """Two caches (2 layers, 2 rows, 3 heads, 8 columns, width 4) holding the same 5 columns, one written
    with `write` (keys, values apart), one with `write_entries` (one block)."""
    keys, values = torch.randn(2, 2, 3, 5, 4, generator=generator), torch.randn(2, 2, 3, 5, 4, generator=generator)
    apart, block = KVCache.allocate(2, 2, 3, 8, 4), KVCache.allocate(2, 2, 3, 8, 4)
    for layer in range(2):
        got_apart = apart.write(layer, keys[layer], values[layer])
        got_block = block.write_entries(layer, torch.cat([keys[layer], values[layer]], dim=1))
        for a, b, expected in zip(got_apart, got_block, (keys[layer], values[layer]), strict=True):
            assert torch.equal(a, expected) and torch.equal(b, expected)  # (R, H, 5, E) up to the new end
    apart.advance(5)
    block.advance(5)
    return apart, block, keys, values


def test_writing_keys_and_values_as_one_block_stores_what_writing_them_apart_does():
    apart, block, keys, values = filled_pair(torch.Generator().manual_seed(0))
    assert torch.equal(apart.entries, block.entries)
    assert torch.equal(block.keys[..., :5, :], keys) and torch.equal(block.values[..., :5, :], values)
    assert block.keys.shape == (2, 2, 3, 8, 4) and block.values.shape == (2, 2, 3, 8, 4)


def test_keep_columns_moves_keys_and_values_together_per_row():
    _, cache, keys, values = filled_pair(torch.Generator().manual_seed(1))
    columns = torch.tensor([[4, 2], [3, 3]])  # row 0 keeps columns 4 then 2; row 1 keeps column 3 once
    cache.keep_columns(2, columns, torch.tensor([[True, True], [True, False]]))
    for row in range(2):
        moved = columns[row]
        assert torch.equal(cache.keys[:, row, :, 2:4], keys[:, row][:, :, moved])
        assert torch.equal(cache.values[:, row, :, 2:4], values[:, row][:, :, moved])
        assert torch.equal(cache.keys[:, row, :, :2], keys[:, row, :, :2])  # columns before start stay
    assert cache.length == 4
    assert cache.column_valid[:, :5].tolist() == [[True, True, True, True, False], [True, True, True, False, False]]


def test_a_write_past_the_capacity_is_refused_with_the_sizes():
    cache = KVCache.allocate(1, 1, 1, 4, 2)
    cache.write_entries(0, torch.zeros(1, 2, 3, 2))
    cache.advance(3)
    with pytest.raises(ValueError, match="5 tokens do not fit its capacity of 4"):
        cache.write_entries(0, torch.zeros(1, 2, 2, 2))


def test_columns_advanced_unmarked_stay_unattendable_and_truncate_as_marked_ones_do():
    cache = KVCache.allocate(1, 2, 1, 8, 2)
    cache.advance(torch.tensor([[True, False, True], [True, True, True]]))  # committed context
    cache.advance(3, mark_valid=False)  # a static tree's levels: only the decoder's tree mask lets them be seen
    assert cache.length == 6
    assert torch.equal(cache.column_valid[:, 3:], torch.zeros(2, 5, dtype=torch.bool))
    assert torch.equal(cache.column_valid[:, :3], torch.tensor([[True, False, True], [True, True, True]]))
    cache.advance(1)
    assert cache.column_valid[:, 6].all()
    cache.truncate(3)
    assert cache.length == 3 and not cache.column_valid[:, 3:].any()
