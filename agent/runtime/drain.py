"""Waiting for a replica to be idle before it is signalled: for an engine that stops at once
on SIGTERM (`fleet_base.engines.CAPABILITIES[...].drains_on_sigterm` false: vLLM, SGLang and
llama.cpp cut in-flight requests), the gateway has stopped sending it new ones, so once its
/metrics shows nothing running or waiting it can stop without failing a request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from agent.replica_metrics import parse_metrics
from fleet_base.engines import EngineKind

POLL_S = 0.2


async def wait_idle(
    http: httpx.AsyncClient,
    url: str,
    engine: EngineKind,
    timeout: float,
    headers: dict[str, str] | None = None,
    gone: Callable[[], bool] = lambda: False,
) -> bool:
    """Poll `url`/metrics until no request runs or waits, `timeout` passes or `gone()`.
    True when it saw the replica idle or could not read its metrics (nothing to wait for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not gone():
        try:
            r = await http.get(f"{url}/metrics", headers=headers or {})
            sample = parse_metrics(r.text, engine) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            sample = None
        if sample is None or sample.running + sample.waiting == 0:
            return True
        await asyncio.sleep(POLL_S)
    return False
