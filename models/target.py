"""The target interface: what the pipeline needs from any autoregressive text-to-image model.

Whatever the family (the toy world's LlamaGen, LlamaGen-XL, Janus-Pro, Lumina-mGPT), extraction,
training and the tree decoder speak to a target only through `ImageTarget`, in terms of the image
vocabulary:

- `condition(prompts, cfg=True)` turns prompts into the prefix of every row: B conditional rows
  followed by B unconditional rows ([cond; uncond] halves, as LlamaGen and transformers' Janus lay
  them out), exactly as the model's official sampler builds them;
- `prefill` runs that prefix into a KV cache; its last output predicts the first image token;
- `forward` runs new image tokens over the cache, with explicit positions (`image_positions`) and
  an optional tree attention mask, and returns image-vocabulary logits, the last layer's post-norm
  hidden state and, on request, the EAGLE-3 auxiliary streams (low, mid, high);
- `embed_image_tokens` and `image_head` are the frozen input embedding and output head over image
  codes, for drafters to reuse;
- `sampling` holds the official sampling defaults and `geometry` the token grid and pixel size;
  `decode_images` turns image tokens into pixels;
- `constrain_logits(logits, token_index)` forbids tokens the image layout rules out at an index
  (-inf logits), applied by every decoder after CFG; by default it constrains nothing;
- `latent_table()` and `lm_embedding_table()` are the two tables the peers' rules measure token
  proximity on (`inference.decoding.generate.build_rule`): the image tokenizer's VQ codebook, LANTERN's latent
  proximity, and the LM's input embeddings of the image tokens, GSD's distance.

Shapes: B prompts, R rows (2B with CFG, else B), T new tokens, C prefix length, D hidden size,
V image vocabulary, G image tokens per image.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

from models.kv_cache import KVCache


def resolve_aux_layer_ids(aux_layer_ids: tuple[int, ...] | list[int] | None, num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's residual streams for a target of `num_layers` layers: None = (2, L // 2, L - 3).

    Index i is the input of layer i (transformers' `hidden_states[i]`); i = L is the post-norm output.

    Raises:
        ValueError: naming an entry outside 0..L.
    """
    if aux_layer_ids is None:
        aux_layer_ids = (2, num_layers // 2, num_layers - 3)
    resolved = tuple(int(i) for i in aux_layer_ids)
    for layer in resolved:
        if not 0 <= layer <= num_layers:
            raise ValueError(f"aux_layer_ids entry {layer} is outside 0..{num_layers}")
    return resolved


@dataclass(frozen=True, kw_only=True)
class SamplingDefaults:
    """A target's official sampling settings: CFG, then temperature, then top-k, then top-p."""

    cfg_scale: float
    """Guidance scale s in u + s (c - u); 1.0 means no guidance."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_k: int | None = None
    """Keep the k most likely image tokens; None keeps all."""
    top_p: float | None = None
    """Keep the smallest set of tokens with this much probability; None keeps all."""

    def __post_init__(self) -> None:
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {self.top_p}")


@dataclass(frozen=True, kw_only=True)
class ImageGeometry:
    """Where image tokens go and what they decode to."""

    grid: tuple[int, int]
    """Token rows and columns of an image."""
    image_size: tuple[int, int]
    """Pixel height and width of a decoded image."""

    @property
    def num_tokens(self) -> int:
        """G, the image tokens generated per image."""
        return self.grid[0] * self.grid[1]


@dataclass
class Conditioning:
    """The prefix of every row: B conditional rows, then (with CFG) B unconditional rows."""

    inputs_embeds: Tensor  # (R, C, D)
    valid: Tensor  # (R, C) bool: prefix slots that later tokens may attend to (False for padding)
    positions: Tensor  # (C,) or (R, C) int64
    num_prompts: int  # B
    cfg: bool  # whether the unconditional half is present

    @property
    def rows(self) -> int:
        return self.inputs_embeds.shape[0]


@dataclass
class TargetOutput:
    """One target forward: image logits, post-norm hidden state, optional EAGLE-3 streams."""

    logits: Tensor  # (R, T, V), or (R, T', V) at the forward's `logits_at`
    hidden: Tensor  # (R, T, D)
    aux: Tensor | None = None  # (R, T, 3D): low, mid and high streams concatenated


class ImageTarget(ABC):
    """An autoregressive text-to-image model seen through the image vocabulary."""

    name: str
    family: str
    sampling: SamplingDefaults
    geometry: ImageGeometry
    default_static_tree: str = "mc_sim_7b_63"
    """The static draft tree the tree decoder uses unless told otherwise (`inference.decoding.tree.STATIC_TREES`)."""

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """D, the width of `hidden`."""

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Decoder layers of the target."""

    @property
    @abstractmethod
    def image_vocab_size(self) -> int:
        """V, the image codebook size."""

    @property
    @abstractmethod
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Residual streams returned as `aux` (index i = input of layer i, transformers' hidden_states[i])."""

    @property
    @abstractmethod
    def prefix_length(self) -> int:
        """C, the prefix slots `condition` produces."""

    @property
    def device(self) -> torch.device:
        return self.image_head_weight().device

    @abstractmethod
    def to(self, device: torch.device | str) -> Self:
        """Move every tensor the target holds to `device`, in place, and return the target itself.

        Every tensor: the networks' parameters and buffers (language model, caption encoder, VQ decoder and
        its codebook) and the index or lookup tables the target keeps beside them. Dtypes stay as loaded
        (precision is chosen when the target is built: a VQ decoder or rotary table the target keeps in
        float32 stays float32). The trainer calls it with its root device when a target was loaded elsewhere;
        loaders take `device=` to build the target there directly.
        """

    @abstractmethod
    def condition(self, prompts: list[str], cfg: bool = True) -> Conditioning:
        """Build the prefix of the conditional (and unconditional) rows for `prompts`."""

    @abstractmethod
    def allocate_cache(self, rows: int, capacity: int) -> KVCache:
        """An empty KV cache for `rows` rows of up to `capacity` tokens."""

    @abstractmethod
    def prefill(self, conditioning: Conditioning, cache: KVCache, return_aux: bool = False) -> TargetOutput:
        """Run the prefix into `cache`. The output at the last prefix slot predicts image token 0."""

    @abstractmethod
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        tree_mask: Tensor | None = None,
        return_aux: bool = False,
        logits_at: Tensor | None = None,
    ) -> TargetOutput:
        """Run new image tokens over the cache.

        Args:
            tokens: (R, T) image token ids.
            positions: (T,) or (R, T) position ids, from `image_positions`.
            cache: holds the prefix and every committed token; the new tokens are appended.
            tree_mask: (T, T) or (R, T, T) bool, which new tokens each may attend to; None = causal.
            return_aux: also return the EAGLE-3 auxiliary streams.
            logits_at: (T',) int64 the new tokens whose logits are wanted (the head runs on those rows
                only; `hidden` still covers all T); None = every token.
        """

    @abstractmethod
    def image_positions(self, token_index: Tensor) -> Tensor:
        """Position ids of image tokens given their index in the image (0 .. G-1), same shape."""

    @abstractmethod
    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        """The frozen input embedding of image tokens: (...,) int64 -> (..., D)."""

    @abstractmethod
    def image_head(self, hidden: Tensor) -> Tensor:
        """The frozen output head: (..., D) post-norm hidden -> (..., V) image logits."""

    @abstractmethod
    def image_head_weight(self) -> Tensor:
        """A parameter of the head, to learn the device and dtype."""

    @abstractmethod
    def decode_images(self, tokens: Tensor) -> Tensor:
        """(B, G) image tokens -> (B, H, W, 3) uint8 pixels."""

    def constrain_logits(self, logits: Tensor, token_index: Tensor) -> Tensor:
        """Guided image logits (B, ..., V) of image indices `token_index` (B, ...) -> the same logits with the
        tokens the target's layout forbids there set to -inf.

        Decoders call it right after CFG and before temperature/top-k/top-p, on target and drafter logits
        alike; the drafter objective on its training targets. It must not modify `logits` in place: a rule
        returns a new tensor. Default: no constraint, `logits` returned unchanged (the same tensor).
        """
        return logits

    def latent_table(self) -> Tensor:
        """(V, e) the latent vector of every image-vocabulary index: the VQ codebook the target's images are
        tokenized with, which LANTERN's latent proximity reads (`quantize.embedding.weight`, raw, as its authors).

        Implementations return the model's own tensor where they can (no copy, detached), in its dtype and on
        its device; index v is image token v. Rows for tokens that have no code (Lumina-mGPT's end-of-line and
        end-of-image) are the target's choice and documented there.

        Raises:
            NotImplementedError: by default: the target exposes no VQ codebook.
        """
        raise NotImplementedError(
            f"target {self.name!r} ({type(self).__name__}) exposes no latent table (its VQ codebook): implement "
            "latent_table() for it, or give LANTERN a stand-in table (build_rule's latent_table=)"
        )

    @torch.no_grad()
    def lm_embedding_table(self) -> Tensor:
        """(V, D) the LM's input embedding of every image-vocabulary index: the vectors the LM reads for image
        tokens, on which GSD's authors measure token distance (the LM's input embedding table, indexed by LM id).

        Default: `embed_image_tokens` over all V indices (a new tensor, in the target's dtype); a target whose
        image tokens are rows of an embedding parameter returns that parameter itself.
        """
        return self.embed_image_tokens(torch.arange(self.image_vocab_size, device=self.device))


class DecoderTarget(ImageTarget):
    """A target whose prefill and forward are one decoder pass over input embeddings (every target here).

    Subclasses implement `run_decoder`; the prefix runs with its validity mask, image tokens run
    through the frozen image embedding with an optional tree mask.
    """

    @torch.no_grad()
    def prefill(self, conditioning: Conditioning, cache: KVCache, return_aux: bool = False) -> TargetOutput:
        inputs, positions, valid = conditioning.inputs_embeds, conditioning.positions, conditioning.valid
        return self.run_decoder(inputs, positions, cache, None, valid, return_aux)

    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        tree_mask: Tensor | None = None,
        return_aux: bool = False,
        logits_at: Tensor | None = None,
    ) -> TargetOutput:
        inputs = self.embed_image_tokens(tokens)
        return self.run_decoder(inputs, positions, cache, tree_mask, None, return_aux, logits_at)

    @abstractmethod
    def run_decoder(
        self,
        inputs: Tensor,
        positions: Tensor,
        cache: KVCache | None,
        tree_mask: Tensor | None,
        new_valid: Tensor | None,
        return_aux: bool,
        logits_at: Tensor | None = None,
    ) -> TargetOutput:
        """Run (R, T, D) input embeddings over the cache; new_valid (R, T) marks padding (None = all valid);
        logits only at `logits_at` (T',) when given (`forward`). Implementations end in `output`.

        cache None: the T inputs are the whole sequence, no KV cache is read or written (teacher forcing's
        one causal pass, `teacher_forced_states`)."""

    def output(self, hidden: Tensor, aux: Tensor | None, logits_at: Tensor | None) -> TargetOutput:
        """The `TargetOutput` of a decoder pass: hidden (R, T, D) -> the head's logits at `logits_at` (or all T)."""
        return TargetOutput(self.image_head(hidden if logits_at is None else hidden[:, logits_at]), hidden, aux)


@dataclass
class TeacherForcedStates:
    """The states a target computes over given image tokens: what extraction records and online training recomputes.

    Row j of every tensor is the state at the position whose logits give image token j.
    """

    hidden: Tensor  # (B, L, D) conditional rows' last-layer post-norm state
    aux: Tensor | None = None  # (B, L, 3D) conditional rows' EAGLE-3 low, mid and high streams
    uncond_hidden: Tensor | None = None  # (B, L, D) unconditional rows' last-layer state
    uncond_aux: Tensor | None = None  # (B, L, 3D) unconditional rows' EAGLE-3 streams

    def fields(self) -> dict[str, Tensor]:
        """The computed streams by shard field name (`hidden`, `aux`, `uncond_hidden`, `uncond_aux`)."""
        named = {"hidden": self.hidden, "aux": self.aux, "uncond_hidden": self.uncond_hidden}
        named["uncond_aux"] = self.uncond_aux
        return {name: value for name, value in named.items() if value is not None}


def select_rows(conditioning: Conditioning, rows: Tensor) -> Conditioning:
    """The prefix of the given rows of `conditioning` only: rows (R',) int64 indices into its R rows.

    `num_prompts` and `cfg` stay as they were (they describe how the rows were built, not how many are kept).
    """
    positions = conditioning.positions if conditioning.positions.dim() == 1 else conditioning.positions[rows]
    return Conditioning(conditioning.inputs_embeds[rows], conditioning.valid[rows], positions,
                        conditioning.num_prompts, conditioning.cfg)  # fmt: skip


def _uncond_samples(uncond: bool | Tensor, num_prompts: int, device: torch.device) -> Tensor:
    """(S,) int64 the samples whose unconditional rows are computed: all (True), none (False) or those of a mask."""
    if isinstance(uncond, bool):
        return torch.arange(num_prompts if uncond else 0, device=device)
    if uncond.shape != (num_prompts,) or uncond.dtype != torch.bool:
        raise ValueError(
            f"teacher_forced_states: uncond must be a bool or a ({num_prompts},) bool mask of the samples whose "
            f"unconditional states are wanted, got {tuple(uncond.shape)} {uncond.dtype}"
        )
    return uncond.to(device).nonzero().squeeze(1)


@torch.no_grad()
def teacher_forced_states(
    target: ImageTarget,
    prompts: list[str],
    tokens: Tensor,
    aux: bool = True,
    uncond: bool | Tensor = False,
    decode_cache: bool = False,
) -> TeacherForcedStates:
    """One teacher-forced pass of `target` over sampled image tokens: the states that predicted every token.

    The state at image position j depends only on the prompt and tokens 0..j-1, so this reproduces the
    states the sampler saw while it generated `tokens`, row for row, whatever else is in the batch
    (the conditioning of a row never depends on the other rows). Extraction stores them; online
    training (`data.features: online`) recomputes them from token-only shards.

    Rows: the B conditional rows, then the unconditional rows of the samples `uncond` names only (a CFG
    batch's [cond; uncond] layout when it names every sample), so a step that reads the unconditional
    branch of a few samples pays for those rows alone.

    The pass: a `DecoderTarget` runs [prefix; tokens 0..L-2] as one causal sequence without a KV cache
    (the prefix's padding slots masked as the cache would mask them), the decode path's attention pattern
    in one call, with no cache to allocate or write. `decode_cache=True` (and any other target) takes the
    decode path instead: prefill into a KV cache, then every token but the last at once over it.

    Args:
        target: the frozen target.
        prompts: B prompt texts, as the target's `condition` consumes them.
        tokens: (B, L) int64 image tokens, L <= G; padding past a sample's length changes none of its states.
        aux: also return the EAGLE-3 auxiliary streams.
        uncond: also return unconditional (CFG) rows' states: True for every sample, False for none, or a (B,)
            bool mask of the samples whose unconditional states are wanted.
        decode_cache: run prefill + forward over a KV cache (the sampler's path) instead of the cacheless pass.

    Returns:
        The states in the target's dtype, on its device (no logits: the head runs on no row). uncond_hidden
        and uncond_aux hold S rows, the samples `uncond` names in order (S = B for True).
    """
    num_prompts, length = tokens.shape
    if len(prompts) != num_prompts:
        raise ValueError(f"{len(prompts)} prompts for {num_prompts} rows of image tokens")
    device = target.device
    samples = _uncond_samples(uncond, num_prompts, device)  # (S,)
    with_uncond = isinstance(uncond, Tensor) or bool(uncond)
    conditioning = target.condition(prompts, cfg=with_uncond)
    if with_uncond and samples.numel() < num_prompts:
        conditioning = select_rows(conditioning, torch.cat([torch.arange(num_prompts, device=device),
                                                            num_prompts + samples]))  # fmt: skip
    rows = torch.cat([tokens, tokens[samples.to(tokens.device)]]) if with_uncond else tokens  # (R, L)
    rows = rows[:, :-1].to(device)  # (R, L-1): the tokens every state but the first reads
    if decode_cache or not isinstance(target, DecoderTarget):
        states, stacked = _decode_cache_pass(target, conditioning, rows, aux)
    else:
        states, stacked = _causal_pass(target, conditioning, rows, aux)
    if aux and stacked is None:
        raise ValueError(f"target {target.name!r} returned no auxiliary streams; ask for aux=False")
    cond = slice(0, num_prompts)
    out = TeacherForcedStates(hidden=states[cond], aux=None if stacked is None else stacked[cond])
    if with_uncond:
        out.uncond_hidden = states[num_prompts:]
        out.uncond_aux = None if stacked is None else stacked[num_prompts:]
    return out


def _decode_cache_pass(
    target: ImageTarget, conditioning: Conditioning, rows: Tensor, aux: bool
) -> tuple[Tensor, Tensor | None]:
    """Prefill the prefix into a KV cache, then run rows (R, L-1) over it: hidden (R, L, D), aux (R, L, 3D)."""
    length = rows.shape[1] + 1
    cache = target.allocate_cache(conditioning.rows, conditioning.inputs_embeds.shape[1] + length)
    first = target.prefill(conditioning, cache, return_aux=aux)  # its last slot predicts token 0
    hidden, streams = [first.hidden[:, -1:]], [first.aux[:, -1:]] if aux and first.aux is not None else []
    if length > 1:
        positions = target.image_positions(torch.arange(length - 1, device=target.device))
        no_logits = torch.zeros(0, dtype=torch.long, device=target.device)
        rest = target.forward(rows, positions, cache, return_aux=aux, logits_at=no_logits)  # hidden (R, L-1, D)
        hidden.append(rest.hidden)
        if aux and rest.aux is not None:
            streams.append(rest.aux)
    return torch.cat(hidden, dim=1), torch.cat(streams, dim=1) if aux and streams else None


def _causal_pass(
    target: DecoderTarget, conditioning: Conditioning, rows: Tensor, aux: bool
) -> tuple[Tensor, Tensor | None]:
    """[prefix; rows] (R, C + L - 1) as one causal sequence, no cache: hidden (R, L, D), aux (R, L, 3D).

    Slot i attends to slot k <= i where k is a valid prefix slot or an image token, and always to itself:
    the mask prefill and forward build over the cache (`build_attention_mask`), so the states are the same.
    """
    prefix = conditioning.inputs_embeds.shape[1]  # C
    count, steps = rows.shape  # R, L-1
    image_positions = target.image_positions(torch.arange(steps, device=rows.device))  # (L-1,)
    positions = conditioning.positions
    if positions.dim() == 2:
        image_positions = image_positions.expand(count, steps)
    positions = torch.cat([positions, image_positions], dim=-1)  # (C + L - 1,) or (R, C + L - 1)
    inputs = torch.cat([conditioning.inputs_embeds, target.embed_image_tokens(rows)], dim=1)  # (R, C + L - 1, D)
    valid = torch.cat([conditioning.valid, torch.ones_like(rows, dtype=torch.bool)], dim=1)
    no_logits = torch.zeros(0, dtype=torch.long, device=rows.device)
    out = target.run_decoder(inputs, positions, None, None, valid, aux, no_logits)
    states = slice(prefix - 1, None)  # the last prefix slot predicts token 0
    return out.hidden[:, states], None if out.aux is None else out.aux[:, states]
