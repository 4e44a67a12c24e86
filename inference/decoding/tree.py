"""Draft trees for tree speculative decoding: static EAGLE-1 lists and dynamic EAGLE-2 trees.

A tree is drafted anew at every verification step (docs/method.md, section "Drafting a tree"). Node 0 is the root, the
last sampled token, whose key/value entries are not yet in the target's cache; every other node is a draft token. Nodes
are stored parents-first: sorted by depth, and within a depth by (parent, rank), so the children of a node appear in
draw order (static, sampled drafts) or drafter-rank order (dynamic, deterministic drafts), which is the order
verification tries them in (docs/method.md, section "Tree verification").

- Static trees (`StaticTreeSpec`, e.g. `NAIVE_EXTEND_57`) fix the shape: a node is the c-th child of
  its parent, and it receives the parent's c-th draw from the drafter distribution q; a c-th child needs
  the children before it (`check_static_paths`), or verification would test it as an earlier draw.
- Dynamic trees (EAGLE-2) grow the top-k frontier by cumulative log q and keep the best
  `total_tokens` nodes; their shape differs per row (drafting and its selection steps:
  `inference.decoding.tree_drafting`).

A `Tree` carries the tables that verification reads off its shape (`WalkTables`), built once per tree,
or once per static shape and batch. Everything else here is a pure tensor function over a batch of
trees, vectorised per depth.

Shapes: B prompts (one tree per prompt; the CFG rows share it), N tree nodes (root included),
V vocabulary, K top-k / children per node, M dynamic-tree candidates, P path length (max depth + 1),
I inner nodes (nodes with children).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from inference.decoding.static_trees import (  # noqa: F401 (re-exported: the static lists live beside their check)
    MC_SIM_7B_63,
    NAIVE_EXTEND_57,
    STATIC_TREES,
    TOY_DEMO_FIT_8,
    check_static_paths,
    load_static_tree,
)


@dataclass
class Tree:
    """A batch of drafted trees, one per prompt, ready for the target forward and verification."""

    tokens: Tensor  # (B, N) int64; tokens[:, 0] is the root (the last sampled token)
    parents: Tensor  # (B, N) int64; parents[:, 0] = -1; parents[b, n] < n
    depths: Tensor  # (B, N) int64; 0 for the root
    q_full: Tensor  # (B, N, V) float: drafter distribution at each node over its children (0 where not drafted)
    sampled: bool  # True: each node's children were drawn from q_full there without replacement, in child
    # order (verification derives each draw's probability from them); False: deterministic drafts
    max_depth: int  # deepest level any row may have
    max_children: int  # widest fan-out
    distinct_siblings: bool = False  # True: no two children of one node share a token (the drafters take a
    # node's children from one top-k or one draw without replacement), so verification skips the duplicate test
    inner_nodes: Tensor | None = None  # (I,) int64 nodes with children, ascending, the same in every row
    # (static trees); None = unknown, every node may have children
    inner_row: Tensor | None = None  # (N + 1,) int64 each node's position in inner_nodes, -1 for a leaf;
    # a trailing -1 so that -1 padded paths index it
    walk_memo: dict[bool, WalkTables] | None = None  # `walk_tables` already built: shared by every tree of one
    # static shape and batch (`StaticTreeSpec.walk_memo`); None = this tree's own, built at first use

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @cached_property
    def attention_mask(self) -> Tensor:
        """(B, N, N) bool: node n attends to node m iff m is n or one of its ancestors."""
        return ancestor_mask(self.parents, self.max_depth)

    @cached_property
    def children(self) -> Tensor:
        """(B, N, K) int64 children of every node in order, -1 padded."""
        return children_table(self.parents, self.max_children)

    @cached_property
    def paths(self) -> Tensor:
        """(B, N, P) int64: the root-to-node path of every node (index d = ancestor at depth d), -1 padded.
        Read off `attention_mask`, which the target forward over the tree has built already."""
        return ancestor_paths(self.attention_mask, self.depths, self.max_depth)

    def walk_tables(self, nodes: Tensor | None) -> WalkTables:
        """Verification's index tables over the parents `nodes` (None = every node), built once per tree,
        or once per static shape and batch (`walk_memo`)."""
        if self.walk_memo is None:
            self.walk_memo = {}
        key = nodes is None  # a static tree's parents are its inner nodes, or every node
        if key not in self.walk_memo:
            self.walk_memo[key] = WalkTables.build(self, nodes)
        return self.walk_memo[key]

    def with_structure(self, structure: TreeStructure, walk_memo: dict[bool, WalkTables] | None = None) -> Tree:
        """Set `attention_mask`, `children` and `paths` from tables built once for a fixed shape (static
        trees), instead of from `parents` at every step, and share `walk_memo`; returns self."""
        self.walk_memo = walk_memo
        batch = self.tokens.shape[0]
        self.__dict__["attention_mask"] = structure.attention_mask.expand(batch, -1, -1)
        self.__dict__["children"] = structure.children.expand(batch, -1, -1)
        self.__dict__["paths"] = structure.paths.expand(batch, -1, -1)
        self.inner_nodes, self.inner_row = structure.inner_nodes, structure.inner_row
        return self


@dataclass
class WalkTables:
    """What verification reads off a tree's shape over the parent nodes it tests (`Tree.walk_tables`): index
    tables that depend on the shape only, so a static tree builds them once, not at every step.

    I parent nodes (`nodes`, or all N), K child slots, P path length; rows the batch B."""

    rows: Tensor  # (B,) arange
    children: Tensor  # (B, I, K) children in test order, -1 padded
    has_child: Tensor  # (B, I, K) bool: children >= 0
    child_index: Tensor  # (B, I K) children, padding at node 0: the index of a gather at the children
    child_or_dump: Tensor  # (B, I K) children, padding at a dump column N: the index of a scatter to them
    uniform_row: Tensor  # (B, I, K) each slot's parent depth, capped at max_depth - 1: its `Uniforms` row
    path_index: Tensor  # (B, N P) root-to-node paths, padding at node 0
    off_path: Tensor  # (B, N, P) bool: the paths' padding
    deepest_first: Tensor  # (B, N) depth * (N + 1) - n: its argmax over a set of nodes is the deepest, first in order
    all_children: Tensor  # (B, N, K) the children of every node, -1 padded (`Tree.children`)
    parent_paths: Tensor  # (B, I, P) the parents' root-to-node paths, -1 padded
    nodes: Tensor | None  # (I,) the parent nodes (None: every node, I = N)

    @classmethod
    def build(cls, tree: Tree, nodes: Tensor | None) -> WalkTables:
        children = select(tree.children, nodes)  # (B, I, K)
        num_nodes, has_child, paths = tree.num_nodes, children >= 0, tree.paths  # paths (B, N, P)
        return cls(
            rows=torch.arange(children.shape[0], device=children.device),
            children=children,
            has_child=has_child,
            child_index=children.clamp_min(0).flatten(1),
            child_or_dump=children.remainder(num_nodes + 1).flatten(1),  # -1 padding -> the dump column N
            uniform_row=select(tree.depths, nodes)[..., None].clamp_max(tree.max_depth - 1).expand_as(children),
            path_index=paths.clamp_min(0).flatten(1),
            off_path=paths < 0,
            deepest_first=tree.depths * (num_nodes + 1) - node_range(num_nodes, children.device),
            all_children=tree.children,
            parent_paths=select(paths, nodes),
            nodes=nodes,
        )

    def at_children(self, values: Tensor) -> Tensor:
        """Per-node values (B, N) -> (B, I, K): each child slot's node's value (node 0's on empty slots)."""
        return values.gather(1, self.child_index).view_as(self.children)

    # read by CASCADE only (its budget and its pooling): built at its first use, not for every rule

    @cached_property
    def parent_path_index(self) -> Tensor:
        """(B, I P) the parents' paths, padding at node 0: the index of a gather along them."""
        return self.parent_paths.clamp_min(0).flatten(1)

    @cached_property
    def parent_on_path(self) -> Tensor:
        """(B, I, P) bool: the parents' paths without their padding."""
        return self.parent_paths >= 0

    @cached_property
    def grandchildren(self) -> Tensor:
        """(B, I, K, K) the children of every child slot, -1 padded (and -1 under an empty slot)."""
        batch, parents, width = self.children.shape
        index = self.child_index[..., None].expand(-1, -1, width)  # (B, I K, K)
        grandchildren = self.all_children.gather(1, index).view(batch, parents, width, width)
        return torch.where(self.has_child[..., None], grandchildren, -1)

    @cached_property
    def parent_nodes(self) -> Tensor:
        """(B, I, 1, 1) int64 the parent nodes' ids, shaped to stand beside a (B, I, K, .) table."""
        batch, parents = self.children.shape[:2]
        nodes = torch.arange(parents, device=self.children.device) if self.nodes is None else self.nodes
        return nodes.view(1, -1, 1, 1).expand(batch, -1, -1, -1)

    @cached_property
    def pooling_index(self) -> Tensor:
        """(B, I K (2K + 1)) node ids of the tokens CASCADE may pool for each child slot, padding at node 0: its
        siblings (itself included), its own children, its parent. `pooling_adjacent` and the slots' usability
        say which are real."""
        width = self.children.shape[2]
        siblings = self.children[:, :, None, :].expand(-1, -1, width, -1)  # (B, I, K, K)
        parent = self.parent_nodes.expand(-1, -1, width, 1)  # (B, I, K, 1)
        return torch.cat([siblings, self.grandchildren, parent], dim=-1).clamp_min(0).flatten(1)

    @cached_property
    def pooling_adjacent(self) -> Tensor:
        """(B, I, K, K + 1) bool: which of each child slot's own children exist, then True for its parent."""
        exists = self.grandchildren >= 0  # (B, I, K, K)
        return torch.cat([exists, torch.ones_like(exists[..., :1])], dim=-1)

    @cached_property
    def similarity_index(self) -> Tensor:
        """(B, I K (K + 1)) positions in a flattened (N, N) table of node pairs: each child slot against every
        sibling slot (itself included), then against its parent; padding at node 0."""
        num_nodes, width = self.all_children.shape[1], self.children.shape[2]
        kids = self.child_index.view_as(self.children)  # (B, I, K)
        others = torch.cat([kids[:, :, None, :].expand(-1, -1, width, -1), self.parent_nodes.expand(-1, -1, width, 1)],
                           dim=-1)  # fmt: skip
        return (kids[..., None] * num_nodes + others).flatten(1)  # (B, I K (K + 1))


@dataclass(frozen=True)
class TreeStructure:
    """The index tables of one tree shape (`StaticTreeSpec.structure`), each with a leading batch dim of 1."""

    parents: Tensor  # (1, N) int64
    depths: Tensor  # (1, N) int64
    attention_mask: Tensor  # (1, N, N) bool, ancestor-or-self
    children: Tensor  # (1, N, K) int64, -1 padded
    paths: Tensor  # (1, N, P) int64, -1 padded
    inner_nodes: Tensor  # (I,) int64 nodes that have children, ascending (the root first)
    inner_row: Tensor  # (N + 1,) int64 each node's position in inner_nodes, -1 for a leaf and at index N (= -1)


Selection = Tensor | slice | None  # positions along one dimension: a run is a slice (a view), None is all


@functools.lru_cache(maxsize=32)
def node_range(count: int, device: torch.device) -> Tensor:
    """(count,) int64 arange; built once per size and device, a shared constant, never written to."""
    return torch.arange(count, device=device)


@functools.lru_cache(maxsize=16)
def strictly_lower(size: int, device: torch.device) -> Tensor:
    """(size, size) bool [i, j]: j < i (slot j comes before slot i), built once per size and device; a
    shared constant, never written to."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(-1)


def select(x: Tensor, positions: Selection) -> Tensor:
    """x (B, N, ...) at `positions` along dim 1 -> (B, P, ...): a level's draws or nodes (`LevelPlan`), the
    nodes a target view covers; None returns x itself, with no op."""
    return x if positions is None else x[:, positions]


def selection(positions: list[int], length: int, device: torch.device) -> Selection:
    """`positions` among `length` as the cheapest index: None when it is every position in order, a slice
    when it is a contiguous run (a view, no kernel), else an index tensor on `device`."""
    if positions == list(range(length)):
        return None
    if positions and positions == list(range(positions[0], positions[0] + len(positions))):
        return slice(positions[0], positions[0] + len(positions))
    return torch.tensor(positions, dtype=torch.long, device=device)


@dataclass(frozen=True)
class LevelPlan:
    """One level of a static tree as indices (`StaticTreeSpec.plan`); chains of single draws index nothing."""

    draw: Selection  # (L,) parent_slot * width + rank: each node's draw in the flattened (W_prev * width) draws
    width: int  # draws per parent
    expanded: Selection  # (W,) nodes of this level that have children (the drafter runs on them), among all N
    expanded_slot: Selection  # (W,) positions of the expanded nodes within the level
    hidden_slot: Selection  # (W,) their parents' slots among the previous level's expanded nodes
    run_rows: slice  # J .. J + W: the expanded nodes' rows and draft columns in `StaticTreeSpec.run_mask`


@dataclass(frozen=True)
class StaticTreeSpec:
    """The fixed shape of a static (EAGLE-1) tree, from a list of child-index paths."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        check_static_paths(self.paths)

    @cached_property
    def order(self) -> list[tuple[int, ...]]:
        """Node paths parents-first: by depth, then lexicographically (so siblings are in rank order)."""
        return [()] + sorted(self.paths, key=lambda path: (len(path), path))

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @cached_property
    def parents(self) -> list[int]:
        index = {path: n for n, path in enumerate(self.order)}
        return [-1] + [index[path[:-1]] for path in self.order[1:]]

    @cached_property
    def ranks(self) -> list[int]:
        """Which draw of its parent each node takes (0 for the root)."""
        return [0] + [path[-1] for path in self.order[1:]]

    @property
    def depths(self) -> list[int]:
        return [len(path) for path in self.order]

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_children(self) -> int:
        return max(self.ranks) + 1

    def level(self, depth: int) -> list[int]:
        """Node indices at `depth`, in order."""
        return [n for n, d in enumerate(self.depths) if d == depth]

    @cached_property
    def ancestors(self) -> Tensor:
        """(N, N) bool ancestor-or-self mask of the shape, built once (on the CPU)."""
        return ancestor_mask(torch.tensor([self.parents]), self.max_depth)[0]

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a frozen spec, a handful of devices
    def plan(self, device: torch.device) -> list[LevelPlan]:
        """Index tensors of every level on `device`, built once, so drafting makes no host lists per step."""
        plans: list[LevelPlan] = []
        expanded, drafted = [0], 0  # drafted: draft columns written by the levels before
        for depth in range(1, self.max_depth + 1):
            nodes = self.level(depth)
            slot = {node: i for i, node in enumerate(expanded)}
            next_expanded = self.expanded(depth) if depth < self.max_depth else []
            width = max(self.ranks[n] for n in nodes) + 1
            plans.append(
                LevelPlan(
                    draw=selection(
                        [slot[self.parents[n]] * width + self.ranks[n] for n in nodes], len(expanded) * width, device
                    ),
                    width=width,
                    expanded=selection(next_expanded, self.num_nodes, device),
                    expanded_slot=selection([nodes.index(n) for n in next_expanded], len(nodes), device),
                    hidden_slot=selection([slot[self.parents[n]] for n in next_expanded], len(expanded), device),
                    run_rows=slice(drafted, drafted + len(next_expanded)),
                )
            )
            drafted += len(next_expanded)
            expanded = next_expanded
        return plans

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a frozen spec, a handful of devices
    def run_mask(self, device: torch.device) -> Tensor:
        """(M, M) bool ancestor-or-self mask of the M inner nodes but the root, in drafting order (level by level):
        the drafter's attention over its own draft columns. Level d's rows are `plan(device)[d - 1].run_rows`,
        and it sees the columns up to their end."""
        drafted = [n for depth in range(1, self.max_depth) for n in self.expanded(depth)]
        return self.ancestors[drafted][:, drafted].to(device)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a frozen spec, a handful of devices
    def structure(self, device: torch.device) -> TreeStructure:
        """Parents, depths, attention mask, children and paths of the shape on `device`, built once."""
        parents, depths = torch.tensor([self.parents], device=device), torch.tensor([self.depths], device=device)
        inner = sorted(set(self.parents[1:]))
        inner_row = torch.full((self.num_nodes + 1,), -1, dtype=torch.long)
        inner_row[inner] = torch.arange(len(inner))
        return TreeStructure(
            parents,
            depths,
            ancestor_mask(parents, self.max_depth),
            children_table(parents, self.max_children),
            node_paths(parents, depths, self.max_depth),
            torch.tensor(inner, dtype=torch.long, device=device),
            inner_row.to(device),
        )

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a frozen spec, a handful of devices and batch sizes
    def walk_memo(self, device: torch.device, batch: int) -> dict[bool, WalkTables]:
        """The `Tree.walk_memo` every tree of this shape on `device` with `batch` rows shares: verification's
        index tables, built at the first step and read at every later one."""
        return {}

    def expanded(self, depth: int) -> list[int]:
        """Nodes at `depth` that have children: the ones the drafter must run on."""
        has_children = set(self.parents[1:])
        return [n for n in self.level(depth) if n in has_children]


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """Ancestor-or-self mask, the tree attention mask. (B, N) parents -> (B, N, N) bool.

    One gather per level (max_depth iterations), no host sync.
    """
    batch, num_nodes = parents.shape
    mask = torch.zeros(batch, num_nodes, num_nodes + 1, dtype=torch.bool, device=parents.device)  # last: dump
    mask[:, :, :num_nodes] = torch.eye(num_nodes, dtype=torch.bool, device=parents.device)
    current = parents
    for _ in range(max_depth):
        has = current >= 0  # (B, N)
        mask.scatter_(2, torch.where(has, current, num_nodes)[..., None], True)  # scatter, not one_hot: no sync
        current = torch.where(has, parents.gather(1, current.clamp_min(0)), current)
    return mask[:, :, :num_nodes]


def children_table(parents: Tensor, max_children: int) -> Tensor:
    """Children of each node in node order. (B, N) parents -> (B, N, K) int64, -1 padded."""
    batch, num_nodes = parents.shape
    same_parent = parents[:, :, None] == parents[:, None, :]  # (B, N, N)
    rank = (same_parent & strictly_lower(num_nodes, parents.device)).sum(-1)  # (B, N): how many earlier siblings
    table = torch.full((batch, num_nodes + 1, max_children + 1), -1, dtype=torch.long, device=parents.device)
    row = parents.remainder(num_nodes + 1)  # the root's -1 goes to the dump row N
    nodes = node_range(num_nodes, parents.device).expand(batch, -1)
    table[torch.arange(batch, device=parents.device)[:, None], row, rank.clamp_max(max_children)] = nodes
    return table[:, :num_nodes, :max_children]


def node_paths(parents: Tensor, depths: Tensor, max_depth: int) -> Tensor:
    """Root-to-node paths. (B, N) -> (B, N, P = max_depth + 1) int64; path[b, n, d] = ancestor at depth d, -1 after."""
    batch, num_nodes = parents.shape
    paths = torch.full((batch, num_nodes, max_depth + 1), -1, dtype=torch.long, device=parents.device)
    current = torch.arange(num_nodes, device=parents.device).expand(batch, -1).clone()  # (B, N)
    for _ in range(max_depth + 1):
        valid = current >= 0
        depth = depths.gather(1, current.clamp_min(0))
        paths.scatter_(2, torch.where(valid, depth, max_depth)[..., None], torch.where(valid, current, -1)[..., None])
        current = torch.where(valid, parents.gather(1, current.clamp_min(0)), current)
    return paths


def ancestor_paths(mask: Tensor, depths: Tensor, max_depth: int) -> Tensor:
    """`node_paths` from the ancestor-or-self mask (B, N, N) and depths (B, N) -> (B, N, P) int64, -1 padded.

    A node has one ancestor-or-self at each depth up to its own: path[b, n, d] = the m with mask[b, n, m] and
    depths[b, m] = d. One masked sum over (B, N, N, P), no loop over the depths."""
    num_nodes, column = depths.shape[1], depths[..., None]  # (B, N, 1)
    levels = node_range(max_depth + 1, depths.device)  # (P,)
    nodes = node_range(num_nodes, depths.device)[:, None]  # (N, 1)
    node_at_depth = (column == levels) * nodes  # (B, N, P): m where m's depth is d, else 0
    paths = (mask[..., None] * node_at_depth[:, None]).sum(2)  # (B, N, P): the one ancestor at depth d
    return paths.masked_fill(levels > column, -1)


def leaf_paths(tree: Tree) -> tuple[Tensor, Tensor]:
    """EAGLE's `retrieve_indices`: (B, N, P) root-to-node paths and (B, N) bool marking the leaves."""
    is_leaf = tree.children[..., 0] < 0
    return tree.paths, is_leaf


def tree_positions(depths: Tensor, root_index: Tensor) -> Tensor:
    """Image-token index of every node: the root's index plus the depth. (B, N), (B,) -> (B, N)."""
    return root_index[:, None] + depths
