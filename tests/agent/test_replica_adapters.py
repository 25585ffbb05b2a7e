"""LoRA load and unload per engine (agent/adapters.py) against a stand-in replica: a local
HTTP server that records every call and answers 200, no engine behind it. The paths are the
engine's own (fleet_base.engines.LoraApi); an engine that reads only local directories is
sent the adapter's verified directory in the node model cache (pulled from a local file
server), never its URI."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agent.adapters import ReplicaAdapters, replica_cache_root
from fleet_base.models import ModelCache
from tests.fleet_base.models.servers import FileServer, serve


class StandInReplica:
    """Records (path, body) of every POST; answers 200 with an empty object."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def app(self) -> Starlette:
        async def record(request: Request) -> JSONResponse:
            self.calls.append((request.url.path, await request.json()))
            return JSONResponse({})

        return Starlette(routes=[Route("/{path:path}", record, methods=["POST"])])


@pytest.fixture
def adapter_file():
    data = os.urandom(4096)
    files = FileServer({"adapter_model.safetensors": data})
    with serve(files.app()) as base:
        yield f"{base}/adapter_model.safetensors#sha256={hashlib.sha256(data).hexdigest()}", data, files


@pytest.mark.parametrize(
    "engine, load_path, unload_path",
    [
        ("vllm", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
        ("sglang", "/load_lora_adapter", "/unload_lora_adapter"),
    ],
)
async def test_a_foreign_engine_gets_its_paths_and_the_cached_directory(
    tmp_path: Path, adapter_file, engine, load_path, unload_path
) -> None:
    uri, data, files = adapter_file
    replica = StandInReplica()
    cache = ModelCache(tmp_path / "cache")
    with serve(replica.app()) as url:
        async with httpx.AsyncClient() as http:
            api = ReplicaAdapters(http, cache=cache)
            assert await api.load(url, "sql", uri, engine)
            assert await api.load(url, "sql", uri, engine)  # cached: not fetched again
            assert await api.unload(url, "sql", engine)
    (p1, b1), (p2, b2), (p3, b3) = replica.calls
    assert (p1, p2, p3) == (load_path, load_path, unload_path)
    assert b1 == b2 and b1["lora_name"] == "sql" and b3 == {"lora_name": "sql"}
    local = Path(b1["lora_path"])
    assert local.is_dir() and local.is_relative_to(cache.root)  # never the hf://, s3://, https:// URI
    assert (local / "adapter_model.safetensors").read_bytes() == data
    assert len(files.gets) == 1


async def test_our_engine_reads_the_uri_itself(tmp_path: Path) -> None:
    replica = StandInReplica()
    with serve(replica.app()) as url:
        async with httpx.AsyncClient() as http:
            api = ReplicaAdapters(http, cache=ModelCache(tmp_path / "cache"))
            assert await api.load(url, "sql", "hf://org/sql-lora", "fleet")
    assert replica.calls == [
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "hf://org/sql-lora"})
    ]


async def test_an_adapter_that_cannot_be_pulled_is_never_sent(tmp_path: Path) -> None:
    replica = StandInReplica()
    with serve(FileServer({}).app()) as base, serve(replica.app()) as url:
        async with httpx.AsyncClient() as http:
            api = ReplicaAdapters(http, cache=ModelCache(tmp_path / "cache"))
            assert not await api.load(url, "sql", f"{base}/absent.safetensors#sha256={'0' * 64}", "vllm")
            assert not await api.load(url, "sql", "/a/local/dir", "llama.cpp")  # no runtime loading
            assert await api.load(url, "sql", str(tmp_path), "vllm")  # a local directory as it is
    assert replica.calls == [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path)})]


async def test_a_pod_is_sent_the_directory_under_its_model_volume(tmp_path: Path, adapter_file) -> None:
    uri, _, _ = adapter_file
    replica = StandInReplica()
    cache = ModelCache(tmp_path / "cache")
    with serve(replica.app()) as url:
        async with httpx.AsyncClient() as http:
            api = ReplicaAdapters(http, cache=cache, replica_root="/models")
            assert await api.load(url, "sql", uri, "vllm")
    ((_, body),) = replica.calls
    entry = cache.lookup(uri)
    assert entry is not None
    assert body["lora_path"] == f"/models/{cache.model_dir(entry).relative_to(cache.root).as_posix()}"


def test_replica_cache_root_per_runtime(tmp_path: Path) -> None:
    from fleet_base.cluster_config import ClusterConfig

    process = ClusterConfig(cluster="c", region="r", state_dir=tmp_path)
    assert replica_cache_root(process) is None
    kube = process.model_copy(update={"runtime": "kubernetes"})
    assert replica_cache_root(kube) == kube.kubernetes.model_volume.mount_path == "/models"
    bare = kube.model_copy(
        update={
            "kubernetes": kube.kubernetes.model_copy(
                update={"model_volume": kube.kubernetes.model_volume.model_copy(update={"kind": "none"})}
            )
        }
    )
    assert replica_cache_root(bare) is None
