"""https:// against a real local HTTP server, and hf:// with the real huggingface_hub
client pointed (HF_ENDPOINT) at a local endpoint serving files in the Hub's shape."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fleet_base.models import ChecksumMismatch, MissingObject, ModelCache, NoCredentials, StoreUnreachable
from tests.fleet_base.models.servers import FileServer, HubServer, serve

ROOT = Path(__file__).resolve().parents[3]


def _uri(base: str, name: str, data: bytes) -> str:
    return f"{base}/{name}#sha256={hashlib.sha256(data).hexdigest()}"


def test_https_interrupted_download_resumes_where_it_stopped(cache: ModelCache) -> None:
    data = os.urandom(1_500_000)
    files = FileServer({"m.gguf": data}, cut_first_get_after=600_000)
    with serve(files.app()) as base:
        uri = _uri(base, "m.gguf", data)
        with pytest.raises(StoreUnreachable):
            cache.pull(uri)
        assert cache.lookup(uri) is None  # a half-written file is never an entry
        result = cache.pull(uri)
    assert files.gets[0] == ""
    assert files.gets[1].startswith("bytes=") and int(files.gets[1][6:-1]) >= 600_000
    assert result.bytes_fetched <= len(data) - 600_000
    assert (cache.model_dir(result.entry) / "m.gguf").read_bytes() == data


def test_https_checksum_mismatch_discards_the_file(cache: ModelCache) -> None:
    data = os.urandom(100_000)
    with serve(FileServer({"m.gguf": data}).app()) as base:
        wrong = f"{base}/m.gguf#sha256={'0' * 64}"
        with pytest.raises(ChecksumMismatch, match="discarded"):
            cache.pull(wrong)
        assert cache.lookup(wrong) is None
        assert not any((cache.root / "partial").rglob("*.part"))
        with pytest.raises(MissingObject):
            cache.pull(_uri(base, "absent.gguf", data))


def test_concurrent_pulls_in_two_processes_fetch_once(cache: ModelCache) -> None:
    data = os.urandom(2_000_000)
    files = FileServer({"m.gguf": data}, delay_s=0.01)  # slow enough that both wait on it together
    code = (
        "import sys; from fleet_base.models import ModelCache; "
        "print(ModelCache(sys.argv[1]).pull(sys.argv[2]).downloaded)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with serve(files.app()) as base:
        uri = _uri(base, "m.gguf", data)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(cache.root), uri], stdout=subprocess.PIPE, env=env
            )
            for _ in range(2)
        ]
        outs = sorted(p.communicate(timeout=60)[0].decode().strip() for p in procs)
    assert outs == ["False", "True"]
    assert len(files.gets) == 1


def test_threads_in_one_process_single_flight_too(cache: ModelCache) -> None:
    data = os.urandom(1_000_000)
    files = FileServer({"m.gguf": data}, delay_s=0.01)
    with serve(files.app()) as base:
        uri = _uri(base, "m.gguf", data)
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(ModelCache(cache.root).pull(uri)))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(r.downloaded for r in results) == [False, False, True]
    assert len(files.gets) == 1


@pytest.fixture()
def hub(monkeypatch):
    repos = {
        "acme/tiny": {
            "config.json": b'{"model_type": "llama"}',
            "model.safetensors": os.urandom(50_000),
            "README.md": b"not pulled",
        }
    }
    server = HubServer(repos, token="hf_test_token")
    with serve(server.app()) as base:
        monkeypatch.setenv("HF_ENDPOINT", base)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield server


def test_hf_pins_the_revision_and_checks_lfs_and_git_files(hub: HubServer, cache: ModelCache) -> None:
    result = cache.pull("hf://acme/tiny")
    commit = hub.commit("acme/tiny")
    assert result.entry.pinned_uri == f"hf://acme/tiny@{commit}"
    assert sorted(f.name for f in result.entry.files) == ["config.json", "model.safetensors"]
    folder = cache.model_dir(result.entry)
    assert (folder / "model.safetensors").read_bytes() == hub.repos["acme/tiny"]["model.safetensors"]
    # The pinned URI (what a deployment record holds) is the same cache entry.
    assert cache.lookup(f"hf://acme/tiny@{commit}").key == result.entry.key
    one = cache.pull(f"hf://acme/tiny@{commit}/config.json")
    assert [f.name for f in one.entry.files] == ["config.json"]


def test_hf_wrong_bytes_missing_repo_and_bad_token(hub: HubServer, cache: ModelCache, monkeypatch) -> None:
    hub.corrupt.add("model.safetensors")
    with pytest.raises(ChecksumMismatch):
        cache.pull("hf://acme/tiny")
    with pytest.raises(MissingObject):
        cache.pull("hf://acme/absent")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(NoCredentials):
        cache.pull("hf://acme/tiny/config.json")
