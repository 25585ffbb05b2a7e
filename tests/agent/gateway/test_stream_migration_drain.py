"""Drains move streams instead of cutting them (real processes, tiny model replicas): a
replica told to stop (SIGTERM) hands the streams a gateway can continue over after
`--drain-handover`, and they go on elsewhere; a region whose replicas all die mid-stream
hands them to the peer region. Each text is identical to the same request on a healthy
fleet. (A real rollout through the control plane and agent, on SmolLM2 replicas:
tests/e2e/test_stream_migration_rollout.py.)"""

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

WEST = (34.05, -118.24)  # Los Angeles

STREAMS = 8
BODY = {"model": DEPLOYMENT, "ignore_eos": True}
MAX_TOKENS = 180
TEXTS = [f"hello world {i} the quick brown fox" for i in range(STREAMS)]


def _replicas(model: Path, logs: Path, names: list[str]) -> list[ServerProcess]:
    args = ["--served-model-name", DEPLOYMENT, "--threads", "1", "--kv-cache-memory", "4MiB"]
    # The tiny model writes a 180-token stream in a few tenths of a second: a drain that let
    # streams run on for even 50 ms would see most of them finish there instead of moving.
    args += ["--max-model-len", "256", "--drain-handover", "0", "--drain-timeout", "30"]
    procs = [ServerProcess(*args, model=str(model), log_path=logs / f"{n}.log") for n in names]
    threads = [threading.Thread(target=p.start, kwargs={"timeout": 120}) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.proc is not None and p.proc.poll() is None for p in procs)
    return procs


@pytest.fixture(scope="module")
def pool(gw_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Every replica of this module, started in one parallel wave (a replica's start is most
    of each test's time): the drain test takes "a" and "b" and stops the busier; the region test
    takes "c" for east (SIGKILLed) and whichever of "a" and "b" still serves after the drain,
    for west."""
    names = ["a", "b", "c"]
    procs = _replicas(gw_model, tmp_path_factory.mktemp("drain-replicas"), names)
    try:
        yield dict(zip(names, procs, strict=True))
    finally:
        for p in procs:
            p.stop(timeout=10)


@pytest.fixture
def fleet(
    pool: dict[str, ServerProcess], tmp_path: Path, nats, keys
) -> Iterator[tuple[GatewayProcess, list[ServerProcess], str]]:
    procs = [pool["a"], pool["b"]]
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


def _check(healthy, moved) -> None:
    for i, (h, m) in enumerate(zip(healthy, moved, strict=True)):
        assert h.done and h.error is None, (i, h.error)
        assert m.done and m.error is None, (i, m.error)
        assert m.text == h.text and m.usage["completion_tokens"] == h.usage["completion_tokens"] == MAX_TOKENS


def _drained(gw: GatewayProcess) -> float:
    return sample(
        scrape(gw.url), "fleet_gateway_stream_migrations_total", deployment=DEPLOYMENT, reason="drain"
    )


def _migrations(gw: GatewayProcess) -> dict[str, float]:
    """Streams migrated so far, by reason (what a failure of the drain test reports)."""
    return {
        dict(labels).get("reason", ""): value
        for (name, labels), value in scrape(gw.url).items()
        if name == "fleet_gateway_stream_migrations_total"
    }


def _chosen(gw: GatewayProcess) -> dict[str, float]:
    """Attempts the gateway sent to each replica so far."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape(gw.url).items():
        if name == "fleet_gateway_replica_choice_total":
            rid = dict(labels).get("replica", "")
            out[rid] = out.get(rid, 0.0) + value
    return out


def _running(proc: ServerProcess) -> float:
    """Sequences the engine is generating now, from its own /metrics."""
    return sum(v for (name, _), v in scrape(proc.url).items() if name == "fleet_engine_requests_running")


def test_a_draining_replica_hands_its_streams_over(fleet) -> None:
    gw, procs, key = fleet
    healthy, _ = asyncio.run(run_streams(gw.url, key, TEXTS, MAX_TOKENS, extra=BODY))
    before, chosen, reasons = _drained(gw), _chosen(gw), _migrations(gw)
    stopped: list[ServerProcess] = []

    at_kill: dict[str, object] = {}

    def drain_the_busier() -> None:
        # The router may put most streams on one replica (their prefixes are cached where
        # the healthy run left them): stop the one generating more of them, as each engine
        # says, so there are streams to hand over whichever it is.
        running = [_running(p) for p in procs]
        stopped.append(procs[0] if running[0] >= running[1] else procs[1])
        stopped[0].terminate()
        at_kill.update(running=running, chosen=_chosen(gw))

    moved, at = asyncio.run(
        run_streams(gw.url, key, TEXTS, MAX_TOKENS, extra=BODY, kill=drain_the_busier, kill_after_chunks=1)
    )
    assert at is not None and stopped
    _check(healthy, moved)
    assert stopped[0].wait(30) == 0  # it drained and exited cleanly
    # its streams were handed over, not finished there
    log = stopped[0].log_path.read_text(errors="replace")[-2000:] if stopped[0].log_path else ""
    assert _drained(gw) > before, (
        f"migrations before {reasons}, after {_migrations(gw)}; gateway choices before {chosen}, "
        f"at the kill {at_kill}; the stopped replica's log:\n{log}"
    )


def test_a_region_lost_mid_stream_continues_in_the_peer_region(
    pool: dict[str, ServerProcess], tmp_path: Path, nats, keys
) -> None:
    """East's only replica is SIGKILLed: east's gateway continues the streams through the
    west gateway, whose replica prefills the continuation."""
    east_r = pool["c"]
    west_r = next(p for p in (pool["b"], pool["a"]) if p.proc is not None and p.proc.poll() is None)
    east = GatewayProcess(tmp_path / "east", "east", nats_url=nats.url, lat=EAST[0], lon=EAST[1])
    west = GatewayProcess(tmp_path / "west", "west", nats_url=nats.url, lat=WEST[0], lon=WEST[1])
    try:
        east.start()
        west.start()
        records = [record for _, record in keys.values()]
        table = route(DEPLOYMENT, [peer("east", east.url, *EAST), peer("west", west.url, *WEST)])
        east.write(replicas=[replica("e1", east_r.url)], keys=records, routes=[table])
        west.write(replicas=[replica("w1", west_r.url)], keys=records, routes=[table])
        key = keys["main"][0]
        healthy, _ = asyncio.run(run_streams(east.url, key, TEXTS, MAX_TOKENS, extra=BODY))
        assert east_r.proc is not None
        moved, at = asyncio.run(
            run_streams(
                east.url, key, TEXTS, MAX_TOKENS, extra=BODY, kill=east_r.proc.kill, kill_after_chunks=3
            )
        )
        assert at is not None
        _check(healthy, moved)
        metrics = scrape(east.url)
        assert (
            sample(metrics, "fleet_gateway_stream_migrations_total", deployment=DEPLOYMENT, reason="reset")
            >= 1
        )
        assert sample(metrics, "fleet_gateway_forwarded_total", deployment=DEPLOYMENT, peer="west") >= 1
    finally:
        east.stop()
        west.stop()
