"""Stream migration under a replica kill: the client-visible gap, ours vs a healthy run.

Two real SmolLM2 replicas behind a real gateway (and nats-server); `--streams` concurrent
greedy streams run once on the healthy fleet (the baseline: its largest inter-chunk delay
per stream), then again while one replica is SIGKILLed mid-stream. Every stream must
complete without an error event and with the healthy run's text; the table gives the
largest inter-chunk delay per stream (p50 / p99 / max over streams and runs), which for a
migrated stream is the gap of its hand-over. Run from a checkout:

    python -m bench.stream_migration --runs 3 --streams 12 --max-tokens 40

`LiveFleet` and `run_streams` are shared with the live test
(tests/agent/gateway/test_stream_migration_live.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.protocol import ApiKeyRecord
from control_plane.local.nats_server import NatsServer
from engine.server.process import ServerProcess

PROMPTS = [
    "Write one sentence about the history of {}.",
    "Explain in simple words how {} works.",
    "List three surprising facts about {}.",
    "Describe a day in the life of someone who studies {}.",
]
DEPLOYMENT = "smollm2"
TOPICS = [
    "rivers",
    "bread",
    "volcanoes",
    "bees",
    "glass",
    "clocks",
    "tea",
    "bridges",
    "maps",
    "salt",
    "owls",
    "ink",
]


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


@dataclass
class StreamResult:
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)
    error: dict | None = None
    usage: dict | None = None
    done: bool = False

    def max_gap(self, after: float | None = None) -> float:
        times = self.chunk_times
        gaps = [b - a for a, b in itertools.pairwise(times) if after is None or b >= after]
        return max(gaps, default=0.0)


async def _one(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    prompt: str,
    max_tokens: int,
    out: StreamResult,
    extra: dict[str, Any],
) -> StreamResult:
    body = {
        **extra,
        "model": extra.get("model", DEPLOYMENT),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            out.error = {"status": r.status_code, "body": (await r.aread()).decode(errors="replace")}
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                out.error = payload["error"]
                continue
            if payload.get("usage"):
                out.usage = payload["usage"]
            for c in payload.get("choices") or ():
                content = (c.get("delta") or {}).get("content")
                if content:
                    out.text += content
                    out.chunk_times.append(time.monotonic())
    return out


async def run_streams(
    url: str,
    key: str,
    texts: list[str],
    max_tokens: int,
    *,
    kill: Callable[[], None] | None = None,
    kill_after_chunks: int = 6,
    extra: dict[str, Any] | None = None,
) -> tuple[list[StreamResult], float | None]:
    """All streams at once; `kill` runs once every stream has `kill_after_chunks` content
    chunks (so it lands mid-stream everywhere). The results, and when `kill` ran."""
    killed_at: float | None = None
    results = [StreamResult() for _ in texts]
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        tasks = [
            asyncio.create_task(_one(client, url, key, t, max_tokens, out, extra or {}))
            for t, out in zip(texts, results, strict=True)
        ]
        while kill is not None and killed_at is None and not all(t.done() for t in tasks):
            if all(len(r.chunk_times) >= kill_after_chunks or r.done for r in results):
                kill()
                killed_at = time.monotonic()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
    return results, killed_at


class LiveFleet:
    """Two SmolLM2 replicas, a nats-server and a gateway routing to both (the state files
    written here, playing the agent). `kill(i)` SIGKILLs replica i."""

    def __init__(self, workdir: Path, key: tuple[str, ApiKeyRecord], max_model_len: int = 512) -> None:
        from tests.agent.gateway.harness import GatewayProcess

        self.workdir = workdir
        self.secret, self.record = key
        args = ["--served-model-name", DEPLOYMENT, "--max-model-len", str(max_model_len), "--threads", "1"]
        self.replicas = [
            ServerProcess(*args, model="smollm2-135m", log_path=workdir / f"r{i}.log") for i in range(2)
        ]
        self.nats = NatsServer(workdir / "nats")
        self.gateway = GatewayProcess(workdir / "gw", "east", nats_url="nats://127.0.0.1:1")

    def up(self) -> LiveFleet:
        errors: list[BaseException] = []

        def start(p: ServerProcess) -> None:
            try:
                p.start(timeout=300)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=start, args=(p,)) for p in self.replicas]
        for t in threads:
            t.start()
        self.nats.start()
        self.gateway.config.nats_url = self.nats.url
        self.gateway.start()
        for t in threads:
            t.join()
        if errors:
            self.down()
            raise errors[0]
        self.publish()
        return self

    def publish(self) -> None:
        from tests.agent.gateway.harness import peer, replica, route

        self.gateway.write(
            replicas=[replica(f"r{i}", p.url, deployment=DEPLOYMENT) for i, p in enumerate(self.replicas)],
            keys=[self.record],
            routes=[route(DEPLOYMENT, [peer("east", self.gateway.url, 40.7, -74.0)])],
        )

    def kill(self, i: int) -> None:
        proc = self.replicas[i].proc
        assert proc is not None
        proc.kill()

    def restart(self, i: int) -> None:
        self.replicas[i].stop(timeout=5)
        self.replicas[i].start(timeout=300)
        self.publish()

    def down(self) -> None:
        self.gateway.stop()
        for p in self.replicas:
            p.stop(timeout=10)
        self.nats.stop()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    from bench.common import print_table
    from tests.agent.gateway.harness import make_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    texts = prompts(args.streams)
    healthy_gaps: list[float] = []
    migrated_gaps: list[float] = []
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        fleet = LiveFleet(Path(tmp), make_key("bench")).up()
        try:
            for run in range(args.runs):
                healthy, _ = asyncio.run(run_streams(fleet.gateway.url, fleet.secret, texts, args.max_tokens))
                healthy_gaps += [r.max_gap() for r in healthy]
                killed, at = asyncio.run(
                    run_streams(
                        fleet.gateway.url, fleet.secret, texts, args.max_tokens, kill=lambda: fleet.kill(0)
                    )
                )
                migrated_gaps += [r.max_gap(after=at) for r in killed]
                failures += sum(
                    1
                    for h, k in zip(healthy, killed, strict=True)
                    if k.error or not k.done or k.text != h.text
                )
                print(f"run {run + 1}/{args.runs}: {failures} failed so far")
                if run + 1 < args.runs:
                    fleet.restart(0)
        finally:
            fleet.down()
    rows = [
        ["healthy (baseline)", f"{_pct(healthy_gaps, 0.5):.3f}", f"{_pct(healthy_gaps, 0.99):.3f}",
         f"{max(healthy_gaps, default=0):.3f}", "-"],
        ["replica SIGKILLed", f"{_pct(migrated_gaps, 0.5):.3f}", f"{_pct(migrated_gaps, 0.99):.3f}",
         f"{max(migrated_gaps, default=0):.3f}", f"{failures}"],
    ]  # fmt: skip
    print_table(
        f"Largest inter-chunk delay per stream, s ({args.runs} runs x {args.streams} streams)",
        ["run", "p50", "p99", "max", "streams failed or differing"],
        rows,
    )


if __name__ == "__main__":
    main()
