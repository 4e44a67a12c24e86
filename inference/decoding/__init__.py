"""The decoder: sampling, draft trees, the drafter, verification rules and the speculative decoding loop.

Also the command-line front of it (`generate`: rules and trees from options, and the generate CLI), CASCADE's
threshold calibration it reads (`calibrate`) and the atomic file writes every part of `inference` uses
(`files`). Imports `models` and itself only.
"""
