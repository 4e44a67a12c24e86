"""Hub export (training/export.py) and Hub loading (EagleDrafter.from_pretrained with a repo id).

One tiny run is trained once per module (tiny-toy target, 8 extracted samples, 2 steps through
training/fit.py, so the run directory holds config.yaml, checkpoints and TensorBoard logs as a real run
does; a few seconds). Uploads and downloads go to `FakeHub`, a loopback HTTP server started by the tests
that speaks the few Hub endpoints huggingface_hub uses (docs/architecture.md, section "A fake Hub for the tests"): no
network is touched.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
import torch
import yaml
from conftest import build_tiny_toy_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from data.extract import ExtractConfig, run_extraction
from data.prompts import PromptSetConfig
from inference.decoding.eagle import EagleDrafter
from inference.decoding.speculative import DecoderConfig, generate_speculative
from inference.decoding.verify import ExactRule
from models import registry
from models.eagle import EagleDraftModel, drafter_preset
from models.registry import shared_target
from training.checkpoints import drafter_from_checkpoint
from training.export import ExportError, check_serving_layout, export_drafter, main, serving_weight_names
from training.model_card import logged_scalars

PROMPTS = ["a small red circle at the top left on a plain blue background", "a big green square on stripes"]
DECODER = DecoderConfig(tree="dynamic", top_k=4, depth=3, total_tokens=14)
EXPORTED = {"config.json", "model.safetensors", "README.md"}
TOKEN = "hf_test_" + "Zq7" * 10  # a fake token; it must never appear in outputs or logs


# ----------------------------------------------------------------------------- a loopback fake Hub


@dataclasses.dataclass
class FakeRepo:
    private: bool
    branches: dict[str, tuple[str, dict[str, bytes]]]  # branch -> (commit sha, files)


class FakeHub(ThreadingHTTPServer):
    """The Hub endpoints huggingface_hub uses to create a repo, commit files and download a snapshot."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.authorizations: set[str] = set()
        self.unknown: list[str] = []
        self.refused: list[str] = []  # hosts other than the fake hub that something tried to reach

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _oid(data: bytes) -> str:
    """The git blob id the Hub reports for a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, format: str, *args: Any) -> None:  # keep the test output clean
        pass

    def _reply(self, status: int, payload: Any = None, body: bytes | None = None, headers: dict | None = None) -> None:
        data = body if body is not None else json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if body is None else "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _route(self) -> list[str]:
        self.server.requests.append((self.command, self.path))
        if self.headers.get("Authorization"):
            self.server.authorizations.add(self.headers["Authorization"])
        return [unquote(part) for part in urlparse(self.path).path.strip("/").split("/")]

    def _not_found(self) -> None:
        if self.path != "/api/agent-harnesses":  # huggingface_hub's optional user-agent registry: a 404 is fine
            self.server.unknown.append(f"{self.command} {self.path}")
        self._reply(404, {"error": f"fake hub: no route for {self.command} {self.path}"}, headers={"X-Error-Code": ""})

    def _write_allowed(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._reply(401, {"error": "Invalid credentials"})
            return False
        return True

    def do_POST(self) -> None:
        parts, body = self._route(), self._body()
        if not self._write_allowed():
            return
        if parts == ["api", "repos", "create"]:
            values = json.loads(body)
            repo_id = f"{values['organization']}/{values['name']}" if values.get("organization") else values["name"]
            private = values.get("visibility") == "private" or values.get("private") is True
            self.server.repos.setdefault(repo_id, FakeRepo(private, {"main": ("0" * 40, {})}))
            self._reply(200, {"url": f"{self.server.url}/{repo_id}", "name": repo_id})
        elif parts == ["api", "validate-yaml"]:
            self._reply(200, {"errors": [], "warnings": []})
        elif len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
            files = json.loads(body)["files"]
            self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                        for f in files]})  # fmt: skip
        elif len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "branch":
            repo = self.server.repos[f"{parts[2]}/{parts[3]}"]
            repo.branches.setdefault(parts[5], repo.branches["main"])
            self._reply(200, {})
        elif len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
            repo_id, branch = f"{parts[2]}/{parts[3]}", parts[5]
            repo = self.server.repos[repo_id]
            files = dict(repo.branches[branch][1])
            for line in body.decode().splitlines():
                entry = json.loads(line)
                if entry["key"] == "file":
                    value = entry["value"]
                    assert value["encoding"] == "base64", value
                    files[value["path"]] = base64.b64decode(value["content"])
            sha = hashlib.sha1(repr(sorted((k, _oid(v)) for k, v in files.items())).encode() + branch.encode())
            repo.branches[branch] = (sha.hexdigest(), files)
            commit_url = f"{self.server.url}/{repo_id}/commit/{sha.hexdigest()}"
            self._reply(200, {"commitUrl": commit_url, "commitOid": sha.hexdigest()})
        else:
            self._not_found()

    def _lookup(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            return None
        if revision in repo.branches:
            return repo.branches[revision]
        return next((entry for entry in repo.branches.values() if entry[0] == revision), None)

    def do_GET(self) -> None:
        parts = self._route()
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in ("revision", "tree"):
            repo_id = f"{parts[2]}/{parts[3]}"
            found = self._lookup(repo_id, parts[5])
            if found is None:
                self._reply(404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"})
            elif parts[4] == "revision":
                sha, files = found
                self._reply(200, {"id": repo_id, "sha": sha, "private": self.server.repos[repo_id].private,
                                  "siblings": [{"rfilename": path} for path in files]})  # fmt: skip
            else:
                listing = [{"type": "file", "path": p, "size": len(d), "oid": _oid(d)} for p, d in found[1].items()]
                self._reply(200, listing)
        elif len(parts) >= 5 and parts[2] == "resolve":
            found = self._lookup(f"{parts[0]}/{parts[1]}", parts[3])
            path = "/".join(parts[4:])
            if found is None or path not in found[1]:
                self._reply(404, {"error": "Entry not found"}, headers={"X-Error-Code": "EntryNotFound"})
                return
            data = found[1][path]
            self._reply(200, body=data, headers={"X-Repo-Commit": found[0], "ETag": f'"{_oid(data)}"'})
        else:
            self._not_found()

    do_HEAD = do_GET


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A fake Hub on a random loopback port, huggingface_hub pointed at it, online, with a fake token."""
    from huggingface_hub import constants

    hub = FakeHub()
    thread = threading.Thread(target=hub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    resolve = socket.getaddrinfo

    def loopback_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in ("127.0.0.1", "localhost"):
            hub.refused.append(str(host))
            raise OSError(f"test_training_export: no network, refused to resolve {host!r}")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest sets HF_HUB_OFFLINE=1 for every other test
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    yield hub
    hub.shutdown()
    hub.server_close()
    assert not hub.refused, f"requests left the loopback fake hub: {hub.refused}"


@pytest.fixture
def hub_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every log record at DEBUG, huggingface_hub's included (its logger may not propagate to the root)."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


# ----------------------------------------------------------------------------- a tiny trained run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 2-step EAGLE-3 run of training/fit.py on the tiny-toy target: config.yaml, checkpoints, logs, drafter/."""
    from training.fit import main as fit_main

    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry.TARGET_LOADERS, "tiny-toy", lambda **kwargs: build_tiny_toy_target())
        patch.setattr(sys, "argv", sys.argv[:1])  # LightningCLI reads sys.argv too
        shared_target.cache_clear()
        shards = root / "shards"
        prompts = PromptSetConfig(source="toy", count=8)
        extract = ExtractConfig(out_dir=str(shards), prompts=prompts, samples_per_shard=4, batch_size=4, seed=3,
                                store_aux=True, store_uncond=False)  # fmt: skip
        run_extraction(extract, target=shared_target("tiny-toy"), rank=0, world_size=1, progress=False)
        config = root / "tiny.yaml"
        config.write_text(yaml.safe_dump({
            "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "val_check_interval": 2,
                        "check_val_every_n_epoch": None, "log_every_n_steps": 1, "enable_progress_bar": False,
                        "enable_model_summary": False,
                        "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                   "init_args": {"save_dir": str(root / "runs"), "name": "tiny", "version": "",
                                                 "default_hp_metric": False}}},
            "model": {"target": "tiny-toy", "architecture": "eagle3", "preset": "tiny",
                      "objective": {"ttt_steps": 2, "eval_steps": 2}, "optimizer": {"lr": 1.0e-2, "warmup_steps": 1}},
            "data": {"train_dir": str(shards), "num_val_shards": 1, "batch_size": 2, "load_uncond": False},
            "checkpoint": {"every_n_train_steps": 2},
        }))  # fmt: skip
        assert fit_main(["--config", str(config)]) == 0
        yield root / "runs" / "tiny"
    shared_target.cache_clear()


def decode(drafter: EagleDrafter, target, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    settings = dataclasses.replace(target.sampling, temperature=temperature)
    generator = torch.Generator().manual_seed(7)
    result = generate_speculative(target, drafter, PROMPTS, ExactRule(), DECODER, settings, generator=generator)
    return result.tokens, result.accepted


def read_card(folder: Path) -> tuple[dict[str, Any], str]:
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n"), text[:100]
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def safetensors_metadata(folder: Path) -> dict[str, str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return handle.metadata()


def logged(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in logged_scalars(run_dir)[tag]]


# ----------------------------------------------------------------------------- export


def test_exported_checkpoint_decodes_exactly_like_the_original(tiny_run: Path, tiny_target, tmp_path: Path, capsys):
    ckpt = tiny_run / "checkpoints" / "last.ckpt"
    out = tmp_path / "export"
    assert main(["--ckpt", str(ckpt), "--out", str(out)]) == 0
    assert "wrote the eagle3 drafter" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == EXPORTED
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary folder is gone

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["drafter_config"]["architecture"] == "eagle3"
    weights = load_file(out / "model.safetensors")
    trained = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert set(weights) == serving_weight_names(drafter_from_checkpoint(ckpt).config)  # no prefix, no embedding
    for name, tensor in weights.items():
        assert torch.equal(tensor, trained[f"model.{name}"]), name

    original = EagleDrafter(drafter_from_checkpoint(ckpt), tiny_target)
    exported = EagleDrafter.from_pretrained(str(out), tiny_target)  # the exported folder loads directly
    for temperature in (0.0, 1.0):  # greedy, then sampled with the same seed: the drafts decide the accepted counts
        tokens, accepted = decode(original, tiny_target, temperature)
        tokens_exported, accepted_exported = decode(exported, tiny_target, temperature)
        assert torch.equal(tokens, tokens_exported) and torch.equal(accepted, accepted_exported)
    assert accepted.clamp(min=0).sum() > 0  # the sampled run accepted drafts: the comparison depends on the drafter


def test_model_card_describes_the_run(tiny_run: Path, tmp_path: Path):
    export_drafter(tiny_run / "checkpoints" / "last.ckpt", tmp_path / "export", repo_id="org/tiny-drafter")
    metadata, body = read_card(tmp_path / "export")
    assert metadata["library_name"] == "cascade-drafters" and metadata["license"] == "apache-2.0"
    assert {"eagle", "eagle3", "speculative-decoding"} <= set(metadata["tags"])
    assert "base_model" not in metadata  # the tiny-toy target has no Hub id

    parameters = sum(p.numel() for p in EagleDraftModel(drafter_preset("tiny", "eagle3")).parameters())
    tau = logged(tiny_run, "val/tau_sim")
    assert len(tau) == 2 and tau[0][0] == 0  # before training, then after step 2
    run_config = yaml.safe_load((tiny_run / "config.yaml").read_text())
    for expected in [
        "drafter for `tiny-toy`",
        "LlamaForCausalLMEagle3",
        f"parameters: {parameters:,}",
        f"features: `{run_config['data']['train_dir']}` (batch size 2)",
        "prompts: 8 from `toy`",
        "8 images of 16 tokens",
        "`ttt_steps=2`",
        "`lr=0.01`",
        "checkpoint at step 2",
        f"| `val/tau_sim` | {tau[-1][1]:.3f} | {tau[-1][0]} | TensorBoard log |",
        f"| `val/tau_sim` | {tau[0][1]:.3f} | 0 | TensorBoard log, before training |",
        'EagleDrafter.from_pretrained("org/tiny-drafter", target)',
        "generate_speculative(",
    ]:
        assert expected in body, f"{expected!r} missing from the card:\n{body}"

    export_drafter(tiny_run / "checkpoints" / "last.ckpt", tmp_path / "janus", base_model="deepseek-ai/Janus-Pro-7B")
    assert read_card(tmp_path / "janus")[0]["base_model"] == "deepseek-ai/Janus-Pro-7B"


def test_a_drafter_folder_reexports_identically_and_outputs_are_not_clobbered(tiny_run: Path, tmp_path: Path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    export_drafter(tiny_run / "checkpoints" / "last.ckpt", first)
    export_drafter(first, second)  # an exported folder is a drafter folder
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    weights, again = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    assert safetensors_metadata(first) == safetensors_metadata(second)  # (its header's key order is not stable)

    result = export_drafter(tiny_run / "drafter", tmp_path / "from-run")  # fit.py's drafter/: the run dir is its parent
    assert result.info.run_dir == tiny_run and "prompts: 8 from `toy`" in read_card(tmp_path / "from-run")[1]

    before = (first / "README.md").read_bytes()
    assert main(["--ckpt", str(tiny_run / "drafter"), "--out", str(first)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (first / "README.md").read_bytes() == before
    assert main(["--ckpt", str(tiny_run / "drafter"), "--out", str(first), "--overwrite"]) == 0
    assert (first / "README.md").read_bytes() != before  # the card now describes the drafter folder's export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "from-run", "second"]


def test_a_deepspeed_checkpoint_folder_exports(tiny_run: Path, tmp_path: Path):
    """Lightning's DeepSpeed layout without ZeRO partitions: `latest` -> checkpoint/mp_rank_00_model_states.pt."""
    checkpoint = torch.load(tiny_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    folder = tmp_path / "run" / "checkpoints" / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    states = {
        "module": checkpoint.pop("state_dict"),
        **{k: v for k, v in checkpoint.items() if k != "optimizer_states"},
    }
    torch.save(states, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    export_drafter(folder, tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(tensor, states["module"][f"model.{name}"]) for name, tensor in exported.items())


def write_drafter_folder(folder: Path, model: EagleDraftModel, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.serving_config()))
    return folder


def _prefixed(state: dict) -> dict:
    return {f"model.{k}": v for k, v in state.items()}


@pytest.mark.parametrize(
    "architecture, edit, named, hint",
    [
        ("eagle3", _prefixed, "model.fc.weight", "trainer prefixes"),
        ("eagle3", lambda s: {**s, "embed_tokens.weight": torch.zeros(64, 32)}, "embed_tokens.weight", "embedding"),
        ("eagle3", lambda s: {k: v for k, v in s.items() if k != "d2t"}, "missing keys ['d2t']", None),
        ("eagle1", lambda s: {**s, "lm_head.weight": torch.zeros(64, 32)}, "lm_head.weight", "image head"),
        ("eagle1", lambda s: {k: v for k, v in s.items() if k != "fc.bias"}, "missing keys ['fc.bias']", None),
    ],
    ids=["trainer-prefix", "embedding", "missing-d2t", "eagle1-lm-head", "eagle1-missing-bias"],
)
def test_missing_or_extra_keys_are_refused_before_writing(architecture, edit, named, hint, tmp_path: Path, capsys):
    model = EagleDraftModel(drafter_preset("tiny", architecture))
    source = write_drafter_folder(tmp_path / "source", model, edit(model.state_dict()))
    assert main(["--ckpt", str(source), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert named in error and f"{architecture} serving layout" in error, error
    assert hint is None or hint in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # nothing written, no temporary folder left


def test_a_checkpoint_with_a_foreign_module_is_refused(tmp_path: Path):
    model = EagleDraftModel(drafter_preset("tiny", "eagle3"))
    state = {**_prefixed(model.state_dict()), "frozen_target.tok_embeddings.weight": torch.zeros(64, 32)}
    torch.save({"state_dict": state, "drafter_config": model.config.to_dict()}, tmp_path / "last.ckpt")
    with pytest.raises(ExportError, match=r"unexpected keys \['frozen_target.tok_embeddings.weight'\]"):
        export_drafter(tmp_path / "last.ckpt", tmp_path / "out")


@pytest.mark.parametrize(
    "architecture, overrides",
    [("eagle3", {}), ("eagle3", {"draft_vocab_size": 16}), ("eagle1", {}), ("eagle1", {"fc_bias": False})],
)
def test_the_serving_layout_is_the_models_own_state(architecture, overrides):
    model = EagleDraftModel(drafter_preset("tiny", architecture, **overrides))
    assert set(model.state_dict()) == serving_weight_names(model.config)
    check_serving_layout(model.state_dict(), model.config, "model")
    wrong = {**model.state_dict(), "fc.weight": torch.zeros(3, 3)}
    with pytest.raises(ExportError, match=r"fc.weight: \(3, 3\)"):
        check_serving_layout(wrong, model.config, "model")


# ----------------------------------------------------------------------------- the Hub


def test_push_uploads_the_export_and_never_shows_the_token(tiny_run, tiny_target, fake_hub, hub_logs, tmp_path, capsys):
    ckpt = str(tiny_run / "checkpoints" / "last.ckpt")
    out, out_v1 = tmp_path / "export", tmp_path / "export-v1"
    assert main(["--ckpt", ckpt, "--out", str(out), "--push-to-hub", "org/tiny-drafter", "--private"]) == 0
    printed = capsys.readouterr()
    assert f"pushed to org/tiny-drafter (revision main): {fake_hub.url}/org/tiny-drafter/commit/" in printed.out
    assert main(["--ckpt", ckpt, "--out", str(out_v1), "--push-to-hub", "org/tiny-drafter", "--revision", "v1"]) == 0

    repo = fake_hub.repos["org/tiny-drafter"]
    assert repo.private and set(repo.branches) == {"main", "v1"}
    for branch, folder in (("main", out), ("v1", out_v1)):
        uploaded = repo.branches[branch][1]
        assert set(uploaded) == EXPORTED
        for name, data in uploaded.items():
            assert data == (folder / name).read_bytes(), f"{branch}: {name}"
    assert 'revision="v1"' in (out_v1 / "README.md").read_text()
    assert fake_hub.authorizations == {f"Bearer {TOKEN}"} and not fake_hub.unknown

    # the Hub id loads like a folder, then from the cache offline; a branch by name
    from huggingface_hub import constants

    original = EagleDraftModel.from_pretrained(out)
    for revision in (None, "v1"):
        drafter = EagleDrafter.from_pretrained("org/tiny-drafter", tiny_target, revision=revision)
        for name, tensor in original.state_dict().items():
            assert torch.equal(drafter.model.state_dict()[name], tensor), name
    served = len(fake_hub.requests)
    constants.HF_HUB_OFFLINE = True  # restored by the fake_hub fixture
    drafter = EagleDrafter.from_pretrained("org/tiny-drafter", tiny_target)
    assert len(fake_hub.requests) == served  # offline: the cached snapshot, no request
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        EagleDrafter.from_pretrained("org/tiny-drafter", tiny_target, cache_dir=tmp_path / "empty-cache")
    constants.HF_HUB_OFFLINE = False
    with pytest.raises(FileNotFoundError, match="not found: a drafter folder holds"):
        EagleDrafter.from_pretrained("org/no-such-drafter", tiny_target)
    assert any("/resolve/" in path for _, path in fake_hub.requests) and not fake_hub.unknown

    later = capsys.readouterr()
    for text in (
        printed.out,
        printed.err,
        later.out,
        later.err,
        hub_logs.text,
        *(r.getMessage() for r in hub_logs.records),
    ):
        assert TOKEN not in text
    assert any("huggingface_hub" in record.name for record in hub_logs.records)  # the library's logs were captured
    for path in [*out.iterdir(), *out_v1.iterdir()]:
        assert TOKEN.encode() not in path.read_bytes()


def test_push_without_a_token_says_how_to_log_in(tiny_run, fake_hub, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HF_TOKEN")
    argv = ["--ckpt", str(tiny_run / "drafter"), "--out", str(tmp_path / "export"), "--push-to-hub", "org/x"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "no Hugging Face token" in error and "HF_TOKEN" in error and "hf auth login" in error
    assert fake_hub.requests == []
    assert not (tmp_path / "export").exists()  # checked first: the same command reruns once logged in


def test_push_in_offline_mode_is_refused(tiny_run, fake_hub, monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["--ckpt", str(tiny_run / "drafter"), "--out", str(tmp_path / "export"), "--push-to-hub", "org/x"]
    assert main(argv) == 2
    assert "unset HF_HUB_OFFLINE" in capsys.readouterr().err and fake_hub.requests == []
    assert not (tmp_path / "export").exists()


def test_a_failed_upload_is_one_clean_error(tiny_run, fake_hub, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN + "-revoked")  # the fake hub answers 401
    argv = ["--ckpt", str(tiny_run / "drafter"), "--out", str(tmp_path / "export"), "--push-to-hub", "org/x"]
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert "upload to org/x failed" in printed.err and "401" in printed.err and "rerun with --overwrite" in printed.err
    assert TOKEN not in printed.out + printed.err


def test_local_folders_keep_their_errors(tiny_target, monkeypatch, tmp_path: Path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # whatever the environment says: no request
    with pytest.raises(FileNotFoundError, match="config.json not found: a drafter folder holds"):
        EagleDrafter.from_pretrained(tmp_path / "missing", tiny_target)
    with pytest.raises(FileNotFoundError, match="config.json not found: a drafter folder holds"):
        EagleDrafter.from_pretrained(str(tmp_path / "missing"), tiny_target)  # an absolute path is never a Hub id
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        EagleDrafter.from_pretrained("org/never-downloaded", tiny_target, cache_dir=tmp_path / "cache")


def test_exported_files_follow_the_users_umask(tiny_run: Path, tmp_path: Path):
    previous = os.umask(0o027)
    try:
        result = export_drafter(tiny_run / "checkpoints" / "last.ckpt", tmp_path / "export")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(result.folder.stat().st_mode) == 0o750
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in result.folder.iterdir()}
    assert modes == {"config.json": 0o640, "model.safetensors": 0o640, "README.md": 0o640}, modes


def test_logged_scalars_follow_the_writing_order_not_the_file_names(tmp_path: Path):
    """A process's tenth TensorBoard writer names its file `...<pid>.10`, which sorts before the ninth's `....9`:
    the validation before training would then read as logged after it."""
    from torch.utils.tensorboard import SummaryWriter

    for step, value, counter in ((0, 1.0, 9), (2, 1.5, 10)):  # written in this order
        writer = SummaryWriter(str(tmp_path / "tmp"))
        writer.add_scalar("val/tau_sim", value, step)
        writer.close()
        (written,) = (tmp_path / "tmp").glob("events.out.tfevents.*")
        written.rename(tmp_path / f"events.out.tfevents.1700000000.host.123.{counter}")
        time.sleep(0.01)  # distinct wall times
    names = sorted(path.name for path in tmp_path.glob("events.out.tfevents.*"))
    assert names[0].endswith(".10")  # the name order is the reverse of the writing order
    assert logged(tmp_path, "val/tau_sim") == [(0, 1.0), (2, 1.5)]
