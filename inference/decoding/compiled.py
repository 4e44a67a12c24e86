"""`--compile`: `torch.compile` of the three pieces of a speculative step.

    verifier = compile_decoding(target, drafter)               # mode="reduce-overhead" on a GPU: CUDA graphs
    generate_speculative(target, drafter, prompts, rule, verifier=verifier)

`compile_decoding` compiles, in place, the target's decoder pass (`DecoderTarget.run_decoder`: the
prefill and every forward over a tree) and the drafter's fused step (`EagleDrafter.step`), and returns a
compiled `inference.decoding.verify.verify` for the decode loop to call. Shapes are marked dynamic, so the
growing KV cache and the per-step commit width do not recompile each step; static trees keep the node
count fixed. Sampling stays outside the compiled graphs (its random draws come from the caller's
generator in the same order), so for one seed a compiled decode yields the same tokens as an eager
one (tested on the toy).

On the 2-core CPU machine it speeds up the target's pass (AR 1.55x) and verification (2.3x) but
slows the drafter step, whose eager form is only 57 ops (inductor's guards and graph calls cost more),
so a compiled speculative decode gains less over compiled AR than an eager one over eager AR (docs/decoding.md).
Eager is the default; `--compile` is meant for GPUs, where every eager op is a kernel launch.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from inference.decoding.eagle import EagleDrafter
from inference.decoding.verify import verify
from models.target import DecoderTarget, ImageTarget

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
COMPILED_FLAG = "compiled_decoding"  # set on a target whose decoding `compile_decoding` compiled

Decode = TypeVar("Decode", bound=Callable[..., Any])
_INFERENCE_MODE = contextvars.ContextVar("decodes_in_inference_mode", default=True)


def decoding_mode(decode: Decode) -> Decode:
    """Run a decode function (its first argument the target) under `torch.inference_mode()`, or under
    `torch.no_grad()` where `compile_decoding` compiled that target's decoding.

    Inference mode skips autograd's bookkeeping on every op (version counters, view tracking): the drafter
    step takes about 13 % less time on this 2-core CPU (326 against 375 us, median of 6), and on a GPU the
    host dispatches each launch sooner. Inductor's dynamic shapes cannot trace the inference tensors it
    creates (torch 2.13: "Expected !size_bytes_is_heap_allocated_"), so a compiled decode keeps no_grad,
    as does one inside `decodes_under_no_grad`.
    """

    @functools.wraps(decode)
    def run(target: Any, *args: Any, **kwargs: Any) -> Any:
        inference = _INFERENCE_MODE.get() and not getattr(target, COMPILED_FLAG, False)
        with torch.inference_mode() if inference else torch.no_grad():
            return decode(target, *args, **kwargs)

    return run  # type: ignore[return-value]


@contextlib.contextmanager
def decodes_under_no_grad() -> Iterator[None]:
    """Decodes started in this context run under `torch.no_grad()` instead of inference mode.

    For op counts (`inference.measure.cost`): in inference mode a composite op (`linear`, `rms_norm`,
    `scaled_dot_product_attention`) reaches a `TorchDispatchMode` whole, and is decomposed below it, so a
    count would see one op where the backend runs several (on the toy target's forward, 568 ops against 751).
    Under no_grad the mode sees every op the backend runs, the same in every session.
    """
    token = _INFERENCE_MODE.set(False)
    try:
        yield
    finally:
        _INFERENCE_MODE.reset(token)


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """`--compile [MODE]` (absent: eager), for the CLIs that decode."""
    parser.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=COMPILE_MODES,
        metavar="MODE",
        help="torch.compile the target's decoder pass, the drafter step and verification (MODE: default, "
        "reduce-overhead = CUDA graphs on a GPU, max-autotune); eager when absent",
    )


def compile_decoding(target: ImageTarget, drafter: Any | None = None, mode: str = "default") -> Callable[..., Any]:
    """Compile `target`'s decoder pass and `drafter`'s step in place; return the compiled verification.

    Args:
        target: a `DecoderTarget` (every target here).
        drafter: an `EagleDrafter`, or None to compile the target alone (AR decoding).
        mode: `torch.compile` mode; "reduce-overhead" captures CUDA graphs on a GPU.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if not isinstance(target, DecoderTarget):
        raise TypeError(f"--compile needs a DecoderTarget (one decoder pass per call), got {type(target).__name__}")
    options: dict[str, Any] = {"dynamic": True, "mode": None if mode == "default" else mode}
    target.run_decoder = torch.compile(target.run_decoder, **options)  # type: ignore[method-assign]
    setattr(target, COMPILED_FLAG, True)  # its decodes run under no_grad (`decoding_mode`)
    if drafter is not None:
        if not isinstance(drafter, EagleDrafter):
            raise TypeError(f"--compile compiles an EagleDrafter's step, got {type(drafter).__name__}")
        drafter.compile(**options)
    return torch.compile(verify, **options)
