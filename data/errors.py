"""The errors a dataset folder raises when it cannot be trusted: one family, every message naming the file.

    DatasetError (ValueError)            anything wrong with a dataset folder
    ├── ManifestError                    manifest.json: not JSON, a missing field, a wrong type, a bad path
    │   └── ManifestNotFoundError        no manifest.json (also a FileNotFoundError)
    └── ShardError                       a shard: missing, unreadable, corrupt tar, counts or keys not as listed
        └── SampleError                  one sample of a readable shard: missing member, dtype, shape, NaN/Inf,
                                         token out of range

Every message starts with the path of the file at fault, then names the key and field where there is
one, and says how to fix it where that is not obvious. Callers that only want to know "is the data
usable" catch `DatasetError`; `ValueError` still catches everything, as it did before the family existed.
"""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset folder (its manifest or a shard) that cannot be read as it claims to be."""


class ManifestError(DatasetError):
    """manifest.json is malformed: not JSON, a field missing or of the wrong type, a path outside the folder."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """The folder holds no manifest.json (extraction unfinished, or not a dataset)."""


class ShardError(DatasetError):
    """A shard that cannot be read: missing, corrupt, truncated, or not what the manifest says."""


class SampleError(ShardError):
    """One sample of an otherwise readable shard is malformed (missing member, wrong dtype or shape, bad values)."""
