"""The peers' verification rules, as their authors' code does them (docs/method.md, section "The baselines, as their
authors' code runs them"): LANTERN and LANTERN++ and GSD (GSD-blocks and the CASCADE development code's rule have
modules of their own, `inference.decoding.gsd_blocks` and `inference.decoding.cascade_dev`). They change the residual
or relax without a budget, so they carry no TV guarantee; `inference.decoding.rules` holds the registry of every rule
and their shared interface (`test_slot`, `acceptance_at_once`).

Shapes: B rows, I parent nodes, K child slots, V vocabulary, L neighbour-table width, W GSD window, E embedding
width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.decoding.rule_inputs import (
    RemovalSlots,
    SlotInputs,
    SlotTest,
    TreeInputs,
    chain_step,
    descending_ranks,
    exact_residual,
    normalise_or_uniform,
    pack_slots,
    packed_slots,
    unpack_slots,
)


def scatter_mask(shape: tuple[int, ...], index: Tensor, keep: Tensor) -> Tensor:
    """(..., V) bool mask that is True at `index` (..., M) where `keep` (..., M); no host sync (unlike one_hot)."""
    mask = torch.zeros(*shape[:-1], shape[-1] + 1, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, torch.where(keep, index, shape[-1]), True)[..., : shape[-1]]


LANTERN_K = 1000
"""LANTERN's k: `lantern_k=1000`, the default of jadohu/LANTERN's `evaluate_posterior` (docs/method.md, section "The
baselines, as their authors' code runs them")."""
LANTERN_DELTA = 0.1
"""LANTERN's delta: `lantern_delta=0.1`, the same function's default (docs/method.md, section "The baselines, as their
authors' code runs them")."""
LANTERN_PP_K = 10
"""LANTERN++'s k: the CASCADE authors' baseline, `--lantern_k 10 --lantern_delta 3.0` (docs/method.md, section "The
baselines, as their authors' code runs them")."""
LANTERN_PP_LAM = 3.0
"""LANTERN++'s lam: the same baseline (its `--lantern_delta 3.0`; a delta above 1 is LANTERN++'s lam)."""
LANTERN_PP_REPO_RUNS: tuple[tuple[int, float], ...] = ((10, 5.0), (5, 10.0), (5, 20.0))
"""(k, lam) of the LANTERN repository's own LANTERN++ runs (jadohu/LANTERN `run.sh`, Lumina-mGPT, static tree)."""
LANTERN_STATIC_ZEROES = {"lumina": "p", "llamagen": "q"}
"""`static_zeroes` by target family, as LANTERN's file for that family does it: the Lumina-mGPT file zeroes p at
the latents, the LlamaGen (and Anole) file zeroes q (jadohu/LANTERN `models/ea_model_{lumina_mgpt,llamagen}.py`).
LANTERN has no Janus file; other families take the dataclass default "q" (Janus-Pro generates with LlamaGen's
VQ-16 codes, so the LlamaGen file is the nearest)."""


def lantern_static_zeroes(family: str) -> str:
    """The `static_zeroes` LANTERN's own code uses for a target of `family` ("q" where it has no file)."""
    return LANTERN_STATIC_ZEROES.get(family, "q")


@dataclass(frozen=True, kw_only=True, eq=False)
class LanternRule:
    """LANTERN (lam None) or LANTERN++ (lam set), as jadohu/LANTERN `evaluate_posterior` does it.

    p~(x) = p(x) + the largest prefix sum of p over x's k nearest codebook latents that stays <= delta
    (LANTERN) or <= (lam - 1) p(x) (LANTERN++); accept w.p. min(1, p~(x) / q(x)). On rejection x is
    removed and, if anything was pooled, its k + 1 nearest latents too ("code", the authors' code) or
    only the pooled ones ("pooled"). On sampled (static) trees the LlamaGen/Anole file zeroes the
    proposal q at those latents before relu(p - q), so they keep their p (`static_zeroes="q"`); the
    Lumina file zeroes p (`static_zeroes="p"`); `inference.decoding.generate.build_rule` picks the target family's
    (`lantern_static_zeroes`). Greedy decoding reads the unfiltered softmax of the guided logits, as the
    authors' greedy path does (`inference.decoding.speculative.build_target_view`).
    """

    neighbours: Tensor
    """(V, L >= k + 1) int64: each code's other codes, nearest first (`build_latent_neighbours`)."""
    k: int | None = None
    """Nearest latents x may pool; None: the mode's published default, `LANTERN_K` (1000) for LANTERN,
    `LANTERN_PP_K` (10) for LANTERN++. Set once built: `k` always reads an int after construction."""
    delta: float = LANTERN_DELTA
    """LANTERN's bound on the pooled mass (unused by LANTERN++)."""
    lam: float | None = None
    """LANTERN++'s multiplicative bound, p~(x) <= lam p(x); None: LANTERN (`build_rule` gives lantern++
    `LANTERN_PP_LAM`)."""
    reject_zeroes: str = "code"
    """On rejection remove x's k + 1 nearest ("code", the authors') or only the pooled latents ("pooled")."""
    static_zeroes: str = "q"
    """Sampled trees: zero q ("q", the LlamaGen/Anole file) or p ("p", the Lumina file) at the latents."""

    def __post_init__(self) -> None:
        if self.k is None:  # frozen: set through object, once, before anything reads it
            object.__setattr__(self, "k", LANTERN_K if self.lam is None else LANTERN_PP_K)
        if self.num_nearest < 1:
            raise ValueError(f"lantern k must be >= 1, got {self.k}")
        if self.neighbours.shape[1] < self.num_nearest + (self.reject_zeroes == "code"):
            raise ValueError(
                f"neighbour table has {self.neighbours.shape[1]} columns, k={self.k} needs more: "
                "build it with build_latent_neighbours(codebook, k + 1)"
            )
        if self.reject_zeroes not in ("code", "pooled"):
            raise ValueError(f"reject_zeroes must be 'code' or 'pooled', got {self.reject_zeroes!r}")
        if self.static_zeroes not in ("q", "p"):
            raise ValueError(
                f"static_zeroes must be 'q' (LlamaGen file) or 'p' (Lumina file), got {self.static_zeroes!r}"
            )
        if self.lam is not None and self.lam < 1:
            raise ValueError(f"lantern++ needs lam >= 1, got {self.lam}")
        if not 0 <= self.delta <= 1:
            raise ValueError(f"lantern delta is a TV bound in [0, 1], got {self.delta}")

    @property
    def name(self) -> str:
        return "lantern" if self.lam is None else "lantern++"

    @property
    def num_nearest(self) -> int:
        """k as an int (`__post_init__` has replaced None by the mode's default)."""
        if self.k is None:
            raise ValueError("LanternRule.k is unset: construct the rule, which fills in the default")
        return self.k

    def prepare(self, inputs: TreeInputs) -> Tensor:
        zapped = self.num_nearest + 1 if self.reject_zeroes == "code" else self.num_nearest
        return _with_self(self.neighbours, zapped, inputs.probs.device)

    def _pooled(self, table: Tensor, slot: SlotInputs) -> tuple[Tensor, Tensor, Tensor]:
        """x and its neighbours (B, I, 1 + L'), which of x and its k nearest count (B, I, 1 + k; a prefix, x always),
        and p(x) plus the pooled mass (B, I)."""
        near = table[slot.x]  # (B, I, 1 + L'): x, then its nearest latents
        counted = near if self.reject_zeroes == "pooled" else near[..., : self.num_nearest + 1]
        cumulative = slot.p.gather(2, counted).cumsum(-1)  # (B, I, 1 + k): p(x), p(x) + the nearest, ...
        p_x = cumulative[..., :1]
        # the pooled prefix sum stays <= delta (LANTERN) or <= (lam - 1) p(x) (LANTERN++)
        bound = p_x + self.delta if self.lam is None else self.lam * p_x
        allowed = cumulative <= bound  # a prefix: the cumulative mass never decreases; x itself always
        return near, allowed, (cumulative * allowed).amax(-1)

    def test_slot(self, inputs: TreeInputs, state: Tensor, slot: SlotInputs) -> SlotTest:
        near, allowed, relaxed = self._pooled(state, slot)
        # deterministic drafts propose x with q(x) = 1
        a0 = relaxed if slot.q_draw is None else relaxed / slot.q_x  # (B, I); `verify` clamps it to 1
        if self.reject_zeroes == "code":  # x's k + 1 nearest, if anything was pooled
            zap_keep = allowed[..., 1:2]  # (B, I, 1): the nearest latent was pooled
        else:  # only the pooled ones
            zap_keep = allowed  # (B, I, 1 + k), True at x
        if slot.q_draw is None:  # x and the zapped latents to 0 in one scatter (x again where one is not zapped)
            return SlotTest(a0, None, slot.p.scatter(-1, torch.where(zap_keep, near, slot.x_column), 0.0))
        latents = near[..., 1:]  # (B, I, L'): x is not zapped here, relu(p - q) removes it
        zero = scatter_mask(tuple(slot.p.shape), latents, zap_keep[..., -latents.shape[-1] :].expand_as(latents))
        if self.static_zeroes == "q":  # (B, I, V)
            return SlotTest(a0, None, torch.relu(slot.p - slot.q_draw.masked_fill(zero, 0.0)))
        return SlotTest(a0, None, torch.relu(slot.p.masked_fill(zero, 0.0) - slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: Tensor, slot: SlotInputs) -> Tensor:
        return self._pooled(state, slot)[2]

    def own_chain(
        self, inputs: TreeInputs, table: Tensor, draws: Tensor | None, q_x: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """Every slot of sampled drafts, the authors' LlamaGen/Anole rule (`reject_zeroes="code"`, `static_zeroes="q"`;
        None for the other settings and for deterministic drafts, which the slot loop tests): a rejection removes q_c at
        x's k + 1 nearest latents if the nearest was pooled, then relu(p_c - q_c). The residual is kept unnormalised
        (`chain_step`); a slot costs the prefix sums over x and its nearest, the bound, and q_c with its latents'
        entries rewritten (zero where zapped), ten ops on (B, I, V) or smaller; the acceptances come at once after the
        chain. draws (B, I, K, V) each slot's q_c, 0 on untested slots; q_x (B, I, K) -> a0 (B, I, K),
        residual (B, I, V)."""
        if draws is None or q_x is None or self.reject_zeroes != "code" or self.static_zeroes != "q":
            return None
        near = table[inputs.kid_tokens]  # (B, I, K, 2 + k): x, then its k + 1 nearest latents
        counted = near[..., : self.num_nearest + 1].unbind(2)  # K x (B, I, 1 + k): x and the k nearest it may pool
        latents = near[..., 1:].unbind(2)  # K x (B, I, k + 1): what a rejection zaps
        residual = inputs.probs  # (B, I, V), unnormalised after the first slot
        cumulatives, over, totals = [], [], []
        for c, q_c in enumerate(draws.unbind(2)):
            total = residual.sum(-1, keepdim=True)  # (B, I, 1)
            cumulative = residual.gather(2, counted[c]).cumsum(-1)  # (B, I, 1 + k) total x (p_c(x), + the nearest, ..)
            # the pooled prefix sum stays <= delta (LANTERN) or <= (lam - 1) p(x) (LANTERN++), scaled by the total
            x_mass = cumulative[..., :1]
            beyond = cumulative > (x_mass + self.delta * total if self.lam is None else self.lam * x_mass)
            # q_c at the latents, zeroed if the nearest was pooled: a (B, I, k + 1) scatter, not a (B, I, V) select
            kept_q = q_c.gather(2, latents[c]) * beyond[..., 1:2]
            residual = chain_step(residual, q_c.scatter(2, latents[c], kept_q), total)
            cumulatives.append(cumulative)
            over.append(beyond)
            totals.append(total)
        pooled = (torch.stack(cumulatives, 2) * ~torch.stack(over, 2)).amax(-1)  # (B, I, K) unnormalised
        relaxed = pooled / torch.cat(totals, -1).clamp_min(1e-30)  # 0 past an all-zero residual (`sampled_slots`)
        return relaxed / q_x, normalise_or_uniform(residual)


@functools.lru_cache(maxsize=4)
def _with_self(neighbours: Tensor, width: int, device: torch.device) -> Tensor:
    """(V, 1 + width) int64: each code, then its `width` nearest other codes; built once per table and device."""
    codes = torch.arange(neighbours.shape[0], device=device)[:, None]
    return torch.cat([codes, neighbours[:, :width].to(device)], 1)


@functools.lru_cache(maxsize=8)
def _window_offsets(window: int, device: torch.device) -> Tensor:
    """(W,) descending-rank offsets of GSD's window around x: W - 1 - W//2 more likely tokens, x, W//2 less likely
    ones (-6 .. 7 for W = 14); a shared constant, never written to."""
    return torch.arange(window // 2 + 1 - window, window // 2 + 1, device=device)


@functools.lru_cache(maxsize=8)
def _window_centre(window: int, device: torch.device) -> Tensor:
    """(W,) bool, True at offset 0 (x's own rank); a shared constant, never written to."""
    return _window_offsets(window, device) == 0


@dataclass
class GSDState:
    """GSD's per-step tables, on the step's device."""

    embeddings: Tensor  # (V, E) float32 the table distances are measured on
    token_ids: Tensor | None  # (V,) int64 each vocabulary index's LM id, or None (the distance filter always runs)


@dataclass(frozen=True, kw_only=True, eq=False)
class GSDRule:
    """Grouped speculative decoding as its authors' code does it (junhyukso/GSD,
    `scheduler/jacobi_iteration_lumina_mgpt.py`, `SpeculativeSampler.__call__`; docs/method.md, section "The baselines,
    as their authors' code runs them").

    The authors sort the target's logits ascending and take the slice [r - 7, r + 7) around x's place r: in
    descending ranks d, the window [d - 6, d + 7] (W = 14: W - 1 - W//2 more likely tokens, x, W//2 less likely
    ones), cut at the most likely token. Where the slice would start below place 0 (x is among the W//2 least
    likely tokens: d + W//2 >= V) it is empty in their code, and the test falls back to plain min(1, p(x) / q(x)).
    Otherwise the cluster C keeps the window's tokens y with |p(y) - p(x)| < p_threshold and squared L2 distance
    to x below distance_threshold (x itself always); the distance filter is skipped when any window token's LM id
    is above id_bound. Accept w.p. min(1, p(C) / q(C)) (q(C) = 1 for deterministic drafts); the residual is
    relu(p - q), the cluster is not removed. Ties in p are ordered by token id (the authors' sort is unstable).

    The authors measure distances on the LM's input embedding table (its first 10,000 rows, by LM id), which is
    why ids above 10,000 skip the filter (in their code an id of exactly 10,000 reads past that table). Ours
    measures them on `embeddings`, the table the caller gives: `build_rule` passes the target's
    `lm_embedding_table()`, the LM's input embeddings of its image tokens in image-vocabulary order (Lumina-mGPT:
    Chameleon's `embed_tokens` rows of its image ids, the authors' table; LlamaGen and the toy: the GPT's
    `tok_embeddings`; Janus-Pro: `generation_aligner(generation_embeddings)`, what its LM reads for an image
    token). It applies the id bound only where the target exposes LM ids (`token_ids`: Lumina-mGPT's Chameleon
    ids, whose image tokens all lie below 10,000); without them the distance filter always runs. On a tree, p and
    q are the residual target and the draw distribution of the slot (for the authors, one draft per position: the
    target and the Jacobi iterate).
    """

    embeddings: Tensor
    """(V, E) token embeddings the distance is measured on (the authors used the LM's input embeddings)."""
    token_ids: Tensor | None = None
    """(V,) int64 LM id of each vocabulary index, where the target exposes them; None: no id bound."""
    window: int = 14
    p_threshold: float = 0.15
    distance_threshold: float = 0.5
    id_bound: int = 10_000
    """The distance filter is skipped when any window token's LM id exceeds this (the authors' 10,000)."""
    name: str = "gsd"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"gsd window must be >= 1, got {self.window}")
        if self.token_ids is not None and self.token_ids.shape != self.embeddings.shape[:1]:
            raise ValueError(
                f"gsd token_ids must hold one LM id per vocabulary index, {tuple(self.embeddings.shape[:1])}, "
                f"got shape {tuple(self.token_ids.shape)}"
            )

    def prepare(self, inputs: TreeInputs) -> GSDState:
        device = inputs.probs.device
        token_ids = None if self.token_ids is None else self.token_ids.to(device)
        return GSDState(self.embeddings.to(device).float(), token_ids)

    def _keep(self, state: GSDState, members: Tensor, inside: Tensor, close: Tensor, distance: Tensor) -> Tensor:
        """(..., W) bool: the window members in x's cluster. members (..., W) token ids, inside (..., W) in the
        window (`_inside`), close (..., W) the p filter, distance (..., W) to x."""
        near = distance < self.distance_threshold
        if state.token_ids is not None:  # the authors skip the distance filter past their embedding table
            beyond = ((state.token_ids[members] > self.id_bound) & inside).any(-1, keepdim=True)
            near = near | beyond
        return (inside & close & near) | _window_centre(self.window, members.device)  # x itself, always

    @staticmethod
    def _inside(at: Tensor, vocab: int) -> Tensor:
        """(..., W) bool: the window's ranks `at` (..., W) that hold a cluster candidate. The window is cut at the
        most likely token; where its least likely end (the last rank) runs past the vocabulary the authors' slice is
        empty and nothing but x is kept (a plain test)."""
        return (at >= 0) & (at[..., -1:] < vocab)

    def _cluster_mass(self, state: GSDState, slot: SlotInputs) -> tuple[Tensor, Tensor | None]:
        """p's and q's mass of x's cluster, (B, I) each (q's None for deterministic drafts); for `slot` with a K axis
        every tensor below gains it, after I."""
        order = slot.p.argsort(dim=-1, descending=True, stable=True)  # (B, I, V)
        vocab, centre = slot.p.shape[-1], self.window - 1 - self.window // 2
        rank_x = (order == slot.x_column).max(-1, keepdim=True).indices  # (B, I, 1) x's place in the order
        at = rank_x + _window_offsets(self.window, slot.p.device)  # (B, I, W): x's rank at `centre`
        inside = self._inside(at, vocab)
        members = order.gather(-1, at.clamp(0, vocab - 1))  # (B, I, W), x at `centre`
        p_members = slot.p.gather(-1, members)
        member_embeddings = state.embeddings[members]  # (B, I, W, E)
        distance = (member_embeddings - member_embeddings[..., centre : centre + 1, :]).pow(2).sum(-1)  # (B, I, W)
        close = (p_members - slot.p_x[..., None]).abs() < self.p_threshold
        keep = self._keep(state, members, inside, close, distance)
        mass = (p_members * keep).sum(-1)
        if slot.q_draw is None:  # q(C) = 1
            return mass, None
        return mass, (slot.q_draw.gather(-1, members) * keep).sum(-1)

    @staticmethod
    def _distance(embeddings: Tensor, inputs: TreeInputs, members: Tensor) -> Tensor:
        """The squared distance (B, I, K, W) of each slot's window `members` (B, I, K, W) to its token x, in the
        embedding space. On a tree with mostly empty slots (`packed_slots`: the dynamic tree fills about one in ten)
        only the tested slots' windows are read, (B, J, W, E) instead of (B, I, K, W, E), and the others get 0."""
        tokens, packed = inputs.kid_tokens, packed_slots(inputs)  # (B, I, K), (B, J) or None
        if packed is None:
            return (embeddings[members] - embeddings[tokens][..., None, :]).pow(2).sum(-1)
        window, x = pack_slots(members, packed), pack_slots(tokens, packed)  # (B, J, W), (B, J)
        distance = (embeddings[window] - embeddings[x][..., None, :]).pow(2).sum(-1)  # (B, J, W)
        return unpack_slots(distance, packed, inputs.usable)

    @staticmethod
    def _members_among_zeros(
        p: Tensor, order: Tensor, tokens: Tensor, gone: Tensor, at: Tensor, members: Tensor
    ) -> Tensor:
        """`acceptance_at_once`'s window members (B, I, K, W) with the ranks past p_c's positive tokens filled in.
        There p_c's zeros sort by id: p's own zeros (`order` from place P on, by id) merged with the removed positive
        siblings. A removed token t sits at merged place (p's zeros below t) + (removed tokens below t); the j-th
        zero is such a t, or else p's (j - the removed tokens placed before j)-th zero. p (B, I, V), order (B, I, V)
        its stable descending order, tokens (B, I, K), gone (B, I, K, K) [c, c']: c' removed before c, at
        (B, I, K, W) ranks under p_c."""
        vocab = p.shape[-1]
        zero = p == 0  # (B, I, V)
        positive = vocab - zero.sum(-1)[..., None, None]  # (B, I, 1, 1) P
        p_kids_zero = zero.gather(2, tokens)  # (B, I, K) the sibling's token is a zero of p already
        removed = gone & ~p_kids_zero[:, :, None, :]  # (B, I, K, K) [c, c']: c' removed a positive token
        j = at - (positive - removed.sum(-1, keepdim=True))  # (B, I, K, W) place among p_c's zeros, where >= 0
        smaller = tokens[:, :, None, :, None] > tokens[:, :, None, None, :]  # (B, I, 1, K, K) [c', c'']: c'' < c'
        below = (removed[:, :, :, None, :] & smaller).sum(-1)  # (B, I, K, K) [c, c']: removed tokens below c''s
        place = zero.cumsum(-1).gather(2, tokens)[:, :, None, :] + below  # (B, I, K, K) merged place of c''s token
        place = torch.where(removed, place, vocab + at.shape[-1])  # the others lie past every place j
        at_removed = place[:, :, :, None, :] == j[..., None]  # (B, I, K, W, K)
        removed_token = (at_removed * tokens[:, :, None, None, :]).sum(-1)  # (B, I, K, W)
        own = positive + j - (place[:, :, :, None, :] < j[..., None]).sum(-1)  # (B, I, K, W) place in p's order
        own_zero = order.gather(2, own.clamp(0, vocab - 1).flatten(2)).view_as(own)
        among_zeros = torch.where(at_removed.any(-1), removed_token, own_zero)
        return torch.where(j >= 0, among_zeros, members)

    def test_slot(self, inputs: TreeInputs, state: GSDState, slot: SlotInputs) -> SlotTest:
        mass, proposal = self._cluster_mass(state, slot)
        a0 = mass if proposal is None else mass / proposal.clamp_min(1e-30)  # `verify` clamps it to 1
        return SlotTest(a0, None, exact_residual(slot.p, slot.x_column, slot.q_draw))

    def greedy_mass(self, inputs: TreeInputs, state: GSDState, slot: SlotInputs) -> Tensor:
        return self._cluster_mass(state, slot)[0]

    def acceptance_sampled(self, inputs: TreeInputs, state: GSDState, slots: SlotInputs) -> tuple[Tensor, None]:
        """`test_slot`'s a0 for every slot of sampled drafts at once (`slots` with a K axis; the residual is the exact
        one): one sort of the (B, I, K, V) residual targets instead of one per slot. -> (B, I, K), None."""
        mass, proposal = self._cluster_mass(state, slots)
        return (mass / proposal.clamp_min(1e-30) if proposal is not None else mass).clamp_max(1.0), None

    def acceptance_at_once(self, inputs: TreeInputs, state: GSDState, slots: RemovalSlots) -> tuple[Tensor, None]:
        """`test_slot`'s a0 for every slot of deterministic drafts (q(C) = 1; the residual only removes x), from one
        sort of p instead of one per slot. p_c is p without the earlier tested siblings' tokens, over mass_left[c]:
        its positive tokens keep p's order, the removed ones join the zeros, which sort by token id. So x's rank
        under p_c is its rank under p, less the removed tokens ranked above it (a zero x: less the removed positive
        tokens with a larger id, which now sort after it), and the r-th token of p_c's order is the r-th of p's
        order that was not removed, at p-rank r + #{i : s_i - i <= r} (s the removed tokens' p-ranks, ascending).
        A rank past p_c's positive tokens holds no mass, whichever token it is. (The slot loop renormalises after each
        rejection: a rounding that made two adjacent probabilities equal would order them by id there, by p here.)
        -> (B, I, K), None."""
        p, tokens = slots.p, inputs.kid_tokens  # (B, I, V), (B, I, K)
        vocab, width = p.shape[-1], tokens.shape[-1]
        order, ranks = descending_ranks(p)  # (B, I, V) each
        kid_ranks, p_kids = ranks.gather(2, tokens), p.gather(2, tokens)  # (B, I, K) each
        gone = inputs.usable[:, :, None, :] & slots.removed_before  # (B, I, K, K) [c, c']: c' removed before c
        other_ranks = kid_ranks[:, :, None, :]  # (B, I, 1, K)
        above = gone & (other_ranks < kid_ranks[..., None])  # removed and ranked above x
        after = gone & (p_kids[:, :, None, :] > 0) & (tokens[:, :, None, :] > tokens[..., None])  # positive, larger id
        rank_x = kid_ranks - torch.where(p_kids > 0, above.sum(-1), after.sum(-1))  # (B, I, K) rank under p_c
        at = rank_x[..., None] + _window_offsets(self.window, p.device)  # (B, I, K, W) ranks under p_c
        inside = self._inside(at, vocab)
        skipped = torch.where(gone, other_ranks, vocab + width).sort(-1).values  # (B, I, K, K) s, ascending
        skipped = skipped - torch.arange(width, device=p.device)  # s_i - i
        at_p = at + (skipped[:, :, :, None, :] <= at[..., None]).sum(-1)  # (B, I, K, W) p-ranks
        members = order.gather(2, at_p.clamp(0, vocab - 1).flatten(2)).view_as(at_p)  # (B, I, K, W)
        p_members = p.gather(2, members.flatten(2)).view_as(members) * (at_p < vocab)  # unnormalised, 0 past V
        if state.token_ids is not None:  # the id bound reads which token holds each rank, also among p_c's zeros
            members = self._members_among_zeros(p, order, tokens, gone, at, members)
        distance = self._distance(state.embeddings, inputs, members)  # (B, I, K, W)
        left = slots.mass_left[..., None]  # (B, I, K, 1) p_c's normaliser
        close = (p_members - p_kids[..., None]).abs() < self.p_threshold * left
        keep = self._keep(state, members, inside, close, distance)
        mass = ((p_members * keep).sum(-1) / slots.mass_left).nan_to_num_(0.0)  # 0 / 0 only past all the mass
        return mass.clamp_max(1.0), None
