"""Shared fixtures: tiny random models built in memory, and test hygiene (default dtype, seeds; `gpu` tests skipped
without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():  # on a GPU host DeepSpeed keeps its CUDA accelerator for the `gpu` tests
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from models.llamagen import LlamaGenConfig  # noqa: E402
from models.target import SamplingDefaults  # noqa: E402
from models.toy.model import CaptionEncoderConfig, ToyTextToImage  # noqa: E402
from models.toy.target import ToyTarget  # noqa: E402
from models.toy.vq import PatchVQ  # noqa: E402
from models.toy.world import MAX_CAPTION_WORDS, PATCH_SIZE  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every `@pytest.mark.gpu` test, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    built = torch.version.cuda or "no CUDA"
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
                                   f"built with {built})")  # fmt: skip
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype = torch.get_default_dtype()
    torch.set_num_threads(1)  # tiny models run fastest on one thread; two stall on a busy 2-core machine
    yield
    torch.set_default_dtype(dtype)


def build_tiny_toy_target(seed: int = 0, grid: int = 4, vocab: int = 64) -> ToyTarget:
    """A random toy target with the real structure at a tiny size (2 layers, width 32, grid 4x4)."""
    torch.manual_seed(seed)
    encoder = CaptionEncoderConfig(dim=32, num_layers=1, num_heads=2)
    gpt = LlamaGenConfig(
        dim=32, num_layers=4, num_heads=2, multiple_of=32, vocab_size=vocab, caption_dim=32,
        cls_token_num=MAX_CAPTION_WORDS, grid_size=grid, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    network = ToyTextToImage(encoder, gpt)
    for parameter in network.parameters():  # larger weights than the init, so outputs differ clearly
        parameter.data.normal_(0, 0.15)
    vq = PatchVQ(num_codes=vocab, patch=PATCH_SIZE, image_size=PATCH_SIZE * grid)
    vq.codebook.uniform_(0, 1)
    # top-k 5 of the 64 codes: a sharp enough target that a briefly trained drafter gets drafts accepted
    sampling = SamplingDefaults(cfg_scale=2.0, temperature=1.0, top_k=5, top_p=None)
    return ToyTarget(network, vq, name="tiny-toy", sampling=sampling)


@pytest.fixture
def tiny_target() -> ToyTarget:
    return build_tiny_toy_target()


# Tree-mask checks shared by the real-target tests: node lists given as parent indices.


def tree_mask_of(parents: list[int]) -> torch.Tensor:
    """(N, N) bool: node n attends to itself and its ancestors (parents[n] = -1 for a root)."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask


def depths_of(parents: list[int]) -> torch.Tensor:
    """(N,) depth of each node, roots at 0."""
    depth: list[int] = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return torch.tensor(depth)


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root down to `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def prefilled(target, prompts: list[str], committed: torch.Tensor, extra: int):
    """A cache holding the CFG prefix of `prompts` and the committed tokens (B, n), with room for `extra` more."""
    conditioning = target.condition(prompts, cfg=True)
    cache = target.allocate_cache(conditioning.rows, target.prefix_length + committed.shape[1] + extra)
    target.prefill(conditioning, cache)
    if committed.shape[1]:
        target.forward(committed, target.image_positions(torch.arange(committed.shape[1])), cache)
    return cache


def assert_chunked_cache_matches_full_forward(target, full_forward, prompts: list[str], tokens: torch.Tensor,
                                              aux_layer_ids: tuple[int, ...], hidden_size: int) -> None:  # fmt: skip
    """Prefill, then 7 image tokens in chunks of 1, 3, 1 and 2 through the KV cache, must equal one uncached
    reference pass `full_forward(target, prefix_embeds, prefix_valid, tokens) -> (logits, hidden, hidden_states)`
    in logits, hidden and aux streams (padded prefix slots excluded)."""
    conditioning = target.condition(prompts, cfg=True)
    rows = conditioning.rows
    cache = target.allocate_cache(rows, target.prefix_length + 8)
    outputs = [target.prefill(conditioning, cache, return_aux=True)]
    for start, end in [(0, 1), (1, 4), (4, 5), (5, 7)]:
        positions = target.image_positions(torch.arange(start, end))
        outputs.append(target.forward(tokens[:, start:end], positions, cache, return_aux=True))
    logits, hidden, streams = full_forward(target, conditioning.inputs_embeds, conditioning.valid, tokens)
    keep = torch.cat([conditioning.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)  # padded slots: any
    got_logits = torch.cat([o.logits for o in outputs], dim=1)
    got_hidden = torch.cat([o.hidden for o in outputs], dim=1)
    got_aux = torch.cat([o.aux for o in outputs], dim=1)
    torch.testing.assert_close(got_logits[keep], logits[keep], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_hidden[keep], hidden[keep], atol=2e-5, rtol=1e-4)
    want_aux = torch.cat([streams[i] for i in aux_layer_ids], dim=-1)  # transformers' hidden_states[i]
    assert got_aux.shape == (rows, target.prefix_length + 7, 3 * hidden_size)
    torch.testing.assert_close(got_aux[keep], want_aux[keep], atol=2e-5, rtol=1e-4)
    assert cache.length == target.prefix_length + 7
