"""`python -m inference.data_bench`: the DataModule against a raw read, and this project's tar reader against
webdataset's."""

from __future__ import annotations

import dataclasses
import time

import inference.measure.pipeline.data_bench as bench
from inference.measure.pipeline.data_bench import JANUS, compare_readers, main, write_synthetic

TINY = dataclasses.replace(JANUS, name="tiny-synthetic", hidden_size=8, grid=(4, 4), image_vocab_size=32)

PLANTED_SECONDS = 0.01
"""A sleep planted into every array this project's reader decodes: far above decoding a tiny array (microseconds)."""


def test_the_reader_comparison_measures_a_slowdown_planted_into_the_project_reader(tmp_path, monkeypatch):
    """Both readers must yield every sample (compare_readers raises otherwise). A sleep planted into the project
    reader's array decoding must lower its throughput to at most samples / (arrays x sleep) and turn the printed
    speedup over webdataset's reader below 1, while webdataset's throughput is untouched."""
    write_synthetic(tmp_path, TINY, num_shards=2, samples_per_shard=3)
    clean = compare_readers(tmp_path, repeats=1)
    decoded = []
    real_decode = bench.decode_npy

    def slowed(data):
        decoded.append(1)
        time.sleep(PLANTED_SECONDS)
        return real_decode(data)

    monkeypatch.setattr(bench, "decode_npy", slowed)
    planted = compare_readers(tmp_path, repeats=1)
    arrays_per_read = len(decoded) // 2  # the warm-up read and the timed one
    assert arrays_per_read >= 6  # every sample has arrays to decode
    assert planted["project_samples_per_s"] <= 6 / (arrays_per_read * PLANTED_SECONDS)
    assert planted["project_samples_per_s"] < clean["project_samples_per_s"] / 2
    assert planted["speedup"] < 1 <= planted["webdataset_samples_per_s"] / planted["project_samples_per_s"]


def test_the_cli_prints_the_speedup_of_the_throughputs_it_prints(tmp_path, capsys):
    write_synthetic(tmp_path, TINY, num_shards=2, samples_per_shard=3)
    main([str(tmp_path), "--repeats", "1", "--batch-size", "2"])
    printed = capsys.readouterr().out

    def number_after(text: str) -> float:
        return float(printed.split(text)[1].split()[0].rstrip("x"))

    ours, theirs = number_after("tar reader, this project's:"), number_after("tar reader, webdataset's:")
    speedup = number_after("this project's reader is")
    rounding = 0.005 + speedup * (0.05 / ours + 0.05 / theirs)  # printed to 0.01x and 0.1 samples/s
    assert abs(speedup - ours / theirs) <= rounding, printed
