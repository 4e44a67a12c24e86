"""Throughput of the DataModule iterator against a raw sequential read of the same shard files, and of
this project's tar reader against webdataset's own reader on the same shards.

    python -m inference.data_bench shards/toy         # an extracted dataset
    python -m inference.data_bench --synthetic janus  # Janus-Pro-7B-sized samples, written to a temp dir
    python -m inference.data_bench --synthetic janus --num-shards 8 --samples-per-shard 8 --num-workers 2

Both paths run in the same process on the same files, alternating `--repeats` times after one
untimed pass of each (the raw pass warms the page cache; the loader's warms what training keeps
warm between epochs: its workers and recycled read and batch buffers); the medians are reported. MB/s
counts the shard files' bytes for both paths, so the ratio compares like with like. The synthetic Janus sample is what
Janus-Pro-7B extraction writes: 576 image tokens, 4096-wide fp16 hidden states (4.7 MB) and the
three EAGLE-3 auxiliary streams (14.2 MB).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from data.data_config import DataConfig
from data.datamodule import FeatureDataModule
from data.shard_reader import iter_raw_samples
from data.shards import (
    MANIFEST_NAME,
    FieldSpec,
    Manifest,
    ShardWriter,
    TargetIdentity,
    decode_npy,
    load_manifest,
    sample_key,
    shard_name,
    write_atomic,
)

PROG = "python -m inference.data_bench"

JANUS = TargetIdentity(
    name="janus-pro-7b-synthetic",
    family="janus",
    hidden_size=4096,
    num_layers=30,
    aux_layer_ids=(2, 15, 27),
    image_vocab_size=16384,
    grid=(24, 24),
    prefix_length=0,
)
"""Janus-Pro-7B's dimensions (30 layers, width 4096, 16384 codes, 24x24 tokens); prefix length is per prompt."""


def write_synthetic(
    folder: Path, identity: TargetIdentity, num_shards: int, samples_per_shard: int, seed: int = 0
) -> Manifest:
    """A dataset of random samples with `identity`'s sizes: tokens, hidden and EAGLE-3 aux features."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    num_tokens, width = identity.grid[0] * identity.grid[1], identity.hidden_size
    aux_width = len(identity.aux_layer_ids) * width
    pool = rng.standard_normal(2 * num_tokens * aux_width, dtype=np.float32).astype(np.float16)  # sliced per sample
    manifest = Manifest(
        target=identity,
        sampling={"synthetic": True},
        prompts={"source": "synthetic"},
        fields={
            "tokens": FieldSpec("int16", None),
            "hidden": FieldSpec("float16", width),
            "aux": FieldSpec("float16", aux_width),
        },
        num_tokens=num_tokens,
        samples_per_shard=samples_per_shard,
        num_samples=num_shards * samples_per_shard,
    )
    for shard in range(num_shards):
        writer = ShardWriter(folder / shard_name(shard))
        for index in range(shard * samples_per_shard, (shard + 1) * samples_per_shard):
            start = int(rng.integers(0, num_tokens * aux_width))
            arrays = {
                "tokens": rng.integers(0, identity.image_vocab_size, num_tokens).astype(np.int16),
                "hidden": pool[start : start + num_tokens * width].reshape(num_tokens, width),  # (G, D)
                "aux": pool[start : start + num_tokens * aux_width].reshape(num_tokens, aux_width),  # (G, 3D)
            }
            writer.write(
                sample_key(index),
                arrays,
                {
                    "index": index,
                    "prompt_id": f"synthetic:{index}",
                    "prompt": "synthetic",
                    "seed": seed,
                    "length": num_tokens,
                },
            )
        manifest.shards.append(writer.commit(first_index=shard * samples_per_shard))
    write_atomic(folder / MANIFEST_NAME, manifest.to_json())
    return manifest


def time_raw_read(paths: list[Path], chunk_bytes: int = 16 << 20) -> float:
    """Seconds to read the files start to end into one reused buffer."""
    buffer = bytearray(chunk_bytes)
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
    return time.perf_counter() - started


def time_project_reader(paths: list[Path]) -> tuple[float, int]:
    """Seconds for this project's tar reader to yield every sample of `paths` with its arrays decoded, and the count."""
    started, samples = time.perf_counter(), 0
    for path in paths:
        for raw in iter_raw_samples(path):
            for name, data in raw.items():
                if name.endswith(".npy"):
                    decode_npy(data)  # (L,) or (L, width), a view of the read bytes
            samples += 1
    return time.perf_counter() - started, samples


def time_webdataset_reader(paths: list[Path]) -> tuple[float, int]:
    """Seconds for webdataset's own reader (`WebDataset(...).decode()`) to yield the same samples, and the count."""
    import webdataset as wds

    started, samples = time.perf_counter(), 0
    dataset = wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False).decode()
    for sample in dataset:
        for name, value in sample.items():
            if name.endswith(".npy") and not isinstance(value, np.ndarray):
                raise RuntimeError(f"webdataset decoded {name} as {type(value).__name__}, not an array")
        samples += 1
    return time.perf_counter() - started, samples


def compare_readers(folder: Path, repeats: int) -> dict[str, float]:
    """This project's tar reader against webdataset's on the same shards, alternating runs; medians in seconds."""
    manifest = load_manifest(folder)
    paths = [folder / s.name for s in manifest.shards]
    time_project_reader(paths), time_webdataset_reader(paths)  # warm the page cache and imports
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repeats):
        for reader, times in ((time_project_reader, ours), (time_webdataset_reader, theirs)):
            seconds, samples = reader(paths)
            if samples != manifest.num_samples:
                raise RuntimeError(
                    f"{reader.__name__} read {samples} samples, the manifest lists {manifest.num_samples}"
                )
            times.append(seconds)
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    return {
        "project_samples_per_s": manifest.num_samples / ours_s,
        "webdataset_samples_per_s": manifest.num_samples / theirs_s,
        "speedup": theirs_s / ours_s,
    }


def build_loader(folder: Path, manifest: Manifest, batch_size: int, num_workers: int) -> DataLoader:
    """The DataModule's train loader over every shard of `folder`."""
    config = DataConfig(
        train_dir=str(folder),
        batch_size=batch_size,
        num_workers=num_workers,
        load_aux="aux" in manifest.fields,
        load_uncond="uncond_hidden" in manifest.fields,
    )
    datamodule = FeatureDataModule(config, target=manifest.target)  # benchmarking: accept the dataset's own target
    datamodule.setup("fit")
    return datamodule.train_dataloader()


def time_epoch(loader: DataLoader) -> tuple[float, int]:
    """Seconds for one epoch of `loader`, and the real (unpadded) samples it yielded."""
    started, samples = time.perf_counter(), 0
    for batch in loader:
        samples += int(batch["sample_mask"].sum())
    return time.perf_counter() - started, samples


def run_bench(folder: Path, batch_size: int, num_workers: int, repeats: int) -> dict[str, float]:
    """Raw and DataModule throughput of a dataset folder, alternating runs; medians."""
    manifest = load_manifest(folder)
    paths = [folder / s.name for s in manifest.shards]
    total_bytes = sum(p.stat().st_size for p in paths)
    loader = build_loader(folder, manifest, batch_size, num_workers)
    time_raw_read(paths)  # warm the page cache
    time_epoch(loader)  # warm the loader, as in training: workers started, read buffers mapped
    raw, epochs = [], []
    for _ in range(repeats):
        raw.append(time_raw_read(paths))
        seconds, samples = time_epoch(loader)
        if samples != manifest.num_samples:
            raise RuntimeError(f"the DataModule yielded {samples} samples, the manifest lists {manifest.num_samples}")
        epochs.append(seconds)
    raw_s, loader_s = statistics.median(raw), statistics.median(epochs)
    return {
        "samples": manifest.num_samples,
        "megabytes": total_bytes / 1e6,
        "raw_samples_per_s": manifest.num_samples / raw_s,
        "raw_mb_per_s": total_bytes / 1e6 / raw_s,
        "loader_samples_per_s": manifest.num_samples / loader_s,
        "loader_mb_per_s": total_bytes / 1e6 / loader_s,
        "ratio": raw_s / loader_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir", type=Path, nargs="?", help="dataset folder (manifest.json + shards)")
    parser.add_argument("--synthetic", choices=["janus"], help="write and bench a synthetic dataset instead")
    parser.add_argument("--out", type=Path, help="--synthetic: where to write it (default: a temp dir, removed after)")
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--samples-per-shard", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if (args.dir is None) == (args.synthetic is None):
        parser.error("give a dataset DIR or --synthetic janus (not both)")
    folder, cleanup = args.dir, False
    if args.synthetic:
        folder = args.out or Path(tempfile.mkdtemp(prefix="bench-janus-"))
        cleanup = args.out is None
        started = time.perf_counter()
        write_synthetic(folder, JANUS, args.num_shards, args.samples_per_shard)
        print(
            f"wrote {args.num_shards * args.samples_per_shard} synthetic Janus samples to {folder} "
            f"in {time.perf_counter() - started:.1f} s"
        )
    try:
        result = run_bench(folder, args.batch_size, args.num_workers, args.repeats)
        readers = compare_readers(folder, args.repeats)
    finally:
        if cleanup:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"{result['samples']} samples, {result['megabytes']:.1f} MB, batch {args.batch_size}, "
        f"{args.num_workers} workers, median of {args.repeats}"
    )
    print(f"raw sequential read: {result['raw_samples_per_s']:9.1f} samples/s {result['raw_mb_per_s']:9.1f} MB/s")
    print(f"DataModule iterator: {result['loader_samples_per_s']:9.1f} samples/s {result['loader_mb_per_s']:9.1f} MB/s")
    print(f"ratio (DataModule / raw): {result['ratio']:.3f}")
    print(f"tar reader, this project's: {readers['project_samples_per_s']:9.1f} samples/s (arrays decoded)")
    print(f"tar reader, webdataset's:   {readers['webdataset_samples_per_s']:9.1f} samples/s (.decode())")
    print(f"this project's reader is {readers['speedup']:.2f}x webdataset's (kept only while >= 1.5x)")


if __name__ == "__main__":
    main()
