"""EAGLE-1 and EAGLE-3 drafter heads (plain torch), their presets and checkpoints (the config: `models.drafter_config`).

A drafter reads pairs (feature_t, token_{t+1}) and predicts what follows token_{t+1}
(docs/method.md, sections "EAGLE-1" and "EAGLE-3"):

- EAGLE-1: x = fc([embed(token), feature]) (2H -> H, bias), one decoder layer without an input
  norm, output = the predicted next target feature; logits = the frozen target image head(output).
  Deeper draft steps feed the predicted feature back in.
- EAGLE-3: x = fc([low, mid, high]) (3 D_t -> H) for target features, or the drafter's own previous
  hidden deeper in a draft; one decoder layer whose attention reads
  [input_layernorm(embed), hidden_norm(x)] (2H wide) with residual x; logits = lm_head(norm(out))
  over a draft vocabulary; `d2t` (draft id -> target id offset) and `t2d` (target id -> in draft
  vocabulary) map it to image tokens.

The frozen token embedding (and, for EAGLE-1, the image head) belong to the target and are passed
in as tensors / callables: they are never parameters of this module, so they are neither trained
nor saved. Module and parameter names follow the serving layouts (docs/method.md, section "Serving layouts"): EAGLE-3
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; EAGLE-1 `fc`, `layers.0.*`.

`unroll` is the training-time test (TTT): K steps over a whole sequence, each step's element t
attending to step-0 elements <= t (target-fed context) and to itself at earlier steps (its draft
ancestors), with positions advanced by k. `ttt_attention_mask` builds that mask; tests prove it
equals running the drafter step by step through its KV cache as the tree decoder does.

Shapes: R rows, T elements, K unrolled steps, H drafter hidden size, D_t target hidden size,
Df = D_t (EAGLE-1) or 3 D_t (EAGLE-3) feature width, V image vocabulary, Vd draft vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.drafter_config import DrafterConfig
from models.eagle_layers import DraftLayer
from models.kv_cache import KVCache
from models.llamagen import RMSNorm

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SERVING_ARCHITECTURE = {"eagle1": "EagleLlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}


# Presets: (hidden, heads, kv heads, intermediate, vocab). The real targets' values come from their
# configs (docs/targets.md); a drafter layer copies the target's layer shape.
_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (32, 2, 2, 64, 64),
    "toy": (128, 2, 2, 344, 4096),
    "texture": (128, 2, 2, 344, 8192),  # the toy preset's layer over the texture world's 8192 VQ codes
    "llamagen-xl": (1280, 20, 20, 3584, 16384),
    "janus-pro-7b": (4096, 32, 32, 11008, 16384),
    "lumina-mgpt-7b": (4096, 32, 32, 11008, 8194),  # 8192 VQ codes + end-of-line + end-of-image (models/lumina.py)
}


def drafter_preset(name: str, architecture: str, **overrides: Any) -> DrafterConfig:
    """A drafter config for a known target shape: tiny (tests), toy, texture, llamagen-xl, janus-pro-7b,
    lumina-mgpt-7b."""
    if name not in _SHAPES:
        raise ValueError(f"unknown drafter preset {name!r}; known presets: {', '.join(_SHAPES)}")
    known = {f.name for f in fields(DrafterConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown drafter config keys {unknown}; known keys: {sorted(known)}")
    hidden, heads, kv_heads, ffn, vocab = _SHAPES[name]
    base = DrafterConfig(
        architecture=architecture,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        target_hidden_size=hidden,
        vocab_size=vocab,
        target=name,
    )
    return replace(base, **overrides)


# ----------------------------------------------------------------------------- the drafter


class EagleDraftModel(nn.Module):
    """An EAGLE-1 or EAGLE-3 draft head; the target's embedding (and EAGLE-1's head) come from outside."""

    d2t: Tensor  # (Vd,) int64 buffer (EAGLE-3): image token id of draft id i is i + d2t[i]
    t2d: Tensor  # (V,) bool buffer (EAGLE-3): which image tokens the draft vocabulary holds

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        if config.architecture == "eagle1":
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
            self.layers = nn.ModuleList([DraftLayer(config)])
        else:
            self.fc = nn.Linear(config.feature_width, hidden, bias=False)
            self.midlayer = DraftLayer(config)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
            if config.draft_vocab != config.vocab_size:
                self.t2d[config.draft_vocab :] = False  # a placeholder map until set_vocab_map
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) linear weights (Llama's initializer), zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def layer(self) -> DraftLayer:
        return self.layers[0] if self.config.architecture == "eagle1" else self.midlayer  # type: ignore[return-value]

    def set_vocab_map(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install a reduced draft vocabulary: d2t (Vd,) int64 offsets, t2d (V,) bool."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not fit this drafter "
                f"(draft vocab {self.config.draft_vocab}, vocab {self.config.vocab_size})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def forward(
        self,
        embeds: Tensor,
        features: Tensor,
        positions: Tensor,
        mask: Tensor,
        *,
        from_target: bool,
        cache: KVCache | None = None,
        past: tuple[list[Tensor], list[Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One drafter pass over T pairs.

        Args:
            embeds: (R, T, H) frozen target embeddings of the tokens.
            features: (R, T, Df) target features (`from_target`) or (R, T, H) the drafter's own output.
            positions: (R, T) position ids; mask: (R, T, S) bool over the keys (see DraftAttention).

        Returns:
            the drafter hidden (R, T, H) (EAGLE-1: the predicted next target feature), and this pass's keys/values.
        """
        embeds = embeds.to(self.fc.weight.dtype)
        features = features.to(self.fc.weight.dtype)
        if self.config.architecture == "eagle1":
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
        else:
            hidden = self.fc(features) if from_target else features
        return self.layer(embeds, hidden, positions, mask, cache, past)

    def draft_logits(self, hidden: Tensor, image_head: Callable[[Tensor], Tensor]) -> Tensor:
        """Logits over the drafter's own vocabulary: (R, T, H) -> (R, T, Vd). EAGLE-1 uses the frozen image head."""
        if self.config.architecture == "eagle1":
            return image_head(hidden)
        return self.lm_head(self.norm(hidden))

    def to_image_vocab(self, draft_logits: Tensor) -> Tensor:
        """Scatter draft-vocabulary logits into the image vocabulary: (..., Vd) -> (..., V).

        Tokens outside it get the most negative finite logit, not -inf: where the decoder combines [cond;
        uncond] logits by CFG, u + s (c - u) is NaN for -inf - -inf but stays at that value here (and
        logits guided before the head are scattered after it), and softmax gives them probability 0 either way.
        """
        if self.config.draft_vocab == self.config.vocab_size:
            return draft_logits
        index = torch.arange(self.config.draft_vocab, device=draft_logits.device) + self.d2t  # (Vd,) target ids
        lowest = torch.finfo(draft_logits.dtype).min
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), lowest)
        return full.index_copy(-1, index, draft_logits)

    def unroll(
        self,
        embed: Callable[[Tensor], Tensor],
        features: Tensor,
        tokens: Tensor,
        positions: Tensor,
        valid: Tensor,
        steps: int,
        feature_noise: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Tensor]:
        """The training-time test: `steps` unrolled drafter passes over whole sequences.

        Step k's element t reads token t + k and, for k > 0, its own step k-1 output; it predicts
        token t + k + 1. It attends to step-0 elements <= t and to its own earlier steps
        (`ttt_attention_mask`), at position positions[:, t + k].

        Args:
            embed: the frozen target embedding, (R, T) int64 -> (R, T, H).
            features: (R, T, Df) target features; row t is the feature that predicted token t.
            tokens: (R, T) tokens; positions: (R, T + steps - 1) position ids of token indices 0 .. T + steps - 2.
            valid: (R, T) bool, False for padding.
            feature_noise: applied to the step-0 input features (EAGLE-1's noise); None = none.

        Returns:
            `steps` hidden tensors (R, T, H).
        """
        rows, length = tokens.shape
        if positions.shape[1] < length + steps - 1:
            raise ValueError(f"positions must cover {length + steps - 1} token indices, got {positions.shape[1]}")
        past: tuple[list[Tensor], list[Tensor]] = ([], [])
        hidden = features if feature_noise is None else feature_noise(features)
        outputs = []
        for step in range(steps):
            step_tokens = F.pad(tokens[:, step:], (0, step))  # (R, T): token t + step, 0 past the end
            mask = ttt_attention_mask(valid, step)
            out, k, v = self(
                embed(step_tokens),
                hidden,
                positions[:, step : step + length],
                mask,
                from_target=step == 0,
                past=past,
            )
            past[0].append(k)
            past[1].append(v)
            outputs.append(out)
            hidden = out
        return outputs

    # ------------------------------------------------------------------------- checkpoints

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write `config.json` (the drafter config) and `model.safetensors` (drafter weights only) atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        tmp_weights = folder / f".{WEIGHTS_NAME}.tmp"
        metadata = {"format": "pt", "drafter_config": json.dumps(self.config.to_dict())}
        save_file(state, str(tmp_weights), metadata=metadata)
        tmp_config = folder / f".{CONFIG_NAME}.tmp"
        tmp_config.write_text(json.dumps(self.serving_config(), indent=2) + "\n")
        tmp_weights.replace(folder / WEIGHTS_NAME)
        tmp_config.replace(folder / CONFIG_NAME)
        return folder

    def serving_config(self) -> dict[str, Any]:
        """config.json: the drafter config plus the LlamaConfig fields serving engines read (docs/method.md, section
        "Serving layouts")."""
        config = self.config
        return {
            "architectures": [SERVING_ARCHITECTURE[config.architecture]],
            "model_type": "llama",
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "vocab_size": config.vocab_size,
            "draft_vocab_size": config.draft_vocab,
            "target_hidden_size": config.target_hidden_size,
            "tie_word_embeddings": False,
            "drafter_config": config.to_dict(),
        }

    @classmethod
    def from_pretrained(cls, folder: str | Path, map_location: str | torch.device = "cpu") -> EagleDraftModel:
        """Load a folder written by `save_pretrained`; a missing or unexpected weight is an error naming it."""
        folder = Path(folder)
        config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: a drafter folder holds {CONFIG_NAME} and {WEIGHTS_NAME}")
        values = json.loads(config_path.read_text())
        if "drafter_config" not in values:
            raise ValueError(f"{config_path} has no 'drafter_config' section; was it written by save_pretrained?")
        model = cls(DrafterConfig.from_dict(values["drafter_config"], source=str(config_path)))
        state = load_file(str(weights_path), device=str(map_location))
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"{weights_path}: missing weights {missing}, unexpected weights {unexpected}")
        model.load_state_dict(state)
        return model.to(map_location)


def ttt_attention_mask(valid: Tensor, step: int) -> Tensor:
    """Attention of TTT step `step` over the keys of steps 0 .. step: (R, T) bool -> (R, T, (step + 1) T).

    Block 0 (step-0 keys, the target-fed context): causal, valid keys only. Block i >= 1: the
    diagonal (element t at step i), i.e. the element's own draft ancestors and itself.
    """
    rows, length = valid.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    context = (causal & valid[:, None, :]) | eye  # (R, T, T)
    return torch.cat([context, *[eye.expand(rows, length, length)] * step], dim=-1)


def vocab_map_from_counts(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """EAGLE-3's reduced vocabulary: the `draft_vocab_size` most frequent tokens, in ascending id order.

    Ties (and tokens never seen) are broken by lower id, so the map is deterministic.
    Returns d2t (Vd,) int64 offsets (target id = i + d2t[i]) and t2d (V,) bool.
    """
    vocab = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    order = torch.argsort(-counts.long(), stable=True)  # most frequent first, lower id first among ties
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def count_parameters(module: nn.Module) -> int:
    """Trainable parameters of a module."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
