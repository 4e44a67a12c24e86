"""Prompt sets, the toy scene generator, feature extraction into shards and the streaming DataModule."""
