"""Targets with random weights at their real size (or a tiny one), built without downloading anything.

    target = random_target("janus-pro-7b", size="real", device="cuda", dtype=torch.bfloat16)

A latency check only needs the architecture: the real-size models below have the layer counts,
widths, head counts and vocabularies of the released checkpoints (their `config.json` files), random weights
(transformers' own initialisation), and a stand-in word-level tokenizer, because the real
tokenizers are downloads too. Latency does not depend on weight values or token identities; the
images such a target draws are noise. `size="tiny"` builds the same classes at a few layers of
width 32, which is what the CPU tests run.

- `janus-pro-7b`: `JanusForConditionalGeneration`, DeepSeek-LLM-7B language model (30 layers, width
  4096, 32 heads, MLP 11008, 102400 text ids), SigLIP-L vision tower at transformers' defaults,
  VQ-16 (16384 x 8 codes, 24 x 24 latent grid = 576 image tokens, 384 px).
- `lumina-mgpt-7b`: `ChameleonForConditionalGeneration` at transformers' `ChameleonConfig` defaults
  (Chameleon-7B: 32 layers, width 4096, 32 heads, MLP 11008, 65536 ids, QK-norm), 8192 image codes,
  a 48 x 48 code grid (768 px). Its vocabulary map is synthetic: it names the 8192 `IMGIMG` codes and
  the layout tokens Lumina needs, at ids that are not the released ones.
- `llamagen-xl`: our LlamaGen t2i GPT-XL (36 layers, width 1280, 20 heads, 16384 codes, 120 caption
  slots, 32 x 32 grid) and VQ-16 decoder; the caption encoder is a one-layer T5 of FLAN-T5-XL's
  width (2048) instead of the 24-layer one (it runs once per prompt, outside the decoding loop).

`random_drafter_model(target, "janus-pro-7b")` builds the EAGLE drafter head of a preset
(`models.eagle.drafter_preset`) for such a target, with random weights, directly on its device in its dtype.

Shapes: K image codes, D hidden size.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, Literal

import torch

from models.eagle import EagleDraftModel, drafter_preset
from models.target import DecoderTarget, ImageTarget
from models.transformers_decoder import placement

Size = Literal["real", "tiny"]
STAND_IN_WORDS = tuple(
    "a an the of in on at with and under over near by photo image picture painting drawing of red green blue "
    "yellow white black small big large cat dog fox house tree car sky snow night city street portrait".split()
)
"""Words the stand-in tokenizers know; any other word becomes the unknown token."""


def stand_in_tokenizer(specials: dict[str, int], words: dict[str, int], bos: str, eos: str, pad: str, unk: str) -> Any:
    """A word-level transformers tokenizer over `specials` and `words` (token -> id), for prompts of random targets."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {**specials, **words}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = [name for name in specials if name not in (bos, eos, pad, unk)]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
        additional_special_tokens=extra,
    )  # fmt: skip


def _word_ids(first_id: int) -> dict[str, int]:
    words = sorted(set(STAND_IN_WORDS) | set(string.punctuation))
    return {word: first_id + i for i, word in enumerate(words)}


def _build(constructor: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype,
           seed: int) -> Any:  # fmt: skip
    """Construct a module directly on `device` with `dtype` parameters (transformers' own init runs there, no fp32
    copy of the weights). Buffers a module makes in float32 on purpose (rotary frequencies) stay float32, as
    `from_pretrained` keeps them. Seeds torch's global generator with `seed`."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = constructor()
    finally:
        torch.set_default_dtype(previous)
    for parameter in module.parameters():  # any parameter a constructor made in another float type
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    return module.eval()


def _random_janus(size: Size, device: torch.device, dtype: torch.dtype, seed: int) -> DecoderTarget:
    import transformers

    from models.janus import JanusTarget

    text: dict[str, Any]
    vq: dict[str, Any]
    if size == "real":
        width, text = 4096, dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
                                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                 rms_norm_eps=1e-6)  # fmt: skip
        vision: dict[str, Any] = dict(projection_dim=width)  # SigLIP-L/16-384 = transformers' defaults
        vq = dict(num_patches=24, projection_dim=width, image_token_embed_dim=width)  # VQ-16 = the defaults
        prompt_slots = 128
    else:
        width, text = 32, dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
                      projection_dim=width, num_image_tokens=16, mlp_ratio=2.0)  # fmt: skip
        vq = dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32, channel_multiplier=[1, 2],
                  num_res_blocks=1, projection_dim=width, image_token_embed_dim=width, num_patches=4)  # fmt: skip
        prompt_slots = 64  # room for the toy world's longest captions
    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<begin_of_image>", "<|User|>", "<|Assistant|>"]
    tokenizer = stand_in_tokenizer(
        {name: i for i, name in enumerate(specials)}, _word_ids(len(specials)), "<bos>", "<eos>", "<pad>", "<unk>"
    )
    config = transformers.JanusConfig(text_config=dict(model_type="llama", **text), vision_config=vision,
                                      vq_config=vq, image_token_id=len(specials) - 1)  # fmt: skip
    text_config: Any = config.text_config
    text_config._attn_implementation = "sdpa"
    model = _build(lambda: transformers.JanusForConditionalGeneration(config), device, dtype, seed)
    return JanusTarget(model, tokenizer, name=f"janus-pro-7b (random {size})", max_prompt_tokens=prompt_slots)


def chameleon_vocabulary(num_codes: int, grid: tuple[int, int]) -> dict[str, int]:
    """A synthetic Chameleon vocabulary map: specials, K `IMGIMG` codes (ids 4 .. K+3), then the layout tokens.

    The code names follow Chameleon's scheme (digits written as letters A-J, then Z); the layout
    tokens (`<eoss>`, `<racm3:break>`, `<image>`, the turn end, end-of-line and the two size tokens of
    `grid`) follow at consecutive ids, which are not the released ones.
    """
    from models.lumina_layout import END_OF_LINE, END_OF_TURN, IMAGE_END, IMAGE_START, SIZE_PATCH_CODES, SIZE_TOKEN

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for code in range(num_codes):
        vocab["IMGIMG" + "".join(chr(ord("A") + int(digit)) for digit in str(code)) + "Z"] = 4 + code
    sizes = {SIZE_TOKEN.format(8800 + n // SIZE_PATCH_CODES) for n in grid}
    for name in [IMAGE_END, IMAGE_START, "<image>", END_OF_TURN, END_OF_LINE, *sorted(sizes)]:
        vocab[name] = len(vocab)
    return vocab


def _random_lumina(size: Size, device: torch.device, dtype: torch.dtype, seed: int) -> DecoderTarget:
    import transformers

    from models.lumina import LuminaTarget

    if size == "real":
        codes, grid, prompt_slots = 8192, (48, 48), 160
        shape: dict[str, Any] = {}  # Chameleon-7B = transformers' ChameleonConfig defaults
        vq_config: dict[str, Any] = {}
    else:
        codes, grid, prompt_slots = 16, (4, 4), 64
        shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
        vq_config = dict(embed_dim=8, num_embeddings=codes, latent_channels=8, resolution=8, base_channels=32,
                         channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[])  # fmt: skip
    vocab = chameleon_vocabulary(codes, grid)
    words = _word_ids(len(vocab))
    vocab_size = shape.get("vocab_size", 65536)
    if len(vocab) + len(words) > vocab_size:
        raise ValueError(f"the synthetic vocabulary needs {len(vocab) + len(words)} ids, more than {vocab_size}")
    options: dict[str, Any] = dict(vocabulary_map=vocab, bos_token_id=1, pad_token_id=0, eos_token_id=2,
                                   vq_config=vq_config, attn_implementation="sdpa")  # fmt: skip
    config = transformers.ChameleonConfig(**shape, **options)
    model = _build(lambda: transformers.ChameleonForConditionalGeneration(config), device, dtype, seed)
    specials = {name: i for name, i in vocab.items() if not name.startswith("IMGIMG")}
    tokenizer = stand_in_tokenizer(specials, words, "<s>", "</s>", "<pad>", "<unk>")
    return LuminaTarget(model, tokenizer, name=f"lumina-mgpt-7b (random {size})", grid=grid,
                        max_prompt_tokens=prompt_slots)  # fmt: skip


def _random_llamagen(size: Size, device: torch.device, dtype: torch.dtype, seed: int) -> DecoderTarget:
    import transformers

    from models.llamagen import LLAMAGEN_PRESETS, LlamaGenConfig, LlamaGenTransformer
    from models.llamagen_t2i import LlamaGenT2ITarget
    from models.vq16 import VQ16Config, VQ16Decoder

    t5: dict[str, Any]
    if size == "real":
        gpt_config = LLAMAGEN_PRESETS["t2i-XL-stage2"]
        vq_config = VQ16Config()
        t5 = dict(d_model=gpt_config.caption_dim, d_kv=64, d_ff=5120, num_layers=1, num_heads=32)
    else:
        gpt_config = LlamaGenConfig(dim=32, num_layers=4, num_heads=4, vocab_size=64, caption_dim=16, cls_token_num=32,
                                    grid_size=4)  # fmt: skip
        vq_config = VQ16Config(codebook_size=64, z_channels=32, ch=32, ch_mult=(1, 2), num_res_blocks=1)
        t5 = dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    specials = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    words = _word_ids(len(specials))
    tokenizer = stand_in_tokenizer(specials, words, "</s>", "</s>", "<pad>", "<unk>")
    tokenizer.model_max_length = gpt_config.cls_token_num
    t5_config = transformers.T5Config(vocab_size=len(specials) + len(words), feed_forward_proj="gated-gelu", **t5)
    gpt = _build(lambda: LlamaGenTransformer(gpt_config), device, dtype, seed)
    vq = _build(lambda: VQ16Decoder(vq_config), device, dtype, seed + 1)
    text_encoder = _build(lambda: transformers.T5EncoderModel(t5_config), device, dtype, seed + 2)
    return LlamaGenT2ITarget(gpt, vq, text_encoder, tokenizer, name=f"llamagen-xl (random {size})")


RANDOM_BUILDERS: dict[str, Callable[[Size, torch.device, torch.dtype, int], DecoderTarget]] = {
    "janus-pro-7b": _random_janus,
    "lumina-mgpt-7b": _random_lumina,
    "llamagen-xl": _random_llamagen,
}


def random_target(
    name: str,
    size: Size = "real",
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> DecoderTarget:
    """The target `name` with random weights: the released architecture (`size="real"`) or a tiny one.

    dtype None = bfloat16 on GPU, float32 on CPU; device None = the CPU, never a GPU unasked (a trainer passes
    its root device through `models.registry.shared_target`, a script `process_device()` or `--device`).
    """
    if name not in RANDOM_BUILDERS:
        raise ValueError(f"no random-weight architecture for target {name!r}; known: {', '.join(RANDOM_BUILDERS)}")
    if size not in ("real", "tiny"):
        raise ValueError(f"size must be 'real' or 'tiny', got {size!r}")
    resolved_device, resolved_dtype = placement(device, dtype)
    return RANDOM_BUILDERS[name](size, resolved_device, resolved_dtype, seed)


def random_drafter_model(
    target: ImageTarget, preset: str, architecture: str = "eagle3", seed: int = 0
) -> EagleDraftModel:
    """An EAGLE-1/EAGLE-3 head of the drafter preset `preset` with random weights, fitted to `target`.

    The preset gives the drafter layer's shape (width, heads, MLP); the image vocabulary, the target's
    hidden size and its number of EAGLE-3 streams come from `target`. Built on the target's device in the
    dtype of its image head (Normal(0, 0.02) linears, as `EagleDraftModel.reset_parameters`).

    Raises:
        ValueError: for an unknown preset or architecture.
    """
    config = drafter_preset(
        preset,
        architecture,
        vocab_size=target.image_vocab_size,
        target_hidden_size=target.hidden_size,
        num_aux_layers=len(target.aux_layer_ids),
        target=target.name,
    )
    weight = target.image_head_weight()
    model: EagleDraftModel = _build(lambda: EagleDraftModel(config), weight.device, weight.dtype, seed)
    return model
