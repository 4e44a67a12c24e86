"""Tree speculative decoding of image tokens: draft a tree, verify it with one target forward, commit.

    result = generate_speculative(target, drafter, prompts, CascadeRule(), DecoderConfig(tree="static"), generator=g)

After prefilling target and drafter, every step (EAGLE-1/2; docs/method.md, section "Drafting a tree", and
docs/method.md, section "Tree verification"):

1. the drafter reads the pending (target feature, token) pairs of the last accepted path and the bonus token;
2. it drafts a tree rooted at the last sampled token (static list or dynamic EAGLE-2 tree);
3. the target runs once over all tree nodes with the tree attention mask;
4. the rule verifies the tree (`inference.decoding.verify`): accepted drafts plus one bonus/correction token;
5. the accepted path's KV entries are committed in the target cache (the drafter's draft columns are
   dropped; it re-reads the path with target features at step 1).

CFG rows stay together: drafter and target both run [cond; uncond] rows, and the target's logits
processing (CFG, the target's layout constraint `constrain_logits`, temperature, top-k, top-p) is
applied to drafter logits too. Batches of B >= 1
prompts are supported: rows that accept fewer drafts than others pad the committed columns, which
are marked invalid in `KVCache.column_valid` (and squeezed out by `KVCache.compact` when the cache fills).

tau = mean over steps and prompts of (accepted draft tokens + 1), the +1 being the bonus token each
target forward also yields (the EAGLE/LANTERN convention).

Shapes: B prompts, R rows (2B with CFG), G image tokens, N tree nodes, P path length, V vocabulary,
D hidden size, Df drafter feature width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from inference.decoding.compiled import decoding_mode
from inference.decoding.drafter import DraftContext, Drafter, to_rows
from inference.decoding.rules import CascadeDevRule, CascadeRule, LanternRule, Rule, aux_stream, needs_every_node
from inference.decoding.sampling import draw_tokens, filter_logits, processed_distribution
from inference.decoding.tree import (
    StaticTreeSpec,
    Tree,
    check_static_paths,
    load_static_tree,
    node_range,
    select,
    tree_positions,
)
from inference.decoding.tree_drafting import draft_dynamic_tree, draft_sampled_dynamic_tree, draft_static_tree
from inference.decoding.verify import TargetView, Uniforms, Verdict, verify
from models.kv_cache import KVCache
from models.target import ImageTarget, SamplingDefaults, TargetOutput

TREE_KINDS = ("static", "dynamic", "dynamic-sampled")


@dataclass(kw_only=True)
class DecoderConfig:
    """The draft tree of the tree decoder."""

    tree: str = "static"
    """"static" (EAGLE-1 list, drafts sampled from q; the default: on the toy target it accepts 2.5x the
    tokens per target forward of "dynamic" and is the fastest, docs/results.md), "dynamic" (EAGLE-2, deterministic
    top-k drafts) or "dynamic-sampled" (EAGLE-2 expansion, children drawn from q:
    `draft_sampled_dynamic_tree`)."""
    static_tree: str | tuple[tuple[int, ...], ...] | None = None
    """A static list's name in `inference.decoding.tree.STATIC_TREES`, a JSON file of paths written by
    `python -m inference.tree_fit`, or the child-index paths themselves. None: the target's
    `default_static_tree`, which `for_target` fills in. The real targets default to EAGLE's 25-draft
    `mc_sim_7b_63`; the toy target to `toy_demo_fit_8`, fitted to the demo drafter and timed on a 2-core CPU,
    where it decodes 1.13x (report captions) to 1.27x (tune captions) faster than `mc_sim_7b_63` at about
    the same tau (docs/decoding.md, "Fitting the static tree")."""
    top_k: int = 10
    """Dynamic tree: children per expanded node and frontier width."""
    depth: int = 5
    """Dynamic tree: draft levels (the deepest accepted path has this many drafts)."""
    total_tokens: int = 60
    """Dynamic tree: nodes kept, root included."""

    def __post_init__(self) -> None:
        if self.tree not in TREE_KINDS:
            raise ValueError(f"tree must be one of {', '.join(TREE_KINDS)}, got {self.tree!r}")
        if isinstance(self.static_tree, str):
            load_static_tree(self.static_tree)  # an unknown name, a bad file or a hole fails here, not mid-decode
        elif self.static_tree is not None:  # the paths themselves: a missing parent or sibling fails here too
            check_static_paths(tuple(tuple(path) for path in self.static_tree), "DecoderConfig.static_tree")
        if self.top_k < 1 or self.depth < 1:
            raise ValueError(f"top_k and depth must be >= 1, got top_k={self.top_k}, depth={self.depth}")
        most = 1 + self.top_k + (self.depth - 1) * self.top_k**2
        if not 2 <= self.total_tokens <= most:
            raise ValueError(
                f"total_tokens must be in 2..{most} for top_k={self.top_k}, depth={self.depth}, got {self.total_tokens}"
            )

    def for_target(self, target: ImageTarget) -> DecoderConfig:
        """This config with an unset `static_tree` replaced by the target's `default_static_tree`."""
        if self.static_tree is not None:
            return self
        return dataclasses.replace(self, static_tree=target.default_static_tree)

    @cached_property
    def spec(self) -> StaticTreeSpec:
        if self.static_tree is None:
            raise ValueError("static_tree is unset (the target's default): resolve it with config.for_target(target)")
        paths = load_static_tree(self.static_tree) if isinstance(self.static_tree, str) else self.static_tree
        return StaticTreeSpec(paths)

    @property
    def num_nodes(self) -> int:
        if self.tree == "static":
            return self.spec.num_nodes
        if self.tree == "dynamic-sampled":
            width = (self.total_tokens - 1) // self.depth
            return 1 + min(width, self.top_k) + (self.depth - 1) * width
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        return self.spec.max_depth if self.tree == "static" else self.depth


@dataclass
class SpeculativeGeneration:
    """Tokens of B images and what producing them cost."""

    tokens: Tensor  # (B, G) int64
    tau: float  # mean (accepted draft tokens + 1) per verification forward; the +1 is the bonus token
    accepted: Tensor  # (steps, B) accepted drafts per step, -1 once a prompt's image was complete
    target_forwards: int  # prefill (which yields token 0) + one per verification step
    drafter_forwards: int  # drafter calls, its prefill included
    tv_charged: float  # CASCADE: mean TV budget spent per verification step (0 for other rules)
    seconds: float

    def tally(self, column: int | None = None) -> tuple[int, float]:
        """(verification steps, sum over them of accepted drafts + 1), of one image or of all: tau = sum / steps."""
        return acceptance_tally(self.accepted if column is None else self.accepted[:, column])


def acceptance_tally(accepted: Tensor) -> tuple[int, float]:
    """The one tau tally: `accepted` (steps, ...) with -1 once an image was complete ->
    (verification steps, sum over steps of accepted drafts + 1, the +1 being each forward's bonus token)."""
    steps = accepted[accepted >= 0]
    return int(steps.numel()), float((steps + 1).sum())


class DecodeHooks:
    """What the decode loop tells an observer: the phase it is in, and every verification it made.

    Subclass and pass to `generate_speculative(..., hooks=...)`: `inference.measure.bench` times the phases
    and counts their aten ops and host syncs; `inference.decoding.calibrate` reads the similarities of real
    trees. Phases: "draft" (drafter reads the accepted path and drafts the tree), "target" (the
    target forward over the tree), "view" (CFG and the target distributions), "verify" (the rule),
    "commit" (KV commit and bookkeeping, the step's one host read included).
    """

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def on_verify(self, tree: Tree, view: TargetView, verdict: Verdict) -> None:
        pass


NO_HOOKS = DecodeHooks()
_FIELD = 1 << 20  # three small non-negative ints (< 2^20, width < 2^23) in one int64, read from the device at once


@dataclass
class _Pending:
    """(target feature, token) pairs the drafter has yet to read: the accepted path and the bonus token."""

    features: Tensor  # (R, T, Df)
    tokens: Tensor  # (B, T) the tokens that follow each feature's position
    index: Tensor  # (B, T) image index of those tokens
    valid: Tensor  # (B, T) bool


def target_features(out: TargetOutput, drafter: Drafter) -> Tensor:
    """The target output a drafter reads: hidden (EAGLE-1) or the aux streams (EAGLE-3). (R, T, Df)."""
    if drafter.feature_source == "aux":
        if out.aux is None:
            raise ValueError("an EAGLE-3 drafter needs the target's aux streams (forward with return_aux=True)")
        return out.aux
    if drafter.feature_source != "hidden":
        raise ValueError(f"drafter.feature_source must be 'hidden' or 'aux', got {drafter.feature_source!r}")
    return out.hidden


def build_target_view(
    out: TargetOutput,
    rule: Rule,
    settings: SamplingDefaults,
    cfg: bool,
    greedy: bool,
    target: ImageTarget | None = None,
    token_index: Tensor | None = None,
    nodes: Tensor | None = None,
    node_row: Tensor | None = None,
    tokens: Tensor | None = None,
) -> TargetView:
    """Target distributions at the tree nodes, CFG rows combined. logits (R, N, V) -> probs (B, N, V).

    Given `target` and `token_index` (B, N), the image index each node predicts, the target's
    `constrain_logits` is applied right after CFG. Given `nodes` (I,), the tree's inner nodes (and
    `node_row`, `Tree.inner_row`), `out.logits` holds only their logits (R, I, V) (the forward's
    `logits_at`), and the view computes a leaf's distribution from `out.hidden` when a walk ends there.
    Greedy LANTERN reads the unfiltered softmax of the guided logits (`greedy_reads_unfiltered`). `tokens`
    (B, N), the tree's tokens, give CASCADE's "latent" features.
    """
    index = None if token_index is None else select(token_index, nodes)
    unfiltered = greedy and greedy_reads_unfiltered(rule)
    guided, probs = processed_distribution(out.logits, settings, cfg, target, index, unfiltered=unfiltered)
    batch = guided.shape[0]
    features = None
    # similarities on the conditional branch (docs/method.md, section "The similarity and its representation")
    if isinstance(rule, CascadeRule):
        if rule.representation == "hidden":
            features = out.hidden[:batch]
        elif (stream := aux_stream(rule)) is not None:  # one of the EAGLE-3 streams (R, N, 3D) -> (B, N, D)
            if out.aux is None:
                raise ValueError(f"cascade representation {rule.representation!r} needs the target's aux streams")
            width = out.aux.shape[-1] // 3
            features = out.aux[:batch, :, stream * width : (stream + 1) * width]
        elif rule.representation == "latent":  # the tokens' codes in the target's latent table (LANTERN's space)
            if tokens is None or target is None:
                raise ValueError("cascade representation 'latent' needs the tree's tokens and the target")
            features = target.latent_table()[tokens]  # (B, N, e)
        elif rule.representation == "probs":
            features = probs
        else:  # "logits": the filtered guided logits, removed tokens at 0
            features = filter_logits(guided, settings).nan_to_num(neginf=0.0)
    elif isinstance(rule, CascadeDevRule):  # the development rule reads the last-layer states
        features = out.hidden[:batch]
    at_leaf = None
    if nodes is not None:
        if target is None or node_row is None:
            raise ValueError("a view over the inner nodes needs the target (its head) and the tree's inner_row")

        def at_leaf(node: Tensor) -> tuple[Tensor, Tensor]:  # (B,) -> (B, V), (B,)
            hidden = out.hidden.gather(1, to_rows(node, cfg)[:, None, None].expand(-1, 1, out.hidden.shape[-1]))
            leaf_index = None if token_index is None else token_index.gather(1, node[:, None])  # (B, 1)
            leaf_logits = target.image_head(hidden)  # (R, 1, V)
            leaf_guided, leaf_probs = processed_distribution(
                leaf_logits, settings, cfg, target, leaf_index, unfiltered=unfiltered
            )
            return leaf_probs.squeeze(1), leaf_guided.squeeze(1).argmax(-1)  # over (B, 1, V)

    greedy_tokens = guided.argmax(-1) if greedy else None
    return TargetView(probs, greedy_tokens, features, nodes, None if nodes is None else node_row, at_leaf)


def greedy_reads_unfiltered(rule: Rule) -> bool:
    """Whether greedy verification under `rule` reads softmax(guided logits) without top-k / top-p: LANTERN's
    does (jadohu/LANTERN `evaluate_posterior_v1` with no logits processor: `torch.softmax(logits)`, then the pooled
    neighbour mass against it), so its relaxed mass and the competing tokens' p are the full distribution's."""
    return isinstance(rule, LanternRule)


def inner_view_pays(num_inner: int, num_nodes: int) -> bool:
    """Whether the target's head and logits chain should run only at a static tree's nodes with children: when
    they are at most half of its nodes (11 of `mc_sim_7b_63`'s 26). With fewer leaves, the leaf row a walk may
    need (`TargetView.at_leaf`) costs more than the rows saved (on the toy, a tree with 9 inner nodes of 11
    decodes 3 % faster with every node; its default, 7 of 9, as fast)."""
    return 2 * num_inner <= num_nodes


def view_nodes(tree: Tree, rule: Rule) -> Tensor | None:
    """The nodes whose target logits verification needs: a static tree's inner nodes where `inner_view_pays`,
    or None for every node: dynamic trees, the rules that read the target at leaves (`needs_every_node`), and
    trees of few leaves."""
    inner = tree.inner_nodes
    if needs_every_node(rule) or inner is None or not inner_view_pays(inner.numel(), tree.num_nodes):
        return None
    return inner


def _ensure_room(cache: KVCache, needed: int, start: int) -> None:
    """Squeeze out padding columns when the next `needed` columns would not fit (batches only)."""
    if cache.length + needed > cache.capacity:
        cache.compact(start)


def _draft(
    ctx: DraftContext,
    config: DecoderConfig,
    pending: _Pending,
    root_token: Tensor,
    greedy: bool,
    generator: torch.Generator | None,
) -> Tree:
    """Steps 1-2: read the pending pairs, then draft a tree from the root's drafter state."""
    positions = ctx.target.image_positions(pending.index)
    out = ctx.drafter.forward(
        pending.features,
        to_rows(pending.tokens, ctx.cfg),
        to_rows(positions, ctx.cfg),
        ctx.cache,
        from_target=True,
        valid=to_rows(pending.valid, ctx.cfg),
        logits_at=(last := to_rows(pending.valid.sum(1) - 1, ctx.cfg)),  # (R,) the bonus token's element
        cfg_scale=ctx.cfg_scale,
    )
    rows = torch.arange(last.shape[0], device=last.device)
    if out.logits.shape[1] != 1:  # a drafter that computes every element's logits: take the bonus element here
        picked = last[: out.logits.shape[0]]  # guided logits have B rows, the first B of R share their element
        out = dataclasses.replace(out, logits=out.logits[rows[: len(picked)], picked][:, None])
    predicted = (ctx.root_index + 1).clamp_max(ctx.target.geometry.num_tokens - 1)[:, None]  # (B, 1)
    root_q = ctx.proposal(out, predicted)[:, 0]  # (B, V), under top-k on its support (B, k)
    root_hidden = out.hidden[rows, last]  # (R, D)
    tree_start = ctx.cache.length
    if config.tree == "static":
        tree = draft_static_tree(ctx, config.spec, root_token, root_q, root_hidden, greedy, generator)
    elif config.tree == "dynamic-sampled":
        tree = draft_sampled_dynamic_tree(
            ctx,
            root_token,
            root_q,
            root_hidden,
            config.top_k,
            config.depth,
            config.total_tokens,
            greedy,
            generator,
        )
    else:
        tree = draft_dynamic_tree(ctx, root_token, root_q, root_hidden, config.top_k, config.depth, config.total_tokens)
    ctx.cache.truncate(tree_start)  # draft columns are recomputed from target features next step
    return tree


@functools.lru_cache(maxsize=8)
def _past_the_path(batch: int, device: torch.device) -> Tensor:
    """(batch, 1) int64 -1: the padding after a path's last node (the commit reads one node past it); a shared
    constant, never written to."""
    return torch.full((batch, 1), -1, dtype=torch.long, device=device)


def _commit(
    tree: Tree,
    verdict_last: Tensor,
    num_accepted: Tensor,
    bonus: Tensor,
    offsets: Tensor,
    cache: KVCache,
    tree_start: int,
    feats: Tensor,
    cfg: bool,
    root_index: Tensor,
    live: Tensor,
    num_tokens: int,
) -> _Pending:
    """Step 5: keep the accepted path's target KV entries; return the pairs the drafter reads next.
    offsets: arange(width), width = the longest accepted path plus one (the commit width, read on the host)."""
    batch, width = tree.tokens.shape[0], offsets.shape[0]
    rows = node_range(batch, bonus.device)
    path = torch.cat([tree.paths[rows, verdict_last], _past_the_path(batch, bonus.device)], dim=1)[:, : width + 1]
    nodes = path.clamp_min(0)  # (B, width + 1) the path's nodes, padding at the root
    keep = (path[:, :width] >= 0) & live[:, None]  # a finished image's root would otherwise stay valid, fill the cache
    cache.keep_columns(tree_start, to_rows(tree_start + nodes[:, :width], cfg), to_rows(keep, cfg))
    following = tree.tokens.gather(1, nodes[:, 1:])  # token after each path node
    following = torch.where(offsets == num_accepted[:, None], bonus[:, None], following)
    features = feats.gather(1, to_rows(nodes[:, :width], cfg)[..., None].expand(-1, -1, feats.shape[-1]))
    index = (root_index[:, None] + 1 + offsets).clamp_max(num_tokens - 1)  # padding may run past the image end
    return _Pending(features, following, index, keep)


@decoding_mode
def generate_speculative(
    target: ImageTarget,
    drafter: Drafter,
    prompts: list[str],
    rule: Rule,
    config: DecoderConfig | None = None,
    settings: SamplingDefaults | None = None,
    generator: torch.Generator | None = None,
    hooks: DecodeHooks = NO_HOOKS,
    verifier: Callable[..., Verdict] = verify,
) -> SpeculativeGeneration:
    """Generate one image per prompt with tree speculative decoding.

    Args:
        target: the model whose distribution is sampled (exactly, for `ExactRule`).
        drafter: an EAGLE-style drafter (`inference.decoding.drafter.Drafter`).
        prompts: B prompts.
        rule: the verification rule (`inference.decoding.verify`).
        config: the draft tree; default: the static sampled tree, the target's `default_static_tree`.
        settings: sampling settings, default the target's; temperature 0 = greedy.
        generator: source of all randomness (draws, acceptance tests, bonus tokens).
        hooks: told each phase of every step (timing, op counting) and every verification.
        verifier: `inference.decoding.verify.verify`, or its compiled form
            (`inference.decoding.compiled.compile_decoding`).
    """
    config, settings = (config or DecoderConfig()).for_target(target), settings or target.sampling
    cfg, greedy = settings.cfg_scale != 1.0, settings.temperature == 0
    started = time.perf_counter()
    num_tokens, batch, width_max = target.geometry.num_tokens, len(prompts), config.max_depth + 1
    if num_tokens + width_max >= _FIELD:
        raise ValueError(f"an image of {num_tokens} tokens does not fit the decoder's packed host read (< {_FIELD})")
    conditioning = target.condition(prompts, cfg=cfg)
    capacity = target.prefix_length + num_tokens + config.num_nodes + num_tokens // 4 + width_max
    target_cache = target.allocate_cache(conditioning.rows, capacity)
    drafter_cache = drafter.allocate_cache(conditioning.rows, capacity)
    use_aux = drafter.feature_source == "aux" or aux_stream(rule) is not None
    prefix = target.prefill(conditioning, target_cache, return_aux=use_aux)
    drafter.prefill(conditioning, prefix, drafter_cache)
    token_zero = torch.zeros(batch, dtype=torch.long, device=prefix.logits.device)
    _, first_probs = processed_distribution(
        prefix.logits[:, -1], settings, cfg, target, token_zero, one_hot_greedy=True
    )
    first = draw_tokens(first_probs, settings, generator)  # (B,) token 0
    tokens = torch.zeros(batch, num_tokens + width_max, dtype=torch.long, device=first.device)
    tokens[:, 0] = first
    count = torch.ones(batch, dtype=torch.long, device=first.device)  # tokens generated so far
    pending = _Pending(
        target_features(prefix, drafter)[:, -1:],
        first[:, None],
        torch.zeros_like(first)[:, None],
        torch.ones(batch, 1, dtype=torch.bool, device=first.device),
    )
    accepted_log, drafter_forwards, done, most = [], 1, False, 1  # most: the largest count, known on the host
    charged = torch.zeros((), device=first.device)  # summed on the device: no sync per step
    while not done:
        with hooks.phase("draft"):
            root_index = count - 1
            live = count < num_tokens
            _ensure_room(drafter_cache, width_max + config.num_nodes, 0)  # its prefix layout is its own
            ctx = DraftContext(drafter, drafter_cache, target, settings, cfg, root_index, config.max_depth)
            tree = _draft(ctx, config, pending, tokens.gather(1, root_index[:, None])[:, 0], greedy, generator)
            drafter_forwards += 1 + ctx.forwards
        with hooks.phase("target"):
            _ensure_room(target_cache, tree.num_nodes, target.prefix_length)
            tree_start = target_cache.length
            index = tree_positions(tree.depths, root_index).clamp_max(num_tokens - 1)  # too-deep: never accepted
            out = target.forward(
                to_rows(tree.tokens, cfg),
                to_rows(target.image_positions(index), cfg),
                target_cache,
                to_rows(tree.attention_mask, cfg),
                return_aux=use_aux,
                logits_at=(nodes := view_nodes(tree, rule)),
            )  # step 3
        with hooks.phase("view"):
            predicted = (index + 1).clamp_max(num_tokens - 1)  # (B, N): the image index each node's output predicts
            view = build_target_view(
                out, rule, settings, cfg, greedy, target, predicted, nodes, tree.inner_row, tree.tokens
            )
        with hooks.phase("verify"):
            # drafts past the image end are never accepted; the limit only binds in a row's last steps
            near_end = most >= num_tokens - config.max_depth
            max_accept = (num_tokens - count - 1).clamp_min(0) if near_end else None
            verdict = verifier(tree, view, rule, Uniforms.draw(tree, generator), max_accept, greedy)  # step 4
        hooks.on_verify(tree, view, verdict)
        with hooks.phase("commit"):
            num_accepted = verdict.num_accepted * live  # finished rows accept nothing
            # Host sync, once per step: the commit width and whether every image is complete, packed in one read.
            new_count = count + num_accepted + 1  # finished rows: count + 1, past the end
            least_count, most_count = new_count.aminmax()
            packed = ((num_accepted.max() + 1) * _FIELD + least_count) * _FIELD + most_count
            width, least_most = divmod(int(packed), _FIELD * _FIELD)
            least, most = divmod(least_most, _FIELD)
            pending = _commit(
                tree,
                verdict.last_node,
                num_accepted,
                verdict.next_token,
                offsets := node_range(width, count.device),
                target_cache,
                tree_start,
                target_features(out, drafter),
                cfg,
                root_index,
                live,
                num_tokens,
            )  # step 5
            valid_slots = count[:, None] + offsets
            slots = valid_slots.where(pending.valid, tokens.shape[1] - 1)
            tokens.scatter_(1, slots, pending.tokens)
            count = torch.where(live, new_count, count)
            accepted_log.append(torch.where(live, num_accepted, -1))
            charged += verdict.tv_charged.mean()
            done = least >= num_tokens
    accepted = torch.stack(accepted_log)  # (steps, B)
    steps, plus_one = acceptance_tally(accepted)
    return SpeculativeGeneration(
        tokens=tokens[:, :num_tokens],
        tau=plus_one / steps,
        accepted=accepted,
        target_forwards=1 + len(accepted_log),
        drafter_forwards=drafter_forwards,
        tv_charged=float(charged) / len(accepted_log),
        seconds=time.perf_counter() - started,
    )
