"""`--compile` (`inference.decoding.compiled`): a compiled decode draws the same tokens as an eager one for one seed.

The toy target and drafter are compiled by inductor on the CPU (about a minute on two cores: the
prefill, the tree forward, the drafter's context and tree-level calls and verification each compile
once or twice for their shapes).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_toy_target
from test_drafter_models import tiny_drafter

from inference.decoding.compiled import compile_decoding
from inference.decoding.eagle import EagleDrafter
from inference.decoding.rules import CascadeRule, ExactRule
from inference.decoding.speculative import DecoderConfig, generate_speculative

PROMPT = "a small red circle at the top left on a plain blue background"


def test_compiled_decoding_draws_the_same_tokens_as_eager():
    target = build_tiny_toy_target()
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), target)
    config = DecoderConfig()  # the default static tree
    rules = {"exact": ExactRule(), "cascade": CascadeRule(tau_pos=0.3, tau_seq=0.2)}

    def decode(rule, verifier=None):
        options = {} if verifier is None else {"verifier": verifier}
        generator = torch.Generator().manual_seed(3)
        return generate_speculative(target, drafter, [PROMPT], rule, config, None, generator, **options)

    eager = {name: decode(rule) for name, rule in rules.items()}
    verifier = compile_decoding(target, drafter)
    assert verifier is not None and drafter._run_step != drafter.step.run  # the step now runs compiled
    for name, rule in rules.items():
        compiled = decode(rule, verifier)
        assert torch.equal(compiled.tokens, eager[name].tokens), name
        assert torch.equal(compiled.accepted, eager[name].accepted), name
        assert compiled.tau == eager[name].tau > 1.0


def test_compile_refuses_an_unknown_mode_naming_the_accepted_ones():
    target = build_tiny_toy_target()
    with pytest.raises(ValueError, match="compile mode must be one of default, reduce-overhead, max-autotune"):
        compile_decoding(target, None, "fast")
