"""The agent's side of the node model cache: pull a deployment's model before its replica
starts, once per model however many replicas wait for it, and report the cache.

Pulls run in threads (`fleet_base.models.ModelCache.pull`, itself single-flight across
processes), so the reconcile loop never blocks on the network. A replica whose model is
not cached waits in `pending`; the daemon starts it when `status` says ready, and marks it
failed with the pull's reason (and backs off) when the pull fails. Credentials are the
agent's own environment (AWS_*, HF_TOKEN, docker config): never the deployment record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fleet_base.models import ModelCache, ModelStoreError, is_remote, source_for
from fleet_base.protocol import CachedModel, ModelCommand, ModelCommandReply

log = logging.getLogger(__name__)

LIST_EVERY_S = 5.0


@dataclass
class Pull:
    """One model's pull as the agent tracks it."""

    uri: str
    state: str = "pulling"  # pulling | ready | failed
    bytes_done: int = 0
    bytes_total: int = 0
    started_at: float = 0.0
    pull_s: float | None = None
    downloaded: bool = False
    error: str = ""
    retryable: bool = True


class ModelPuller:
    def __init__(self, cache: ModelCache, on_change: Callable[[], None] = lambda: None) -> None:
        self.cache = cache
        self.on_change = on_change
        self.in_use: set[str] = set()  # models the desired state and this node's replicas name
        self.adapters_in_use: set[str] = set()  # LoRA adapters this node's replicas hold
        self._pinned: set[str] | None = None
        self._pulls: dict[str, Pull] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._listed: list[CachedModel] = []
        self._listed_at = 0.0

    @staticmethod
    def needs_pull(model: str) -> bool:
        return is_remote(model)

    def status(self, uri: str) -> Pull | None:
        return self._pulls.get(uri)

    def ensure(self, uri: str) -> Pull:
        """The model's pull, started now if it is neither cached nor under way."""
        pull = self._pulls.get(uri)
        if pull is not None and pull.state in ("pulling", "ready"):
            if pull.state == "ready" and self._lookup(uri) is None:  # removed meanwhile
                pull = None
            else:
                return pull
        if pull is not None and pull.state == "failed":
            return pull
        entry = self._lookup(uri)
        if entry is not None:
            pull = Pull(
                uri, state="ready", bytes_done=entry.size_bytes, bytes_total=entry.size_bytes, pull_s=0.0
            )
            self._pulls[uri] = pull
            return pull
        pull = Pull(uri, started_at=time.monotonic())
        self._pulls[uri] = pull
        self._tasks[uri] = asyncio.get_running_loop().create_task(self._pull(pull), name=f"pull {uri}")
        return pull

    def retry(self, uri: str) -> None:
        """Forget a failed pull so the next `ensure` tries again (a replica's backoff ended)."""
        pull = self._pulls.get(uri)
        if pull is not None and pull.state == "failed":
            del self._pulls[uri]

    def _lookup(self, uri: str):
        try:
            return self.cache.lookup(uri)
        except ModelStoreError:
            return None

    async def _pull(self, pull: Pull) -> None:
        def progress(done: int, total: int) -> None:
            pull.bytes_done, pull.bytes_total = done, total

        try:
            result = await asyncio.to_thread(
                self.cache.pull, pull.uri, progress, sorted(self._all_in_use() | {pull.uri})
            )
        except ModelStoreError as err:
            pull.state, pull.error, pull.retryable = "failed", str(err), err.retryable
            log.warning("model %s: pull failed: %s", pull.uri, err)
        except Exception as err:  # a bug or an OS error: the replica says so, the agent lives on
            pull.state, pull.error = "failed", f"model_error: {type(err).__name__}: {err}"
            log.exception("model %s: pull failed", pull.uri)
        else:
            pull.state, pull.downloaded = "ready", result.downloaded
            pull.bytes_done = pull.bytes_total = result.entry.size_bytes
            log.info("model %s: %s", pull.uri, "pulled" if result.downloaded else "found in the cache")
        pull.pull_s = round(time.monotonic() - pull.started_at, 3)
        self._tasks.pop(pull.uri, None)
        self._listed_at = 0.0
        self.on_change()

    def prefetch(self, models: Iterable[str]) -> None:
        """Pre-pull every remote model the desired state names (first placement on this node)."""
        wanted = {m for m in models if is_remote(m)}
        self.in_use = wanted
        self._pin()
        for uri in sorted(wanted):
            pull = self._pulls.get(uri)
            if pull is None or pull.state == "ready":
                self.ensure(uri)

    def use_adapters(self, uris: Iterable[str]) -> None:
        """The adapters this node's replicas hold now (the adapter controller says)."""
        self.adapters_in_use = {u for u in uris if is_remote(u)}
        self._pin()

    def _all_in_use(self) -> set[str]:
        return self.in_use | self.adapters_in_use

    def _pin(self) -> None:
        """Pin what replicas here use in the node cache, so no process on the node (a
        replica pulling an adapter, the agent pulling a model) evicts it under them."""
        uris = {self._canonical(u) for u in self._all_in_use()}
        if uris != self._pinned and self.cache.pin("agent", uris):
            self._pinned = uris

    def report(self) -> list[CachedModel]:
        """The cache as heartbeats carry it (the disk is listed at most every few seconds)."""
        now = time.monotonic()
        if now - self._listed_at >= LIST_EVERY_S:
            self._listed = [
                CachedModel(
                    uri=e.uri,
                    pinned_uri=e.pinned_uri,
                    size_bytes=e.size_bytes,
                    bytes_done=e.size_bytes,
                    files=len(e.files),
                    last_used=e.last_used,
                    pull_s=e.pull_s,
                )
                for e in self.cache.entries()
            ]
            self._listed_at = now
        in_use = {self._canonical(u) for u in self._all_in_use()}
        out = [
            m.model_copy(update={"in_use": m.uri in in_use or m.pinned_uri in in_use}) for m in self._listed
        ]
        listed = {m.uri for m in out}
        for pull in self._pulls.values():
            if pull.state != "ready" and self._canonical(pull.uri) not in listed:
                out.append(
                    CachedModel(
                        uri=self._canonical(pull.uri),
                        state=pull.state,
                        size_bytes=pull.bytes_total,  # type: ignore[arg-type]
                        bytes_done=pull.bytes_done,
                        in_use=pull.uri in self._all_in_use(),
                        error=pull.error[-500:],
                    )
                )
        return out

    @staticmethod
    def _canonical(uri: str) -> str:
        try:
            return source_for(uri).canonical
        except ModelStoreError:
            return uri

    async def command(self, cmd: ModelCommand) -> ModelCommandReply:
        """`fleetctl models pull|rm` on this node."""
        try:
            canonical = source_for(cmd.uri).canonical
        except ModelStoreError as err:
            return ModelCommandReply(ok=False, message=str(err))
        if cmd.action == "pull":
            self.retry(cmd.uri)
            pull = self.ensure(cmd.uri)
            return ModelCommandReply(ok=True, message=f"{canonical}: {pull.state}")
        in_use = self._all_in_use()
        if cmd.uri in in_use or canonical in {self._canonical(u) for u in in_use}:
            return ModelCommandReply(
                ok=False, message=f"{canonical} is in use by a deployment here; not removed"
            )
        if cmd.uri in self._tasks:
            return ModelCommandReply(ok=False, message=f"{canonical} is being pulled; not removed")
        entry = await asyncio.to_thread(self.cache.remove, cmd.uri)
        self._pulls.pop(cmd.uri, None)
        self._listed_at = 0.0
        if entry is None:
            return ModelCommandReply(ok=False, message=f"{canonical} is not in the cache")
        return ModelCommandReply(ok=True, message=f"removed {canonical} ({entry.size_bytes} bytes)")

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
