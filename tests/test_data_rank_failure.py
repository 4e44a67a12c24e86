"""A dataset error on one rank ends every rank of a fit, with one message and exit code 2.

Two `python -m training.fit` processes form a 2-rank gloo job as `srun` starts one (each is given LOCAL_RANK,
NODE_RANK, WORLD_SIZE and the master's address, so Lightning launches nothing itself, and each has its own
exit code). Rank 1's data.train_dir is a damaged copy of rank 0's: only rank 1 can see the damage: shards
that fail their sha256 (found by the shared hashing in setup), a missing manifest (found by rank 1 alone in
setup), or NaN features in a shard whose manifest entry was updated to match (found only as rank 1 reads its
first training batch). Without the agreement (`data.drafter_data.RankAgreement`) rank 1 would exit 2 and
rank 0 would wait at Lightning's next barrier, or in the step's gradient all-reduce, until the process-group
timeout (30 minutes); with it both stop within seconds of each other.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_damage import Sample, rewrite_shard
from test_data_verify import flip_feature_byte
from test_training_fit import tiny_dataset, tiny_run_config  # noqa: F401 (a module fixture)

from data.verify import STAMP_NAME

REPO = Path(__file__).resolve().parents[1]


def poison_every_sample(samples: list[Sample]) -> list[Sample]:
    for _, arrays, _ in samples:
        arrays["hidden"][0, 0] = np.nan
    return samples


DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("shards", "ranks 0, 1 of 2: ShardError: 1 shard(s) failed verification"),  # gathered by the hashing
        ("manifest", "rank 1 of 2: ManifestNotFoundError: "),  # rank 1 alone fails: agree_on_failure spreads it
        ("sample", "rank 1 of 2: SampleError: "),  # hashes right, fails as it is read: the batch agreement
    ],
)
def test_damage_only_rank_1_sees_ends_both_ranks_with_exit_2_and_one_message(
    tiny_dataset: Path,  # noqa: F811
    tmp_path: Path,
    damage: str,
    expected: str,
) -> None:
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    for folder in (clean, damaged):
        shutil.copytree(tiny_dataset, folder)
        (folder / STAMP_NAME).unlink(missing_ok=True)
    if damage == "manifest":
        (damaged / "manifest.json").unlink()
    if damage == "sample":  # NaN features in every training sample (shard 0; shard 1 validates), sha256 updated
        rewrite_shard(damaged, 0, poison_every_sample)
    else:
        for index, shard in enumerate(sorted(damaged.glob("shard-*.tar"))):  # all: whichever share rank 1 hashes
            flip_feature_byte(shard, key=f"{4 * index:09d}")  # the first sample of each shard of 4
    config = tiny_run_config(tmp_path, clean)
    port = free_port()
    processes = []
    for rank, train_dir in ((0, clean), (1, damaged)):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "NODE_RANK": "0",
            "LOCAL_RANK": str(rank),
        }
        command = [sys.executable, "-m", "training.fit", "--config", str(config), "--trainer.devices", "2",
                   "--trainer.strategy", "ddp", "--data.train_dir", str(train_dir)]  # fmt: skip
        processes.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs, ended = [], []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=300))
            ended.append(time.monotonic())
    finally:
        for process in processes:
            process.kill()
    codes = [process.returncode for process in processes]
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, err in outputs]
    assert codes == [2, 2], f"exit codes {codes}:\n" + "\n".join(err[-3000:] for _, err in outputs)
    assert errors[0] and errors[0] == errors[1], errors
    message = outputs[0][1]
    assert expected in message and str(damaged) in message
    assert str(clean) not in message  # rank 0's copy is clean
    assert abs(ended[1] - ended[0]) < DEADLINE_S
    if damage != "sample":
        assert not list(tmp_path.rglob("*.ckpt"))  # nothing trained (a SampleError stops the first step)
