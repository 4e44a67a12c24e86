"""Evaluating generated images: the resumable evaluation folder, FID / CLIP scoring, its tables, the toy's check.

Imports `inference.decoding` and `models` only.
"""
