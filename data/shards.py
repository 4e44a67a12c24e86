"""The shard format: sample layout, `.npy` members and the writer of extracted features.

The manifest is `data.manifest`, the errors `data.errors` (both re-exported here), reading
`data.shard_reader`, `--validate` `data.validate`.

A dataset is a folder holding `manifest.json` and `shard-NNNNNN.tar` files (docs/architecture.md, section "Shards").
Each shard is a WebDataset tar written with `webdataset.TarWriter`; a sample is one key (its global sample index,
`000000042`) with these members:

    000000042.tokens.npy          (L,) int16/int32   generated image tokens
    000000042.hidden.npy          (L, D) fp16        conditional last-layer post-norm features
    000000042.aux.npy             (L, 3D) fp16       optional EAGLE-3 low, mid, high residual streams
    000000042.uncond_hidden.npy   (L, D) fp16        optional unconditional-row features
    000000042.uncond_aux.npy      (L, 3D) fp16       optional unconditional-row EAGLE-3 streams
    000000042.json                                   index, prompt_id, prompt, seed, length

With `feature_dtype: float8_e4m3fn` each feature member holds (L, width) uint8 e4m3fn codes and is
followed by `<field>_scale.npy`, its (L,) float32 row scales (`000000042.hidden_scale.npy`); the
manifest lists the field with dtype "float8_e4m3fn" and the scale member is implied. Readers
dequantise to float16 (code * scale, `data.fp8`). A quarter of float32's bytes, half of float16's.

`uncond_aux` is written when both the auxiliary streams and the unconditional features are
requested; datasets without it (or without any optional field) stay readable, since readers take the
fields the manifest lists.

Row j of every feature is the state at the position whose logits give image token j (in the
unconditional CFG row for the `uncond_` fields), so the frozen head recomputes token j's logits from
row j; no logits are stored.

Why raw `.npy` and not safetensors or pickle: a `.npy` member is a short header plus the raw array
bytes, so `decode_npy` returns an `np.frombuffer` view of the bytes read from the tar, with no copy
and no unpickling (safe and fastest; docs/architecture.md, section "Shards"); any tool that reads WebDataset (or
`numpy.load`) reads it too, and one array per member keeps a sample's fields independently
selectable. safetensors would add a JSON header per sample for the same zero-copy view.

Reading uses a small ustar reader (`data.shard_reader.iter_tar_members`) instead of tarfile's stream
mode (why: that module's docstring). Every sample the DataModule reads is checked as it is decoded:
members, dtypes, shapes, lengths, NaN/Inf in the features and token ids within the target's image
vocabulary (`manifest.target.image_vocab_size`).

Shapes: L tokens of a sample (G, the image's token count, for every sample of the toy target),
D hidden size.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds

from data.errors import DatasetError, ManifestError, ManifestNotFoundError, SampleError, ShardError
from data.manifest import (
    FEATURE_FIELDS,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    FieldSpec,
    Manifest,
    ShardInfo,
    TargetIdentity,
    field_widths,
    load_manifest,
)
from inference.decoding.files import write_atomic  # the project's one atomic write (host and pid in its temp name)

__all__ = [  # the manifest and the errors live in their own modules; importers of data.shards still find them
    "BLOCK", "FEATURE_FIELDS", "MANIFEST_NAME", "SCHEMA_VERSION", "DatasetError", "FieldSpec", "Manifest",
    "ManifestError", "ManifestNotFoundError", "SampleError", "ShardError", "ShardInfo", "ShardWriter",
    "TargetIdentity", "decode_npy", "encode_npy", "field_widths", "load_manifest", "sample_key", "shard_name",
    "write_atomic",
]  # fmt: skip

BLOCK = 512


def shard_name(index: int) -> str:
    """File name of shard `index`: `shard-000007.tar`."""
    return f"shard-{index:06d}.tar"


def sample_key(index: int) -> str:
    """WebDataset key of global sample `index`: `000000042`."""
    return f"{index:09d}"


# ----------------------------------------------------------------------------- .npy members


def encode_npy(array: np.ndarray) -> bytes:
    """An array as `.npy` bytes (C order, no pickle)."""
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def decode_npy(data: bytes | memoryview) -> np.ndarray:
    """A read-only array viewing the bytes of a `.npy` member (zero-copy; no pickle).

    Raises:
        ValueError: saying what is wrong (bad magic or header, object dtype, size mismatch), for any
            bytes that are not one plain `.npy` array; the caller adds the file, key and field.
    """
    try:
        head = io.BytesIO(bytes(data[:BLOCK]) if len(data) > BLOCK else bytes(data))
        version = np.lib.format.read_magic(head)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(head)
        elif version == (2, 0):
            head = io.BytesIO(bytes(data[: 1 << 16]))
            np.lib.format.read_magic(head)
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(head)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except Exception as error:  # numpy's header parser raises ValueError, SyntaxError, tokenize.TokenError, ...
        raise ValueError(f"not a valid .npy array ({type(error).__name__}: {error})") from None
    if dtype.hasobject:
        raise ValueError("object arrays are not allowed in shards (they would need pickle)")
    if dtype.itemsize == 0 or any(size < 0 for size in shape):
        raise ValueError(f"not a valid .npy array (dtype {dtype}, shape {shape})")
    count = math.prod(shape)
    if head.tell() + count * dtype.itemsize != len(data):
        raise ValueError(
            f"npy member holds {len(data) - head.tell()} data bytes, shape {shape} needs {count * dtype.itemsize}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=head.tell())
    return array.reshape(shape[::-1]).T if fortran_order else array.reshape(shape)


# ----------------------------------------------------------------------------- writing


class _HashingFile:
    """A write-only file wrapper that hashes and counts what goes through it."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self.file, self.sha256, self.num_bytes = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.num_bytes += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class ShardWriter:
    """Writes one shard to `<name>.partial`; `commit` renames it into place.

    Tar headers carry mtime 0, so the same samples always give the same bytes and sha256.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self.partial, "wb")  # truncates a partial file left by a killed run
        self._hashing = _HashingFile(self._file)
        self._tar = wds.TarWriter(self._hashing, encoder=False, mtime=0)
        self.num_samples = 0

    def write(self, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Add one sample: `arrays` maps member names (FEATURE_FIELDS, and `<field>_scale` beside a
        float8_e4m3fn field) to arrays, written as `<name>.npy` in this order; `meta` goes to its json."""
        members: dict[str, Any] = {"__key__": key, "json": json.dumps(meta).encode()}
        members.update({f"{name}.npy": encode_npy(array) for name, array in arrays.items()})
        self._tar.write(members)
        self.num_samples += 1

    def commit(self, first_index: int) -> ShardInfo:
        """Finish the tar, flush it to disk and rename it to its final name."""
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return ShardInfo(
            self.path.name, self.num_samples, self._hashing.sha256.hexdigest(), self._hashing.num_bytes, first_index
        )

    @property
    def num_bytes(self) -> int:
        """Bytes written so far."""
        return self._hashing.num_bytes

    def close(self) -> None:
        """Stop without committing; the .partial file stays (the next writer of this shard truncates it)."""
        self._file.close()
