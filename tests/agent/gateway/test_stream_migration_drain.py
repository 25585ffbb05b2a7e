"""Drains move streams instead of cutting them (real processes, tiny model replicas): a
replica told to stop (SIGTERM) hands the streams a gateway can continue over after
`--drain-handover`, and they go on elsewhere; a rollout that replaces every replica while
streams run loses none. Each text is identical to the same request on a healthy fleet."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.stream_migration import run_streams
from engine.server.process import ServerProcess
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, replica, route, sample, scrape

pytestmark = pytest.mark.slow

STREAMS = 8
BODY = {"model": DEPLOYMENT, "ignore_eos": True}
MAX_TOKENS = 180
TEXTS = [f"hello world {i} the quick brown fox" for i in range(STREAMS)]


def _replicas(model: Path, logs: Path, names: list[str]) -> list[ServerProcess]:
    args = ["--served-model-name", DEPLOYMENT, "--threads", "1", "--kv-cache-memory", "4MiB"]
    args += ["--max-model-len", "256", "--drain-handover", "0.3", "--drain-timeout", "30"]
    procs = [ServerProcess(*args, model=str(model), log_path=logs / f"{n}.log") for n in names]
    threads = [threading.Thread(target=p.start, kwargs={"timeout": 120}) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.proc is not None and p.proc.poll() is None for p in procs)
    return procs


@pytest.fixture
def fleet(
    gw_model: Path, tmp_path: Path, nats, keys
) -> Iterator[tuple[GatewayProcess, list[ServerProcess], str]]:
    procs = _replicas(gw_model, tmp_path, ["a", "b"])
    gw = GatewayProcess(tmp_path / "gw", "east", nats_url=nats.url, lat=EAST[0], lon=EAST[1])
    try:
        gw.start()
        gw.write(
            replicas=[replica("a", procs[0].url), replica("b", procs[1].url)],
            keys=[record for _, record in keys.values()],
            routes=[route(DEPLOYMENT, [peer("east", gw.url, *EAST)])],
        )
        yield gw, procs, keys["main"][0]
    finally:
        gw.stop()
        for p in procs:
            p.stop(timeout=10)


def _check(healthy, moved) -> None:
    for i, (h, m) in enumerate(zip(healthy, moved, strict=True)):
        assert h.done and h.error is None, (i, h.error)
        assert m.done and m.error is None, (i, m.error)
        assert m.text == h.text and m.usage["completion_tokens"] == h.usage["completion_tokens"] == MAX_TOKENS


def _drained(gw: GatewayProcess) -> float:
    return sample(
        scrape(gw.url), "fleet_gateway_stream_migrations_total", deployment=DEPLOYMENT, reason="drain"
    )


def test_a_draining_replica_hands_its_streams_over(fleet, gw_model: Path, tmp_path: Path) -> None:
    gw, procs, key = fleet
    healthy, _ = asyncio.run(run_streams(gw.url, key, TEXTS, MAX_TOKENS, extra=BODY))
    before = _drained(gw)
    moved, at = asyncio.run(
        run_streams(gw.url, key, TEXTS, MAX_TOKENS, extra=BODY, kill=procs[0].terminate, kill_after_chunks=3)
    )
    assert at is not None
    _check(healthy, moved)
    assert procs[0].wait(30) == 0  # it drained and exited cleanly
    assert _drained(gw) > before  # its streams were handed over, not finished there

    # a rollout: new replicas come up, every old one is told to stop while streams run
    new = _replicas(gw_model, tmp_path, ["c", "d"])
    procs.extend(new)
    gw.write(
        replicas=[
            replica("b", procs[1].url),
            replica("c", new[0].url, version=2),
            replica("d", new[1].url, version=2),
        ]
    )

    def roll() -> None:
        procs[1].terminate()

    before = _drained(gw)
    rolled, at = asyncio.run(
        run_streams(gw.url, key, TEXTS, MAX_TOKENS, extra=BODY, kill=roll, kill_after_chunks=3)
    )
    assert at is not None
    _check(healthy, rolled)
    assert procs[1].wait(30) == 0
    assert _drained(gw) > before
