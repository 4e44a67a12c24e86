"""Meta Chameleon's VQGAN decoder (`models.chameleon_vqgan`) and its use by the Lumina-mGPT target.

- strict loading: taming's key names, enumerated here from taming's `Decoder` construction (not read
  from our module), at tiny widths and, on the meta device, at the full Chameleon size;
- numerical parity with an independent implementation: transformers' `JanusVQVAE` decoder (same
  taming blocks, but `up` stored in processing order, attention always at the deepest level, and an
  l2-normalised codebook lookup), weights mapped by name;
- the row-major code layout and the 16x upsampling of `decode_code`;
- `LuminaTarget(vqgan_path=...)` end to end on the tiny random Chameleon of `test_target_lumina`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_target_lumina import GRID, PROMPTS, build_tiny_lumina

from inference.decoding.autoregressive import generate_ar
from models import registry
from models.chameleon_vqgan import (
    ChameleonVQGANConfig,
    ChameleonVQGANDecoder,
    check_chameleon_vqgan_state_dict,
    load_chameleon_vqgan,
)
from models.lumina import LuminaTarget

transformers = pytest.importorskip("transformers")

TINY = dict(codebook_size=16, embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 2), num_res_blocks=1, resolution=8)
"""A tiny Chameleon-like VQGAN: widths 32 / 64, 2x upsampling, codebook 16 x 8, no level attention."""


# ---------------------------------------------------------------- taming's key names, from the architecture


def conv(name: str, cin: int, cout: int, k: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (cout, cin, k, k), f"{name}.bias": (cout,)}


def norm(name: str, c: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (c,), f"{name}.bias": (c,)}


def resnet(name: str, cin: int, cout: int) -> dict[str, tuple[int, ...]]:
    keys = norm(f"{name}.norm1", cin) | conv(f"{name}.conv1", cin, cout, 3)
    keys |= norm(f"{name}.norm2", cout) | conv(f"{name}.conv2", cout, cout, 3)
    return keys | (conv(f"{name}.nin_shortcut", cin, cout, 1) if cin != cout else {})


def attention(name: str, c: int) -> dict[str, tuple[int, ...]]:
    keys = norm(f"{name}.norm", c)
    for projection in ("q", "k", "v", "proj_out"):
        keys |= conv(f"{name}.{projection}", c, c, 1)
    return keys


def taming_decoder_shapes(
    n_embed: int, embed_dim: int, z: int, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int,
    attn_resolutions: tuple[int, ...] = (), resolution: int = 512, out_ch: int = 3,
) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """Decoder-path keys of taming's `VQModel` (`taming/models/vqgan.py`, `diffusionmodules/model.py`)."""
    levels = len(ch_mult)
    block_in = ch * ch_mult[-1]
    keys = {"quantize.embedding.weight": (n_embed, embed_dim)} | conv("post_quant_conv", embed_dim, z, 1)
    keys |= conv("decoder.conv_in", z, block_in, 3)
    keys |= resnet("decoder.mid.block_1", block_in, block_in) | attention("decoder.mid.attn_1", block_in)
    keys |= resnet("decoder.mid.block_2", block_in, block_in)
    curr_res = resolution // 2 ** (levels - 1)
    for i_level in reversed(range(levels)):  # taming: `self.up.insert(0, up)`, so up.{i_level}
        block_out = ch * ch_mult[i_level]
        for i_block in range(num_res_blocks + 1):
            keys |= resnet(f"decoder.up.{i_level}.block.{i_block}", block_in, block_out)
            block_in = block_out
            if curr_res in attn_resolutions:
                keys |= attention(f"decoder.up.{i_level}.attn.{i_block}", block_in)
        if i_level != 0:
            keys |= conv(f"decoder.up.{i_level}.upsample.conv", block_in, block_in, 3)
            curr_res *= 2
    return keys | norm("decoder.norm_out", block_in) | conv("decoder.conv_out", block_in, out_ch, 3)


def skipped_keys(z: int, embed_dim: int) -> dict[str, tuple[int, ...]]:
    """A few encoder / quant_conv / loss entries, as a Lightning VQGAN checkpoint holds them."""
    keys = conv("encoder.conv_in", 3, 32, 3) | conv("encoder.down.0.block.0.conv1", 32, 32, 3)
    keys |= conv("quant_conv", z, embed_dim, 1)
    keys |= {
        "loss.discriminator.main.0.weight": (64, 3, 4, 4),
        "loss.perceptual_loss.lin0.model.1.weight": (1, 64, 1, 1),
    }
    return keys | {"loss.logvar": ()}


def random_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * 0.2 for name, shape in shapes.items()}


def tiny_shapes() -> dict[str, tuple[int, ...]]:
    return taming_decoder_shapes(16, 8, 32, 32, (1, 2), 1, resolution=8)


# ---------------------------------------------------------------- 1. strict loading


def test_tiny_state_dict_with_the_real_key_names_loads_strictly(tmp_path):
    state = random_state(tiny_shapes() | skipped_keys(32, 8))
    model = ChameleonVQGANDecoder(ChameleonVQGANConfig(**TINY))
    kept = check_chameleon_vqgan_state_dict(state, model)
    assert set(kept) == set(tiny_shapes()) and set(model.state_dict()) == set(tiny_shapes())
    assert "decoder.up.0.upsample.conv.weight" not in kept and "decoder.up.1.upsample.conv.weight" in kept
    assert "decoder.up.0.block.0.nin_shortcut.weight" in kept  # level 0 (width 32) follows level 1 (width 64)
    ckpt = tmp_path / "vqgan.ckpt"  # Lightning layout: weights under "state_dict" next to training metadata
    torch.save({"state_dict": state, "epoch": 3, "global_step": 1000, "pytorch-lightning_version": "1.9"}, ckpt)
    loaded = load_chameleon_vqgan(ckpt, TINY)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    bare = tmp_path / "bare.pt"
    torch.save(state, bare)
    torch.testing.assert_close(load_chameleon_vqgan(bare, TINY).codebook, state["quantize.embedding.weight"])
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "vqgan.safetensors"))
    torch.testing.assert_close(load_chameleon_vqgan(tmp_path / "vqgan.safetensors", TINY).codebook, loaded.codebook)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda s: s.pop("decoder.mid.attn_1.proj_out.weight"), "decoder.mid.attn_1.proj_out.weight"),
        (lambda s: s.update({"decoder.up.0.attn.0.q.weight": torch.zeros(32, 32, 1, 1)}), "decoder.up.0.attn.0.q"),
        (lambda s: s.update({"quantize.used": torch.arange(16)}), "quantize.used"),  # taming remap: not supported
        (lambda s: s.update({"decoder.conv_in.weight": torch.zeros(64, 16, 3, 3)}), "decoder.conv_in.weight (64, 16"),
    ],
    ids=["missing", "unexpected", "remap-buffer", "wrong-shape"],
)
def test_loading_names_the_offending_key(tmp_path, edit, named):
    state = random_state(tiny_shapes() | skipped_keys(32, 8))
    edit(state)
    path = tmp_path / "bad.ckpt"
    torch.save({"state_dict": state}, path)
    with pytest.raises(ValueError, match="does not match") as error:
        load_chameleon_vqgan(path, TINY)
    assert named in str(error.value) and str(path) in str(error.value)


class _Unpicklable:
    pass


def test_a_checkpoint_pickling_objects_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "vqgan.ckpt"
    torch.save({"state_dict": random_state(tiny_shapes()), "hyper_parameters": _Unpicklable()}, path)
    with pytest.raises(ValueError, match="weights_only=True"):
        load_chameleon_vqgan(path, TINY)


def test_full_size_default_has_the_chameleon_layout():
    config = ChameleonVQGANConfig()
    assert (config.codebook_size, config.embed_dim, config.z_channels, config.ch) == (8192, 256, 256, 128)
    assert config.ch_mult == (1, 1, 2, 2, 4) and config.num_res_blocks == 2 and config.attn_resolutions == ()
    assert config.downsample == 16
    with torch.device("meta"):
        model = ChameleonVQGANDecoder()
    ours = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    assert ours == taming_decoder_shapes(8192, 256, 256, 128, (1, 1, 2, 2, 4), 2)
    assert ours["quantize.embedding.weight"] == (8192, 256)
    assert ours["post_quant_conv.weight"] == (256, 256, 1, 1)
    assert ours["decoder.conv_in.weight"] == (512, 256, 3, 3)  # z 256 -> ch * ch_mult[-1] = 512
    assert ours["decoder.up.0.block.0.conv1.weight"] == (128, 128, 3, 3)
    assert ours["decoder.up.4.block.0.conv1.weight"] == (512, 512, 3, 3)
    assert ours["decoder.up.3.block.0.nin_shortcut.weight"] == (256, 512, 1, 1)
    assert ours["decoder.up.1.block.0.nin_shortcut.weight"] == (128, 256, 1, 1)
    assert ours["decoder.conv_out.weight"] == (3, 128, 3, 3)
    assert not any(".attn." in name for name in ours)  # attn_resolutions []: attention in the mid block only
    assert {n.split(".")[2] for n in ours if ".upsample." in n} == {"1", "2", "3", "4"}


def test_config_from_the_release_yaml(tmp_path):
    yaml_text = """model:
  target: taming.models.vqgan.VQModel
  params:
    embed_dim: 256
    n_embed: 8192
    ddconfig:
      double_z: false
      z_channels: 256
      resolution: 512
      in_channels: 3
      out_ch: 3
      ch: 128
      ch_mult: [1, 1, 2, 2, 4]
      num_res_blocks: 2
      attn_resolutions: []
      dropout: 0.0
    lossconfig:
      target: taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator
      params: {disc_start: 0}
"""
    path = tmp_path / "vqgan.yaml"
    path.write_text(yaml_text)
    assert ChameleonVQGANConfig.from_yaml(path) == ChameleonVQGANConfig()
    path.write_text(yaml_text.replace("dropout: 0.0", "dropout: 0.0\n      tanh_out: true"))
    with pytest.raises(ValueError, match="tanh_out"):
        ChameleonVQGANConfig.from_yaml(path)


# ---------------------------------------------------------------- 2. parity with transformers' JanusVQVAE


def janus_vqvae(attention_at_deepest: bool):
    """transformers' JanusVQVAE at the tiny size, random weights (GroupNorm affine too)."""
    config = transformers.JanusVQVAEConfig(
        embed_dim=8, num_embeddings=16, latent_channels=32, base_channels=32, channel_multiplier=[1, 2],
        num_res_blocks=1, num_patches=4, dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    janus = transformers.JanusVQVAE(config).eval().double()  # float64: parity down to rounding, not 1e-5
    if not attention_at_deepest:  # taming with attn_resolutions [] has none; Janus always builds it
        janus.decoder.up[0].attn = torch.nn.ModuleList()
    with torch.no_grad():
        for name, parameter in janus.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2 + (1.0 if "norm" in name and "weight" in name else 0.0))
    return janus


def from_janus(janus, levels: int) -> dict[str, torch.Tensor]:
    """Janus keys -> taming keys: Janus's `up.k` is the k-th level processed, taming's `up.{levels - 1 - k}`."""
    state = {}
    for name, value in janus.state_dict().items():
        if name.startswith("decoder.up."):
            _, _, k, rest = name.split(".", 3)
            name = f"decoder.up.{levels - 1 - int(k)}.{rest}"
        state[name] = value
    return state


@pytest.mark.parametrize("attention_at_deepest", [False, True], ids=["chameleon-no-level-attn", "deepest-level-attn"])
def test_pixels_match_transformers_janus_decoder(attention_at_deepest):
    janus = janus_vqvae(attention_at_deepest)
    # level 1 (the deepest of 2) has resolution 8 / 2 = 4
    config = ChameleonVQGANConfig(**TINY | dict(attn_resolutions=(4,) if attention_at_deepest else ()))
    ours = ChameleonVQGANDecoder(config).eval().double()
    ours.load_state_dict(check_chameleon_vqgan_state_dict(from_janus(janus, 2), ours), strict=True)
    codes = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pixels = ours.decode_code(codes, (4, 4))
        # taming's lookup (raw rows, row-major) through Janus's post_quant_conv + decoder
        raw = janus.quantize.embedding(codes).view(2, 4, 4, 8).permute(0, 3, 1, 2)
        reference = janus.decoder(janus.post_quant_conv(raw))
    assert pixels.shape == (2, 3, 8, 8)
    torch.testing.assert_close(pixels, reference, atol=1e-10, rtol=1e-10)
    # the quantizer difference: Janus's own decode l2-normalises rows, ours does not ...
    with torch.no_grad():
        janus_pixels = janus.decode(codes)
        assert (janus_pixels - pixels).abs().max() > 1e-2
        # ... and they agree once the codebook rows are unit vectors
        ours.quantize.embedding.weight.copy_(torch.nn.functional.normalize(janus.quantize.embedding.weight, dim=-1))
        torch.testing.assert_close(ours.decode_code(codes, (4, 4)), janus_pixels, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------- 3. code layout


def test_decode_code_is_row_major_and_upsamples_16x():
    config = ChameleonVQGANConfig(codebook_size=16, embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 1, 1, 1, 1),
                                  num_res_blocks=0, resolution=32)  # fmt: skip
    torch.manual_seed(0)
    model = ChameleonVQGANDecoder(config).eval().double()  # float64: batch-size rounding differences vanish
    assert model.downsample == 16
    codes = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(2))  # (B, h * w), h 2, w 3
    latents = model.codes_to_latents(codes, (2, 3))
    assert latents.shape == (2, 8, 2, 3)
    for b in range(2):
        for r in range(2):
            for c in range(3):
                assert torch.equal(latents[b, :, r, c], model.codebook[codes[b, r * 3 + c]])
    with torch.no_grad():
        pixels = model.decode_code(codes, (2, 3))
        assert pixels.shape == (2, 3, 32, 48)
        torch.testing.assert_close(model(codes.view(2, 2, 3)), pixels)  # module call: (B, h, w) codes
        torch.testing.assert_close(model.decode_code(codes[1:], (2, 3)), pixels[1:])  # images are independent
    with pytest.raises(ValueError, match="do not fill"):
        model.decode_code(codes, (2, 2))
    with pytest.raises(ValueError, match="codes must lie"):
        model.decode_code(torch.full((1, 4), 16), (2, 2))


# ---------------------------------------------------------------- 4. Lumina-mGPT end to end


@pytest.fixture(scope="module")
def tiny_lumina():
    return build_tiny_lumina()


@pytest.fixture
def vqgan_ckpt(tmp_path):
    path = tmp_path / "vqgan.ckpt"
    torch.save({"state_dict": random_state(tiny_shapes() | skipped_keys(32, 8), seed=3), "epoch": 1}, path)
    return path


def expected_images(vqgan_ckpt, codes: torch.Tensor) -> torch.Tensor:
    """Upstream's `_pil_from_chw_tensor` on `pil_from_img_toks` pixels: clamp, (x + 1) / 2, * 255, uint8."""
    vq = load_chameleon_vqgan(vqgan_ckpt, TINY)
    with torch.no_grad():
        pixels = vq.decode_code(codes.flatten(1), codes.shape[1:])
    return ((pixels.clamp(-1, 1) + 1) / 2 * 255).to(torch.uint8).permute(0, 2, 3, 1)


def test_lumina_decodes_generated_tokens_with_the_vqgan(tiny_lumina, vqgan_ckpt):
    model, tokenizer = tiny_lumina
    target = LuminaTarget(model, tokenizer, grid=GRID, max_prompt_tokens=32, vqgan_path=vqgan_ckpt, vqgan_config=TINY)
    assert target.vq_decoder is None  # loaded on first use
    greedy = dataclasses.replace(target.sampling, temperature=0.0, top_k=None)
    tokens = generate_ar(target, PROMPTS, greedy).tokens  # (2, G): codes with the end-of-line column
    assert tokens.shape == (2, 20) and tokens[:, 4::5].eq(target.eol_index).all()
    images = target.decode_images(tokens)
    assert images.shape == (2, 8, 8, 3) and images.dtype == torch.uint8 and images.device.type == "cpu"
    assert isinstance(target.vq_decoder, ChameleonVQGANDecoder)
    codes = tokens.view(2, GRID[0], GRID[1] + 1)[..., : GRID[1]]
    assert torch.equal(images, expected_images(vqgan_ckpt, codes))
    assert len(images.unique()) > 8  # not a constant image


def test_lumina_from_pretrained_takes_vqgan_path_through_the_registry(tiny_lumina, vqgan_ckpt, tmp_path):
    model, tokenizer = tiny_lumina
    folder = tmp_path / "lumina"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    target = registry.load_target("lumina-mgpt-7b", path=str(folder), device="cpu", grid=GRID, max_prompt_tokens=32,
                                  vqgan_path=vqgan_ckpt, vqgan_config=TINY)  # fmt: skip
    codes = torch.randint(0, 16, (1, *GRID), generator=torch.Generator().manual_seed(4))
    tokens = torch.cat([codes, torch.full((1, GRID[0], 1), target.eol_index)], dim=2).flatten(1)
    assert torch.equal(target.decode_images(tokens), expected_images(vqgan_ckpt, codes))


def test_lumina_without_a_decoder_names_the_option(tiny_lumina, vqgan_ckpt, tmp_path):
    model, tokenizer = tiny_lumina
    bare = LuminaTarget(model, tokenizer, grid=GRID, max_prompt_tokens=32)
    tokens = torch.zeros(1, 20, dtype=torch.long)
    tokens[:, 4::5] = bare.eol_index
    with pytest.raises(NotImplementedError, match="vqgan_path="):
        bare.decode_images(tokens)
    with pytest.raises(FileNotFoundError, match="vqgan_path"):
        LuminaTarget(model, tokenizer, grid=GRID, max_prompt_tokens=32, vqgan_path=tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match="either"):
        LuminaTarget(model, tokenizer, grid=GRID, max_prompt_tokens=32, vqgan_path=vqgan_ckpt, vq_decoder=lambda c: c)
    big = tmp_path / "big.ckpt"  # a 32-code VQGAN does not fit the tiny model's 16 image codes
    torch.save({"state_dict": random_state(taming_decoder_shapes(32, 8, 32, 32, (1, 2), 1, resolution=8))}, big)
    wrong = LuminaTarget(model, tokenizer, grid=GRID, max_prompt_tokens=32, vqgan_path=big,
                         vqgan_config=TINY | dict(codebook_size=32))  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):
        wrong.decode_images(tokens)
