"""Prompt sets, feature extraction into WebDataset shards (full or token-only), the manifest and its checks,
verification before training, and the streaming DataModule. The toy world lives in `models/toy/`."""
