"""`python -m data.bench`: the DataModule against a raw read, and this project's tar reader against webdataset's."""

from __future__ import annotations

import dataclasses

from data.bench import JANUS, compare_readers, main, write_synthetic

TINY = dataclasses.replace(JANUS, name="tiny-synthetic", hidden_size=8, grid=(4, 4), image_vocab_size=32)


def test_both_readers_read_every_sample_and_the_bench_prints_both(tmp_path, capsys):
    write_synthetic(tmp_path, TINY, num_shards=2, samples_per_shard=3)
    readers = compare_readers(tmp_path, repeats=1)  # raises unless both readers yield all 6 samples
    assert readers["project_samples_per_s"] > 0 and readers["webdataset_samples_per_s"] > 0
    main([str(tmp_path), "--repeats", "1", "--batch-size", "2"])
    printed = capsys.readouterr().out
    assert "tar reader, this project's" in printed and "tar reader, webdataset's" in printed
    assert "x webdataset's" in printed
