"""One checkpoint, recorded: the manifest names the target's weights, and a fit on other weights is refused.

`models.checkpoint_identity` tells weights apart from their files' names and sizes (nothing is loaded or
downloaded); extraction records the identity in manifest.json (schema 2); `DrafterDataModule.setup` compares
it with the configured target's before any process loads the target. Fake checkpoints here are folders of
small files with the names real ones have.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from test_data_datamodule import write_dataset

from data import drafter_data
from data.drafter_data import DrafterDataModule
from data.errors import ManifestError
from data.manifest import MANIFEST_NAME, UnknownCheckpointWarning, load_manifest
from data.shards import write_atomic
from models import registry
from models.checkpoint_identity import HUB_IDS, CheckpointIdentity, checkpoint_identity


def fake_transformers_checkpoint(folder: Path, shard_bytes: int = 100) -> Path:
    """A folder laid out like a sharded transformers checkpoint (config, index json, two weight files)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(shard_bytes))
    (folder / "model-00002-of-00002.safetensors").write_bytes(bytes(7))
    return folder


def test_a_local_folder_is_fingerprinted_by_its_weight_files_and_a_copy_elsewhere_matches(tmp_path: Path) -> None:
    original = fake_transformers_checkpoint(tmp_path / "Janus-Pro-7B")
    first = checkpoint_identity("janus-pro-7b", {"path": str(original), "dtype": "bfloat16"})
    assert first.source == str(original.resolve()) and first.revision is None and first.fingerprint is not None
    (original / "tokenizer.json").write_text("{}")  # not a weight file: the fingerprint ignores it
    assert checkpoint_identity("janus-pro-7b", {"path": str(original)}) == first
    copy = Path(shutil.copytree(original, tmp_path / "scratch" / "janus"))
    copied = checkpoint_identity("janus-pro-7b", {"path": str(copy)})
    assert copied.source != first.source and first.mismatch(copied) is None  # same files under another path
    (copy / "model-00001-of-00002.safetensors").write_bytes(bytes(101))  # another release: a size differs
    changed = checkpoint_identity("janus-pro-7b", {"path": str(copy)})
    assert first.mismatch(changed) == "their weight files differ (fingerprint)"


def test_an_unset_path_reads_the_environment_variable_in_the_identity_and_in_the_loader(tmp_path, monkeypatch) -> None:
    folder = fake_transformers_checkpoint(tmp_path / "Janus-Pro-7B")
    monkeypatch.setenv("JANUS_PRO_PATH", str(folder))
    assert checkpoint_identity("janus-pro-7b", {"dtype": "bfloat16"}).source == str(folder.resolve())
    loaded: list[str] = []
    import models.janus

    monkeypatch.setattr(models.janus.JanusTarget, "from_pretrained", lambda path, *a, **k: loaded.append(path))
    registry.load_target("janus-pro-7b", dtype="bfloat16")
    registry.load_target("janus-pro-7b", path="/explicit/path")  # an explicit path wins over the variable
    assert loaded == [str(folder), "/explicit/path"]
    monkeypatch.delenv("JANUS_PRO_PATH")
    hub = checkpoint_identity("janus-pro-7b", {})  # no variable, no cache: the hub id, unverifiable
    assert hub == CheckpointIdentity(HUB_IDS["janus-pro-7b"], None, None)
    assert "no local files" in hub.describe()


def test_the_hub_ids_are_the_loaders_defaults() -> None:
    import models.janus
    import models.lumina

    assert HUB_IDS == {
        "janus-pro-7b": models.janus.DEFAULT_HUB_ID,
        "lumina-mgpt-7b": models.lumina.DEFAULT_HUB_ID,
    }


def test_a_hub_id_is_fingerprinted_from_the_huggingface_cache_with_its_commit(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--Alpha-VLLM--Lumina-mGPT-7B-768"
    commit = "0123456789abcdef0123456789abcdef01234567"
    fake_transformers_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("LUMINA_MGPT_PATH", raising=False)
    identity = checkpoint_identity("lumina-mgpt-7b", {"dtype": "bfloat16"})
    assert identity.source == "Alpha-VLLM/Lumina-mGPT-7B-768" and identity.revision == commit
    local = checkpoint_identity("lumina-mgpt-7b", {"path": str(repo / "snapshots" / commit)})
    assert identity.fingerprint == local.fingerprint is not None


def test_llamagen_fingerprints_gpt_vq_and_t5_as_the_loader_finds_them(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "pretrained_models"
    folder.mkdir()
    (folder / "t2i_XL_stage1_256.pt").write_bytes(bytes(10))
    (folder / "vq_ds16_t2i.pt").write_bytes(bytes(20))
    fake_transformers_checkpoint(folder / "t5-ckpt" / "flan-t5-xl")
    monkeypatch.setenv("LLAMAGEN_DIR", str(folder))
    stage1 = checkpoint_identity("llamagen-xl", {"preset": "t2i-XL-stage1", "sampling": "lantern"})
    assert stage1.fingerprint is not None and f"gpt={folder / 't2i_XL_stage1_256.pt'}" in stage1.source
    assert str(folder / "t5-ckpt" / "flan-t5-xl") in stage1.source
    stage2 = checkpoint_identity("llamagen-xl", {"preset": "t2i-XL-stage2"})  # its GPT file is not there
    assert stage2.fingerprint is None and stage1.mismatch(stage2) is not None


def test_random_weights_and_unknown_targets_have_stable_identities() -> None:
    assert checkpoint_identity("janus-pro-7b", {"random_weights": "tiny"}) == CheckpointIdentity(
        "random:tiny", None, "random:tiny"
    )
    assert checkpoint_identity("tiny-toy").mismatch(checkpoint_identity("tiny-toy")) is None
    assert checkpoint_identity("toy").fingerprint is not None  # the shipped asset files


def dataset_with_checkpoint(folder: Path, checkpoint: CheckpointIdentity | None, version: int = 2) -> Path:
    """write_dataset's 3 shards, the manifest recording `checkpoint` (schema 2) or no field at all (version 1)."""
    write_dataset(folder, [2, 2, 2])
    values = json.loads((folder / MANIFEST_NAME).read_text())
    values["schema_version"] = version
    if version == 1:
        del values["checkpoint"]
    else:
        values["checkpoint"] = None if checkpoint is None else checkpoint.__dict__
    write_atomic(folder / MANIFEST_NAME, json.dumps(values))
    return folder


def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before the checkpoint check")

    monkeypatch.setattr(drafter_data, "shared_target", refuse)


def test_a_fit_on_other_weights_is_refused_naming_both_before_the_target_loads(tmp_path, monkeypatch) -> None:
    extracted = checkpoint_identity("janus-pro-7b", {"path": str(fake_transformers_checkpoint(tmp_path / "a"))})
    other = fake_transformers_checkpoint(tmp_path / "b", shard_bytes=200)
    folder = dataset_with_checkpoint(tmp_path / "ds", extracted)
    no_loading(monkeypatch)
    data = DrafterDataModule(train_dir=str(folder), target="janus-pro-7b", target_options={"path": str(other)})
    with pytest.raises(ManifestError) as error:
        data.setup("fit")
    message = str(error.value)
    assert str(folder / MANIFEST_NAME) in message and "was extracted from the checkpoint" in message
    assert extracted.source in message and str(other.resolve()) in message and "JANUS_PRO_PATH" in message
    hub = DrafterDataModule(train_dir=str(folder), target="janus-pro-7b", target_options={"path": "org/elsewhere"})
    with pytest.raises(ManifestError, match="org/elsewhere .*no local files: unverified"):
        hub.setup("fit")


@pytest.mark.parametrize("version", [1, 2])
def test_a_manifest_without_a_checkpoint_is_read_and_the_fit_warns(tmp_path, monkeypatch, version: int) -> None:
    folder = dataset_with_checkpoint(tmp_path / "ds", None, version=version)
    assert load_manifest(folder).checkpoint is None
    no_loading(monkeypatch)
    data = DrafterDataModule(train_dir=str(folder), target="janus-pro-7b", target_options={"random_weights": "tiny"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data.check_checkpoints()
    messages = [str(w.message) for w in caught if issubclass(w.category, UnknownCheckpointWarning)]
    assert len(messages) == 1 and "does not record the target checkpoint" in messages[0]
    assert f"schema_version {version}" in messages[0] and "random:tiny" in messages[0]


def test_extraction_records_the_checkpoint_and_a_resume_with_other_weights_is_refused(tmp_path: Path) -> None:
    from data.extract import ExtractConfig, run_extraction
    from data.prompts import PromptSetConfig

    config = ExtractConfig(
        target="janus-pro-7b",
        target_options={"random_weights": "tiny"},
        out_dir=str(tmp_path / "ds"),
        prompts=PromptSetConfig(source="toy", count=2),
        samples_per_shard=2,
        batch_size=2,
        features="tokens",
    )
    manifest = run_extraction(config, progress=False)
    assert manifest is not None and load_manifest(tmp_path / "ds").checkpoint == checkpoint_identity(
        "janus-pro-7b", {"random_weights": "tiny"}
    )
    (tmp_path / "ds" / MANIFEST_NAME).unlink()
    (tmp_path / "ds" / "shard-000000.tar").unlink()  # an unfinished extraction, resumed with other weights
    target = registry.shared_target("janus-pro-7b", {"random_weights": "tiny"})
    elsewhere = CheckpointIdentity("/models/other-janus", None, "f" * 64)
    with pytest.raises(ValueError, match=r"checkpoint changed\) \(checkpoint: begun with .*random:tiny"):
        run_extraction(config, target, progress=False, checkpoint=elsewhere)
