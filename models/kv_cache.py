"""An explicit, preallocated key/value cache for decoder-only targets.

The cache is a plain object passed into every forward, never hidden inside the model, so the
tree decoder can see and rearrange it. Columns are filled left to right; `column_valid` says which
filled columns later tokens may attend to (padded caption slots are invalid, and so are tree
nodes that verification rejected until they are overwritten).

Shapes: L layers, R rows (conditional and unconditional rows of a CFG batch), H key/value heads,
S capacity in tokens, E head size, T new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Keys and values of every layer for R rows, plus which columns are attendable.

    Keys and values live in one tensor, keys in the first H heads and values in the last H, so a
    layer whose projections yield them adjacent stores both with one copy (`write_entries`) and a
    commit moves both with one gather.
    """

    entries: Tensor  # (L, R, 2H, S, E): the keys' H heads, then the values'
    column_valid: Tensor  # (R, S) bool
    length: int = 0  # number of filled columns, the same for every row

    def __post_init__(self) -> None:
        # each layer's (R, 2H, S, E) view, taken once: the writes then slice it without a select per call
        self._heads = self.entries.shape[2] // 2
        self._layers = self.entries.unbind(0)  # (R, 2H, S, E) each
        self._layer_keys, self._layer_values = self.keys.unbind(0), self.values.unbind(0)  # (R, H, S, E) each

    @property
    def keys(self) -> Tensor:
        """(L, R, H, S, E), a view."""
        return self.entries[:, :, : self._heads]

    @property
    def values(self) -> Tensor:
        """(L, R, H, S, E), a view."""
        return self.entries[:, :, self._heads :]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        rows: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty cache able to hold `capacity` tokens per row."""
        return cls(
            entries=torch.zeros(num_layers, rows, 2 * num_kv_heads, capacity, head_dim, dtype=dtype, device=device),
            column_valid=torch.zeros(rows, capacity, dtype=torch.bool, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.entries.shape[3]

    @property
    def rows(self) -> int:
        return self.entries.shape[1]

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store one layer's keys/values of T new tokens after the filled columns.

        Args:
            keys, values: (R, H, T, E) of the new tokens.

        Returns:
            all keys and values up to and including the new tokens, (R, H, length + T, E) each.
        """
        end = self._end(keys.shape[2])
        layer_keys, layer_values = self._layer_keys[layer], self._layer_values[layer]
        layer_keys[:, :, self.length : end] = keys
        layer_values[:, :, self.length : end] = values
        return layer_keys[:, :, :end], layer_values[:, :, :end]

    def write_entries(self, layer: int, entries: Tensor) -> tuple[Tensor, Tensor]:
        """`write` for keys and values given as one (R, 2H, T, E) tensor, keys' heads first: one copy."""
        end = self._end(entries.shape[2])
        stored = self._layers[layer]  # (R, 2H, S, E)
        stored[:, :, self.length : end] = entries
        keys, values = stored[:, :, :end].split(self._heads, dim=1)  # (R, H, length + T, E) each
        return keys, values

    def _end(self, count: int) -> int:
        end = self.length + count
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} tokens do not fit its capacity of {self.capacity}")
        return end

    def advance(self, new_valid: Tensor | int, *, mark_valid: bool = True) -> None:
        """Mark T new tokens as filled once every layer has written them. new_valid: (R, T) bool, or the
        count T when all of them are valid (one fill, no mask tensor). `mark_valid=False` leaves
        `column_valid` as it was: for columns that only a mask built elsewhere lets anyone see (a static
        tree's draft columns, under the mask its decoder built once) and that are truncated after use."""
        count = new_valid if isinstance(new_valid, int) else new_valid.shape[1]
        end = self.length + count
        if mark_valid and isinstance(new_valid, int):
            self.column_valid[:, self.length : end].fill_(True)
        elif mark_valid:
            self.column_valid[:, self.length : end] = new_valid  # unmarked columns stay False (see truncate)
        self.length = end

    def truncate(self, length: int) -> None:
        """Forget every column from `length` on (they are overwritten by the next write)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.column_valid[:, length : self.length] = False
        self.length = length

    def keep_columns(self, start: int, columns: Tensor, valid: Tensor) -> None:
        """Move, per row, the columns `columns` to `start`, `start + 1`, ... and forget the rest after `start`.

        The tree decoder uses this to commit a verified tree: the accepted path's entries move into
        place and the rejected nodes are forgotten. Keys already carry their rotary position, so a
        column's slot does not matter, only whether it is valid.

        Args:
            start: first column that may change; earlier columns stay as they are.
            columns: (R, M) int64 absolute column indices, each >= start and < length.
            valid: (R, M) bool, False for padding (rows that keep fewer than M entries).
        """
        width = columns.shape[1]
        end = start + width
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} columns do not fit its capacity of {self.capacity}")
        layers, rows, heads, _, head_dim = self.entries.shape
        index = columns[None, :, None, :, None].expand(layers, rows, heads, width, head_dim)  # (L, R, 2H, M, E)
        self.entries[:, :, :, start:end] = self.entries.gather(3, index)
        self.column_valid[:, start : max(end, self.length)] = False
        self.column_valid[:, start:end] = valid
        self.length = end

    def compact(self, start: int) -> None:
        """Squeeze out invalid columns from `start` on, per row, keeping their order (one host sync)."""
        valid = self.column_valid[:, start : self.length]  # (R, T)
        order = (~valid).to(torch.int8).argsort(dim=1, stable=True)  # valid columns first
        keep = int(valid.sum(1).max())  # host sync: the new length
        self.keep_columns(start, start + order[:, :keep], valid.gather(1, order[:, :keep]))
