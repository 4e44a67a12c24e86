"""Two-rank Lightning DDP on CPU over uneven shards, run as a script (in-process DDP re-runs pytest)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_datamodule import write_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_ddp_ranks_see_every_sample_once_per_epoch_with_uneven_shards(tmp_path):
    write_dataset(tmp_path / "ds", [5, 5, 4, 3, 3])  # train: 17 samples in 4 shards (uneven), val: 3 samples
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = REPO / "tests" / "scripts" / "ddp_stream.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ds"), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    orders = []
    for epoch in ("0", "1"):
        batches = [r["train"][epoch] for r in ranks]
        assert len(batches[0]) == len(batches[1]) == 3  # ceil(17 / 2) = 9 rows per rank, batches of 4
        keys = collections.Counter(k for rank in batches for batch in rank for k in batch)
        assert keys.pop("") == 1  # the one padding row that evens the ranks out
        assert sorted(keys) == [f"{i:09d}" for i in range(17)] and set(keys.values()) == {1}
        orders.append([k for batch in batches[0] for k in batch])
        val = collections.Counter(k for r in ranks for batch in r["val"][epoch] for k in batch)
        assert val == {"000000017": 1, "000000018": 1, "000000019": 1, "": 1}
    assert orders[0] != orders[1]  # a new shuffle every epoch
