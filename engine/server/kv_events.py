"""`GET /kv/events`: the replica's prefix-cache changes for the agent's relay.

A long poll (a streaming endpoint without a held connection): `epoch` and `after` are
what the caller saw last; the answer comes as soon as there is news (or after `wait`
seconds) and holds every op since, or a snapshot of every cached block hash when the
caller is new, the engine restarted, or the caller fell behind. Why a poll and not a
socket: the agent already talks HTTP to its replicas (also in other pods or machines),
a poll survives agent restarts without state on the engine, and a slow reader costs the
engine a bounded buffer, never a blocked engine thread. Guarded like the API.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from starlette.responses import Response

from engine.kv_cache.events import KvEventLog
from engine.server.errors import APIError
from engine.server.state import ServerState

MAX_WAIT_S = 10.0
POLL_S = 0.05


def kv_events_of(state: ServerState) -> KvEventLog | None:
    return getattr(state.engine, "kv_events", None)


def register(app: FastAPI, state: ServerState) -> None:
    @app.get("/kv/events")
    async def kv_events(
        epoch: str | None = Query(None, max_length=64),
        after: int | None = Query(None, ge=0),
        wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S),
    ) -> Response:
        log = kv_events_of(state)
        if log is None:
            raise APIError(404, "This replica publishes no KV events", code="not_found")
        deadline = time.monotonic() + wait
        while not log.has_news(epoch, after) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        read = await asyncio.to_thread(log.read, epoch, after)  # a snapshot may be large
        body: dict[str, Any] = {
            "epoch": read.epoch,
            "seq": read.seq,
            "snapshot": read.snapshot,
            "block_size": log.block_size,
            "ops": [
                {"kind": kind, "block_hashes": [h.hex() for h in hashes], "tier": tier}
                for kind, hashes, tier in read.ops
            ],
        }
        return JSONResponse(body)
