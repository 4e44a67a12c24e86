"""Extract features of the tiny random toy target: the subprocess half of the extraction tests.

    python tests/scripts/extract_tiny.py OUT_DIR [--count 12] [--kill-after-writes N]
    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/extract_tiny.py OUT_DIR

`--kill-after-writes N` sends this process SIGKILL right after the N-th sample written in this run,
so the run dies the way `kill -9` kills it: mid-shard, with a `.partial` file left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny target

import torch  # noqa: E402
from conftest import build_tiny_toy_target  # noqa: E402

from data import shards  # noqa: E402
from data.extract import ExtractConfig, run_extraction  # noqa: E402
from data.prompts import PromptSetConfig  # noqa: E402


def tiny_config(out_dir: str, count: int) -> ExtractConfig:
    return ExtractConfig(out_dir=out_dir, prompts=PromptSetConfig(source="toy", count=count), samples_per_shard=4,
                         batch_size=2, seed=7, store_aux=True, store_uncond=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--kill-after-writes", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_after_writes:
        write, writes = shards.ShardWriter.write, []

        def write_then_maybe_die(self, *a, **k):
            write(self, *a, **k)
            writes.append(1)
            if len(writes) == args.kill_after_writes:
                os.kill(os.getpid(), signal.SIGKILL)

        shards.ShardWriter.write = write_then_maybe_die
    run_extraction(tiny_config(args.out_dir, args.count), target=build_tiny_toy_target(), progress=False)


if __name__ == "__main__":
    main()
