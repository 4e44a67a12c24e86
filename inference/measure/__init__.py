"""What measures the decoder: benchmarks, per-step op counts and latency, static-tree fitting, results tables.

Imports `inference.decoding` and `models` only.
"""
