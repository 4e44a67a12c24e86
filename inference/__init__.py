"""Decoding with a target and a drafter, what measures it, and how its images are evaluated. Needs `models/` and
torch only (no training stack).

Three parts, with arrows that only point down (tests/test_imports.py checks them):

- `inference.decoding`: the decoder (sampling, draft trees, the drafter, verification rules, the speculative
  loop) and its command-line front (`generate`, `calibrate`, `files`). Imports `models` and itself.
- `inference.measure`: benchmarks, op counts, latency, static-tree fitting, the decoding table. Imports
  `inference.decoding`.
- `inference.evaluation`: generating, scoring and tabulating an evaluation folder; the toy's check. Imports
  `inference.decoding`.

The top-level modules `generate`, `calibrate`, `bench`, `decoding_table`, `tree_fit`, `evaluate` and
`toy_eval` only keep `python -m inference.<name>` working: each calls its subpackage's `main`.
"""
