"""Sampling, the generation loop and the generate/benchmark command lines. Needs `models/` and torch only."""
