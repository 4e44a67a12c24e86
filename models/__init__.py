"""Target models behind one interface, drafter heads, VQ tokenizers and checkpoint I/O.

Imports torch, safetensors, numpy (and transformers for the real targets) only: no training stack.
"""
