"""Stream migration under a replica kill, a drain and a rollout: the client-visible gap,
ours vs a healthy run.

`--streams` concurrent greedy streams through a real gateway, once on the healthy fleet
(the baseline: its largest inter-chunk delay per stream), then again while:

- kill: one of two real SmolLM2 replicas is SIGKILLed mid-stream;
- drain: it is told to stop (SIGTERM) and hands its streams over;
- rollout: `fleetctl rollout start` replaces every replica (`--rollout-replicas`) of a
  real fleet (control plane, agent with the process runtime: bench.rollout_fleet) while
  one worker per prompt keeps a stream of it in flight.

Every stream must complete without an error event and with the healthy run's text; the
table gives the largest inter-chunk delay per stream after the disruption (p50 / p99 /
max over streams and runs), which for a migrated stream is the gap of its hand-over. Run
from a checkout:

    python -m bench.stream_migration --runs 2 --streams 12 --max-tokens 40

`LiveFleet` and `run_streams` are shared with the live tests
(tests/agent/gateway/test_stream_migration_live.py, tests/e2e/test_stream_migration_rollout.py).
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

from control_plane.local.nats_server import NatsServer
from engine.server.process import ServerProcess
from fleet_base.api_keys import ApiKeyRecord

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
        args += ["--drain-handover", "0.3"]  # a SIGTERM hands the streams over at once
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


@dataclass
class Tally:
    """One scenario's figures over its runs: each stream's largest inter-chunk delay
    (after the disruption, for a disrupted run) and the streams that failed or differed."""

    gaps: list[float] = field(default_factory=list)
    failures: int = 0
    streams: int = 0

    def add(self, healthy: list[StreamResult], run: list[StreamResult], after: float | None) -> None:
        self.gaps += [r.max_gap(after=after) for r in run]
        self.streams += len(run)
        if healthy is not run:
            self.failures += sum(
                1 for h, r in zip(healthy, run, strict=True) if r.error or not r.done or r.text != h.text
            )

    def row(self, name: str) -> list[str]:
        return [
            name, f"{_pct(self.gaps, 0.5):.3f}", f"{_pct(self.gaps, 0.99):.3f}",
            f"{max(self.gaps, default=0):.3f}", str(self.streams), str(self.failures),
        ]  # fmt: skip


def _replica_runs(args: argparse.Namespace, texts: list[str], scenarios: list[str]) -> dict[str, Tally]:
    """kill (SIGKILL) and drain (SIGTERM: the replica hands its streams over) of replica 0
    of two, once every stream has 6 chunks; the replica is restarted between runs."""
    from tests.agent.gateway.harness import make_key

    out = {name: Tally() for name in ("healthy", *scenarios)}
    with tempfile.TemporaryDirectory() as tmp:
        fleet = LiveFleet(Path(tmp), make_key("bench")).up()
        try:
            for run in range(args.runs):
                for name in scenarios:
                    url, key = fleet.gateway.url, fleet.secret
                    healthy, _ = asyncio.run(run_streams(url, key, texts, args.max_tokens))
                    out["healthy"].add(healthy, healthy, None)
                    disrupt = (lambda: fleet.kill(0)) if name == "kill" else fleet.replicas[0].terminate
                    moved, at = asyncio.run(run_streams(url, key, texts, args.max_tokens, kill=disrupt))
                    out[name].add(healthy, moved, at)
                    print(f"run {run + 1}/{args.runs} {name}: {out[name].failures} failed so far")
                    fleet.restart(0)
        finally:
            fleet.down()
    return out


def _rollout_runs(args: argparse.Namespace, texts: list[str]) -> Tally:
    """Each run a real rollout (`fleetctl rollout start`, bench.rollout_fleet) that
    replaces every replica while one worker per text keeps a stream of it in flight; the
    gaps are those of the streams in flight when an old replica was given up, the
    reference the healthy run just before on the same fleet."""
    from bench.rollout_fleet import RolloutFleet

    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        fleet = RolloutFleet(Path(tmp), replicas=args.rollout_replicas).up()
        try:
            for run in range(args.runs):
                healthy, _ = fleet.streams(texts, args.max_tokens)
                through = fleet.streams_through_rollout(texts, args.max_tokens)
                moved = through.across_removal()
                tally.gaps += [r.max_gap() for r in moved]
                tally.streams += len(moved)
                tally.failures += sum(
                    1
                    for i, runs in enumerate(through.runs)
                    for r in runs
                    if r.error or not r.done or r.text != healthy[i].text
                )
                print(
                    f"run {run + 1}/{args.runs} rollout: {sum(map(len, through.runs))} streams, "
                    f"{len(moved)} across a removal, {tally.failures} failed so far"
                )
        finally:
            fleet.down()
    return tally


def main() -> None:
    from bench.common import print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--scenarios", default="kill,drain,rollout", help="any of kill, drain, rollout")
    ap.add_argument(
        "--rollout-replicas",
        type=int,
        default=1,
        help="replicas the rollout replaces (it runs twice as many SmolLM2 processes at its peak)",
    )
    args = ap.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - {"kill", "drain", "rollout"}
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    texts = prompts(args.streams)
    replica_scenarios = [s for s in scenarios if s != "rollout"]
    tallies = _replica_runs(args, texts, replica_scenarios) if replica_scenarios else {}
    if "rollout" in scenarios:
        tallies["rollout"] = _rollout_runs(args, texts)
    names = {
        "healthy": "healthy (baseline)",
        "kill": "replica SIGKILLed",
        "drain": "replica drained (SIGTERM)",
        "rollout": f"rollout replaces all {args.rollout_replicas} (streams across a removal)",
    }
    print_table(
        f"Largest inter-chunk delay per stream, s ({args.runs} runs x {args.streams} streams; "
        f"after the disruption for disrupted runs)",
        ["run", "p50", "p99", "max", "streams", "failed or differing"],
        [tally.row(names[name]) for name, tally in tallies.items()],
    )


if __name__ == "__main__":
    main()
