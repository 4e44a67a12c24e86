"""The drafter training objective over one batch of extracted features, shared by the LightningModule,
the training benchmark's plain PyTorch loop (`inference/measure/pipeline/training_bench.py`) and the tests.

Alignment (data/shards.py): row j of a sample's features is the target state that predicted image
token j, so head(hidden[j]) is token j's target logits. Drafter element t reads (feature t, token t)
and, at unrolled step k, token t + k; it predicts token t + k + 1, whose target distribution is
softmax(head(hidden[t + k + 1])) and whose CASCADE weight comes from row t + k + 1 of the convergence
source: hidden by default, or one of EAGLE-3's streams (`convergence_source`).

CFG (docs/method.md, section "CFG in training"): the target samples from u + s (c - u). With `cfg_loss_weight` > 0 the
drafter runs both branches ([cond; uncond] rows, the unconditional rows reading the stored
unconditional features) and a soft cross-entropy on the CFG-combined draft and target distributions
is added; with `uncond_rate` > 0 a sample is trained on its unconditional branch with that
probability instead (LANTERN). Accuracies are measured on the CFG-combined distributions whenever
both branches run (always at evaluation when unconditional features are loaded), since that is
what the decoder drafts from.

Layout rules (`ImageTarget.constrain_logits`, e.g. Lumina's forced end-of-line column): the target
distributions the drafter learns from are constrained as the decoders constrain them (after CFG), so
at a forced position the target is the forced token and elsewhere layout tokens get no mass; top-1
agreement (acc_k) constrains the draft too, as the decoders do (full draft vocabulary only). Image
indices stop at G - 1, so a token after the image (Lumina's end-of-image) is never a training target.
Targets without a rule are untouched.

Shapes: B samples, R rows (B or 2B), L tokens per sample, K unrolled steps, V image vocabulary,
Vd draft vocabulary, D target hidden size, Df feature width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference.decoding.sampling import combine_cfg
from models.eagle import EagleDraftModel
from models.target import ImageTarget
from training.losses import (
    convergence_weights,
    feature_regression_loss,
    masked_mean_denominator,
    shift_left,
    simulated_acceptance_length,
    soft_cross_entropy,
    step_weights,
    uniform_feature_noise,
)

CONVERGENCE_SOURCES = ("hidden", "aux-low", "aux-mid", "aux-high")
"""The states that can define CASCADE's convergence region: the last hidden state or an EAGLE-3 stream."""

FORBIDDEN_LOGIT = -1.0e4
"""Target logit of a token the layout forbids (finite, so CFG and soft cross-entropy never meet inf - inf)."""


@dataclass(kw_only=True)
class ObjectiveConfig:
    """Loss recipe. Defaults are EAGLE-3's; EAGLE-1 sets ttt_steps 1, ce_weight 0.1, feature_weight 1, noise_std 0.2."""

    ttt_steps: int = 7
    """Unrolled training-time-test steps K (EAGLE-3: 7; EAGLE-1: 1)."""
    step_decay: float = 0.8
    """Step k's loss weight is step_decay**k."""
    ce_weight: float = 1.0
    """Weight of the soft cross-entropy against the target distribution (EAGLE-1: 0.1)."""
    feature_weight: float = 0.0
    """Weight of the smooth-L1 feature regression (EAGLE-1: 1.0; EAGLE-3 has no feature target)."""
    noise_std: float = 0.0
    """EAGLE-1's uniform noise on the input features (0.2); 0 = none."""
    noise_reference_length: int | None = None
    """Scale the noise by reference_length / L as EAGLE-1 does (512); None = no length scaling."""
    convergence_tau: float = 0.625
    """CASCADE: cosine threshold for a position to count as convergent."""
    convergence_weight: float = 2.0
    """CASCADE: soft-CE weight multiplier at convergent positions; 1.0 turns reweighting off."""
    convergence_source: str = "hidden"
    """CASCADE: the states that define the convergence region. "hidden": the last hidden state, raw cosine (the
    recipe of docs/method.md, section "Convergence-region reweighting"). "aux-low" | "aux-mid" | "aux-high": one of the
    EAGLE-3 streams (needs the aux features in the batch, `data.load_aux: true`), mean-centred cosine as CASCADE's
    decoder compares them;
    `python -m inference.signals` ranks them against ground truth (docs/signals.md). convergence_tau is read on
    that source's scale."""
    uncond_rate: float = 0.0
    """Probability of training a sample on its unconditional branch instead (needs unconditional features)."""
    cfg_loss_weight: float = 0.0
    """Weight of the soft-CE on CFG-combined distributions (runs both branches; needs unconditional features)."""
    cfg_scale: float | None = None
    """Guidance scale of that combination; None = the target's sampling default."""
    eval_steps: int = 5
    """Chain depth of acc_k and the simulated acceptance length at evaluation (at least ttt_steps)."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.eval_steps < 1:
            raise ValueError(f"ttt_steps and eval_steps must be >= 1, got {self.ttt_steps}, {self.eval_steps}")
        if not 0 <= self.uncond_rate <= 1:
            raise ValueError(f"uncond_rate must lie in [0, 1], got {self.uncond_rate}")
        for name in ("ce_weight", "feature_weight", "noise_std", "cfg_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.uncond_rate > 0 and self.cfg_loss_weight > 0:
            raise ValueError(
                f"objective.uncond_rate={self.uncond_rate} and objective.cfg_loss_weight={self.cfg_loss_weight} are "
                "alternatives: cfg_loss_weight > 0 already trains both branches of every sample, so a branch swap "
                "would be ignored; set one of them to 0"
            )
        if self.convergence_weight <= 0:
            raise ValueError(f"convergence_weight must be > 0 (1.0 = off), got {self.convergence_weight}")
        if self.convergence_source not in CONVERGENCE_SOURCES:
            raise ValueError(
                f"objective.convergence_source={self.convergence_source!r} is not one of {list(CONVERGENCE_SOURCES)}"
            )

    @property
    def convergence_centred(self) -> bool:
        """Whether the convergence region compares mean-centred cosines (the EAGLE-3 streams) or raw ones (hidden)."""
        return self.convergence_source != "hidden"


@dataclass
class ObjectiveOutput:
    """The loss to minimise and what to log."""

    loss: Tensor  # () the weighted sum over trained steps
    ce: list[Tensor] = field(default_factory=list)  # per step: soft CE (per branch)
    feature: list[Tensor] = field(default_factory=list)  # per step: feature regression (EAGLE-1)
    cfg_ce: list[Tensor] = field(default_factory=list)  # per step: soft CE on CFG-combined distributions
    accuracy: list[Tensor] = field(default_factory=list)  # per step: top-1 agreement acc_k
    convergent_fraction: Tensor | None = None  # share of counted positions CASCADE reweights
    tokens: int = 0  # predicted tokens counted at step 0 (for throughput)

    @property
    def tau(self) -> Tensor:
        """Simulated acceptance length 1 + sum_k prod_{i <= k} acc_i of a greedy chain (+1 = the bonus token)."""
        return simulated_acceptance_length(self.accuracy)


def feature_key(model: EagleDraftModel) -> str:
    """The batch field a drafter reads: EAGLE-1 `hidden`, EAGLE-3 `aux`."""
    return "hidden" if model.config.architecture == "eagle1" else "aux"


def convergence_stream(batch: dict, field: str, source: str, device: torch.device) -> Tensor:
    """The EAGLE-3 stream named by `source` from batch[field] (B, L, 3D, streams low|mid|high) -> (B, L, D)."""
    if field not in batch:
        raise ValueError(
            f"objective.convergence_source={source!r} reads the EAGLE-3 streams, but the batch has no {field!r}: "
            "set data.load_aux: true (offline data needs an extraction with store_aux: true), or set "
            "objective.convergence_source: hidden"
        )
    aux = batch[field].to(device)
    width = aux.shape[-1] // 3
    stream = CONVERGENCE_SOURCES.index(source) - 1  # 0 low, 1 mid, 2 high
    return aux[..., stream * width : (stream + 1) * width]


def draw_uncond_swap(config: ObjectiveConfig, batch_size: int, generator: torch.Generator | None) -> Tensor | None:
    """(B,) bool on the generator's device: the samples a training step trains on their unconditional branch
    (each with probability `uncond_rate`); None when uncond_rate is 0.

    The first draw of a training step's generator, wherever it is made: `DrafterSystem` draws it before the
    online target forward (to compute only those samples' unconditional rows, passed on as
    `batch["uncond_swap"]`), and `drafter_objective` draws it again from the same seeded generator, so the
    draws after it (the input noise) are the same whether the mask came in the batch or not.
    """
    if config.uncond_rate <= 0:
        return None
    draw = torch.rand(batch_size, generator=generator, device=generator.device if generator else None)
    return draw < config.uncond_rate


def uncond_samples_read(config: ObjectiveConfig, batch_size: int, training: bool, swap: Tensor | None) -> Tensor:
    """(B,) bool: the samples whose unconditional states `drafter_objective` reads, given the step's swap mask.

    Every sample when both branches run (cfg_loss_weight > 0, or evaluation); in a training step with
    uncond_rate > 0, the swapped ones (`swap`, from `draw_uncond_swap`); otherwise none.
    """
    if config.cfg_loss_weight > 0 or not training:
        return torch.ones(batch_size, dtype=torch.bool)
    if swap is not None:
        return swap
    return torch.zeros(batch_size, dtype=torch.bool)


def drafter_objective(
    model: EagleDraftModel,
    target: ImageTarget,
    batch: dict,
    config: ObjectiveConfig,
    *,
    training: bool,
    generator: torch.Generator | None = None,
) -> ObjectiveOutput:
    """Unroll the drafter over a batch and compute losses and acc_k.

    Args:
        model: the drafter; target: its frozen target (embedding, image head, positions).
        batch: a FeatureDataModule batch (tokens, hidden, aux, uncond_*, loss_mask); optionally uncond_swap (B,)
            bool, the samples trained on their unconditional branch, drawn before the batch's online forward
            (`draw_uncond_swap`); without it the objective draws the mask itself.
        training: unroll `ttt_steps` with noise and uncond sampling; otherwise unroll
            max(ttt_steps, eval_steps) steps, clean, on both branches when available.
        generator: randomness of the noise and the branch choice (seeded per step for exact resume).
    """
    key = feature_key(model)
    device = model.fc.weight.device
    tokens = batch["tokens"].to(device)  # (B, L)
    mask = batch["loss_mask"].to(device)  # (B, L) bool
    batch_size, length = tokens.shape
    features = batch[key].to(device)  # (B, L, Df)
    hidden = batch["hidden"].to(device)  # (B, L, D): the targets
    uncond_key = f"uncond_{key}"
    has_uncond = uncond_key in batch and "uncond_hidden" in batch
    needs_uncond = config.cfg_loss_weight > 0 or (training and config.uncond_rate > 0)
    if needs_uncond and not has_uncond:
        raise ValueError(
            f"cfg_loss_weight / uncond_rate need unconditional features ({uncond_key}, uncond_hidden) in the batch: "
            "extract with store_uncond: true and set data.load_uncond: true, or set both to 0"
        )
    both = has_uncond and (config.cfg_loss_weight > 0 or not training)
    source = config.convergence_source if config.convergence_weight != 1.0 else "hidden"
    region = None if source == "hidden" else convergence_stream(batch, "aux", source, device)  # (B, L, D)
    if both:
        features = torch.cat([features, batch[uncond_key].to(device)])
        hidden = torch.cat([hidden, batch["uncond_hidden"].to(device)])
        tokens, mask = torch.cat([tokens, tokens]), torch.cat([mask, mask])
        if region is not None:
            region = torch.cat([region, convergence_stream(batch, "uncond_aux", source, device)])
    elif training and config.uncond_rate > 0:
        drawn = draw_uncond_swap(config, batch_size, generator)  # drawn even when given: the noise draws follow it
        assert drawn is not None  # uncond_rate > 0
        swap = batch.get("uncond_swap", drawn).to(device)[:, None, None]
        features = torch.where(swap, batch[uncond_key].to(device), features)
        hidden = torch.where(swap, batch["uncond_hidden"].to(device), hidden)
        if region is not None:
            region = torch.where(swap, convergence_stream(batch, "uncond_aux", source, device), region)

    steps = config.ttt_steps if training else max(config.ttt_steps, config.eval_steps)
    num_tokens = target.geometry.num_tokens
    index = torch.arange(length + steps - 1, device=device).clamp_max(num_tokens - 1)
    positions = target.image_positions(index).expand(tokens.shape[0], -1)  # (R, L + K - 1)
    noise = None
    if training and config.noise_std > 0:

        def noise(x: Tensor) -> Tensor:
            return uniform_feature_noise(x, config.noise_std, config.noise_reference_length, generator)

    outputs = model.unroll(target.embed_image_tokens, features, tokens, positions, mask, steps, noise)

    with torch.no_grad():
        head_dtype = target.image_head_weight().dtype
        target_logits = target.image_head(hidden.to(head_dtype)).float()  # (R, L, V)
        weights = convergence_weights(  # (R, L)
            hidden if region is None else region,
            mask,
            config.convergence_tau,
            config.convergence_weight,
            centred=config.convergence_centred,
        )
    reduced = model.config.draft_vocab != model.config.vocab_size
    scale = target.sampling.cfg_scale if config.cfg_scale is None else config.cfg_scale

    def layout(logits: Tensor, step: int) -> Tensor:
        """The target's layout rule (`constrain_logits`, e.g. Lumina's end-of-line column) on the logits of
        tokens t + step + 1, as the decoders apply it after CFG; forbidden tokens get a finite FORBIDDEN_LOGIT
        so that CFG differences and soft cross-entropies stay finite. Targets without a rule: unchanged."""
        index = (torch.arange(length, device=device) + step + 1).clamp_max(num_tokens - 1)  # (L,) image index
        constrained = target.constrain_logits(logits, index.expand(logits.shape[0], -1))
        return logits if constrained is logits else constrained.clamp_min_(FORBIDDEN_LOGIT)  # a new tensor

    out = ObjectiveOutput(loss=torch.zeros((), device=device))
    decays = step_weights(steps, config.step_decay)
    for step in range(steps):
        counted = shift_left(mask, step + 1, False)  # (R, L): token t + step + 1 exists
        raw_target = shift_left(target_logits, step + 1)  # (R, L, V)
        step_target = layout(raw_target, step)
        draft = model.draft_logits(outputs[step], lambda h: target.image_head(h.to(head_dtype))).float()  # (R, L, Vd)
        in_draft = counted
        draft_target = step_target
        if reduced:  # EAGLE-3 reduced vocabulary: positions whose target argmax is outside it do not train
            draft_target = step_target[..., model.t2d]
            in_draft = counted & model.t2d[step_target.argmax(-1)]
        step_weight = shift_left(weights, step + 1) * in_draft
        ce = soft_cross_entropy(draft, draft_target.softmax(-1), step_weight, counted)
        out.ce.append(ce.detach())
        total = config.ce_weight * ce
        if config.feature_weight > 0:
            regression = feature_regression_loss(outputs[step], shift_left(hidden, step + 1), counted)
            out.feature.append(regression.detach())
            total = total + config.feature_weight * regression
        cond = slice(0, batch_size)
        if both:
            draft_guided = combine_cfg(draft, scale)  # (B, L, Vd)
            target_guided = layout(combine_cfg(raw_target, scale), step)  # (B, L, V): CFG, then the layout rule
            if config.cfg_loss_weight > 0:
                guided_target = target_guided[..., model.t2d] if reduced else target_guided
                cfg_ce = soft_cross_entropy(draft_guided, guided_target.softmax(-1), step_weight[cond], counted[cond])
                out.cfg_ce.append(cfg_ce.detach())
                total = total + config.cfg_loss_weight * cfg_ce
        else:
            draft_guided, target_guided = draft[cond], step_target[cond]
        with torch.no_grad():
            draft_ids = (draft_guided if reduced else layout(draft_guided, step)).argmax(-1)
            if reduced:
                draft_ids = draft_ids + model.d2t[draft_ids]  # draft id -> image token id
            agree = (draft_ids == target_guided.argmax(-1)) & counted[cond]
            out.accuracy.append(agree.sum() / masked_mean_denominator(counted[cond]))
        if step < config.ttt_steps:
            out.loss = out.loss + decays[step] * total
    with torch.no_grad():
        counted = shift_left(mask, 1, False)[:batch_size]
        reweighted = shift_left(weights, 1)[:batch_size] != 1
        out.convergent_fraction = (reweighted & counted).sum() / masked_mean_denominator(counted)
        out.tokens = int(counted.sum())
    return out
