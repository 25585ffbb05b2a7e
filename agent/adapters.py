"""LoRA adapters on running replicas, through each engine's runtime adapter API
(`fleet_base.engines.LoraApi`: vLLM's and ours at /v1/load_lora_adapter, SGLang's at
/load_lora_adapter; loaded adapters from /v1/models). The agent uses it to preload a spread of
a deployment's adapters and to unload those the catalog dropped; the gateway to load one on
demand where there is room. An engine that reads only local directories is sent the
adapter's verified directory in the node model cache (pulled there first), never its URI.
The choices are plain functions; only `ReplicaAdapters` does I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import CAPABILITIES, EngineKind
from fleet_base.models import ModelCache, ModelStoreError, is_remote

log = logging.getLogger(__name__)


def spread(adapters: Sequence[str], replica_ids: Sequence[str], max_adapters: int) -> dict[str, list[str]]:
    """Which adapters each replica preloads: round-robin over the replicas (sorted), each up
    to `max_adapters`, so every adapter is resident somewhere while there is room."""
    ids = sorted(replica_ids)
    out: dict[str, list[str]] = {rid: [] for rid in ids}
    if not ids or max_adapters <= 0:
        return out
    for i, name in enumerate(adapters):
        for k in range(len(ids)):
            rid = ids[(i + k) % len(ids)]
            if len(out[rid]) < max_adapters:
                out[rid].append(name)
                break
    return out


def eviction_victim(loaded: Sequence[str], last_used: Mapping[str, float], keep: str) -> str | None:
    """The adapter to unload for `keep`: the least recently used of the others."""
    others = [a for a in loaded if a != keep]
    if not others:
        return None
    return min(others, key=lambda a: (last_used.get(a, float("-inf")), a))


def replica_cache_root(config: ClusterConfig) -> str | None:
    """Where replicas open the node model cache: a Kubernetes pod at its model volume's mount
    path (the volume the agent's `model_cache_dir` is, as `kube_engine.pod_model_path` has
    it); None: at the cache's own path (the process runtime)."""
    volume = config.kubernetes.model_volume
    return volume.mount_path if config.runtime == "kubernetes" and volume.kind != "none" else None


class ReplicaAdapters:
    """The replica side: what is loaded, load and unload (a 400 'already loaded' is fine)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        headers: Mapping[str, str] | None = None,
        cache: ModelCache | None = None,
        replica_root: str | None = None,
    ) -> None:
        self.http = http
        self.headers = dict(headers or {})
        self.cache = cache  # the node model cache adapters are pulled into (None: local paths only)
        self.replica_root = replica_root  # the cache's folder as replicas open it (None: its own)

    async def local_path(self, uri: str) -> str | None:
        """The adapter's directory on this host: a local path as it is, a model URI pulled
        into the node cache (verified, single-flight across processes); None when it cannot
        be had (logged)."""
        if not is_remote(uri):
            return str(Path(uri).expanduser())
        if self.cache is None:
            log.warning("adapter %s: no node model cache to pull it into", uri)
            return None
        try:
            result = await asyncio.to_thread(self.cache.pull, uri, None, [uri])
        except (ModelStoreError, OSError) as err:
            log.warning("adapter %s: pull failed: %s", uri, err)
            return None
        folder = self.cache.model_dir(result.entry)
        if self.replica_root is None:
            return str(folder)
        return f"{self.replica_root.rstrip('/')}/{folder.relative_to(self.cache.root).as_posix()}"

    async def loaded(self, url: str) -> list[str] | None:
        """Adapter names in the replica's /v1/models (cards with a parent); None: no answer."""
        try:
            r = await self.http.get(f"{url}/v1/models", headers=self.headers)
            if r.status_code != 200:
                return None
            return [m["id"] for m in r.json().get("data", []) if m.get("parent")]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None

    async def load(self, url: str, name: str, uri: str, engine: EngineKind = "fleet") -> bool:
        api = CAPABILITIES[engine].lora_api
        if api is None:
            log.warning("adapter %s on %s: %s cannot load adapters while it runs", name, url, engine)
            return False
        path = await self.local_path(uri) if api.local_path else uri
        if path is None:
            return False
        try:
            r = await self.http.post(
                f"{url}{api.load_path}",
                json={"lora_name": name, "lora_path": path},
                headers=self.headers,
                timeout=120.0,
            )
        except httpx.HTTPError as err:
            log.warning("loading adapter %s on %s failed: %s", name, url, err)
            return False
        if r.status_code == 200 or (r.status_code == 400 and "already loaded" in r.text):
            return True
        log.warning("loading adapter %s on %s: %s %s", name, url, r.status_code, r.text[:300])
        return False

    async def unload(self, url: str, name: str, engine: EngineKind = "fleet") -> bool:
        api = CAPABILITIES[engine].lora_api
        if api is None:
            return False
        try:
            r = await self.http.post(
                f"{url}{api.unload_path}", json={"lora_name": name}, headers=self.headers
            )
        except httpx.HTTPError as err:
            log.warning("unloading adapter %s on %s failed: %s", name, url, err)
            return False
        return r.status_code in (200, 404)
