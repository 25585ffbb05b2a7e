"""Prefix-cache-aware routing, live: multi-turn chats through the gateway to 3 real
SmolLM2 replicas, least-load against prefix routing in the same run.

One local cluster: a real nats-server, the agent (process runtime: 3 `engine.server`
replicas of smollm2-135m, one torch thread each) relaying the replicas' KV events, and
two gateways on the same cluster state, one with `routing: least-load`, one with
`routing: prefix`. The workload is real ShareGPT conversations (their human turns; the
model writes the replies, greedy): every turn's prompt extends the previous one, behind
a shared system prompt. Phases:

1. least-load serves conversation set A;
2. prefix serves set B (same shape, other conversations; nothing of A's is shared, so
   neither phase starts with the other's prefixes cached);
3. prefix replays set A's requests: the greedy text must equal phase 1's.

TTFT is measured by the client (request sent -> first streamed token); the hit rate is
the engines' own (`fleet_engine_prefix_cache_hits_total / queries_total` over the phase).

    PYTHONPATH=. .venv/bin/python -m bench.prefix_routing --conversations 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import console, print_table, run_main
from bench.inputs import load_sharegpt_prompts, require_data_file
from control_plane.local.nats_server import NatsServer
from fleet_base import protocol
from fleet_base.api_keys import ApiKeyRecord, hash_secret, new_secret
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState
from fleet_base.nats_io import NatsLink, ensure_jetstream
from fleet_base.ports import free_port
from fleet_base.processes import stop_processes
from fleet_base.protocol import ClusterRoute, DesiredState, ReplicaSpec, RoutingTable

ROOT = Path(__file__).resolve().parents[1]
KEY_STATE_MAX_AGE_S = 24 * 3600.0
DEPLOYMENT = "chat"
SYSTEM = (
    "You are Fleet's support assistant. Answer briefly and precisely. Prefer plain words, "
    "give one example when it helps, and say so when you do not know. "
)


@dataclass
class Turn:
    conversation: int
    turn: int
    messages: list[dict]
    text: str = ""
    ttft_s: float = 0.0
    ok: bool = False


@dataclass
class Phase:
    name: str
    routing: str
    turns: list[Turn] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    wall_s: float = 0.0


def conversations(n: int, turns: int, skip: int, tag: str) -> list[list[str]]:
    """`n` real ShareGPT conversations with at least `turns` human turns (after `skip`)."""
    path = require_data_file("sharegpt_v3_filtered_500.json")
    convs = json.loads(path.read_text(encoding="utf-8"))
    out: list[list[str]] = []
    seen = 0
    for conv in convs:
        human = [
            t["value"][:600]
            for t in conv.get("conversations", [])
            if t.get("from") == "human" and t.get("value")
        ]
        if len(human) < turns:
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append([f"[{tag}] {human[0]}", *human[1:turns]])
        if len(out) == n:
            return out
    # Too few multi-turn conversations: pad with single prompts as follow-ups.
    singles = load_sharegpt_prompts()[skip * turns :]
    while len(out) < n:
        out.append([f"[{tag}] {s[:600]}" for s in singles[len(out) * turns : (len(out) + 1) * turns]])
    return out


class Fleet:
    """nats-server, the agent and two gateways (least-load, prefix) as child processes under
    one temp dir. Each deployment of `deployments` (name -> engine_args beyond
    `max_model_len`) runs `replicas` replicas; both gateways route every deployment."""

    def __init__(
        self,
        home: Path,
        replicas: int,
        max_model_len: int,
        deployments: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.home = home
        self.nats = NatsServer(home / "nats")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.replicas = replicas
        self.max_model_len = max_model_len
        self.deployments = dict(deployments or {DEPLOYMENT: {"kv_cache_memory": "384MiB"}})
        self.gateways: dict[str, str] = {}
        self.secret, self.record = _key()

    def _config(self, routing: str, port: int) -> Path:
        cfg = ClusterConfig.model_validate(
            {
                "cluster": "bench",
                "nats_url": self.nats.url,
                "state_dir": str(self.home / "state"),
                "cpu_slots": self.replicas * len(self.deployments),
                "gateway": {
                    "port": port,
                    "routing": routing,
                    "queue_timeout_s": 120,
                    # No control plane renews the key set's lease here: past the default 180 s a
                    # gateway would refuse (503 key_state_stale) a key it had not yet verified.
                    "key_state_max_age_s": KEY_STATE_MAX_AGE_S,
                },
                "replica": {
                    "extra_args": ["--threads", "1", "--log-level", "warning"],
                    "startup_timeout_s": 600,
                },
            }
        )
        path = self.home / f"cluster-{routing}.yaml"
        cfg.dump(path)
        return path

    def _spawn(self, args: list[str], log: str) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        with open(self.home / log, "wb") as f:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    cwd=ROOT,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    async def start(self) -> None:
        self.nats.start()
        link = NatsLink(self.nats.url, "bench-control")
        link.start()
        assert await link.wait_connected(15)
        assert link.nc is not None
        await ensure_jetstream(link.nc.jetstream())
        specs = [
            ReplicaSpec(
                replica_id=f"{name}-{i}",
                deployment=name,
                version=1,
                model="smollm2-135m",
                engine_args={"max_model_len": self.max_model_len, **args},
            )
            for name, args in self.deployments.items()
            for i in range(self.replicas)
        ]
        await link.kv_put(
            protocol.BUCKET_DESIRED, "bench", DesiredState(cluster="bench", generation=1, replicas=specs)
        )
        for name in self.deployments:
            await link.kv_put(
                protocol.BUCKET_ROUTES,
                name,
                RoutingTable(deployment=name, clusters=[ClusterRoute(cluster="bench")]),
            )
        await link.kv_put(protocol.BUCKET_KEYS, self.record.key_id, self.record)
        await link.close()
        self._spawn(["-m", "agent", "--config", str(self._config("prefix", free_port()))], "agent.log")
        for routing in ("least-load", "prefix"):
            port = free_port()
            self._spawn(
                ["-m", "agent.gateway", "--config", str(self._config(routing, port))],
                f"gateway-{routing}.log",
            )
            self.gateways[routing] = f"http://127.0.0.1:{port}"

    async def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            while True:
                ready = []
                for url in self.gateways.values():
                    try:
                        counts = (await client.get(url + "/health")).json()["ready_replicas"]
                        ready.append(min(counts.get(name, 0) for name in self.deployments))
                    except (httpx.HTTPError, ValueError, KeyError):
                        ready.append(0)
                if all(n == self.replicas for n in ready):
                    return
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"fleet not ready ({ready}); logs in {self.home}")
                await asyncio.sleep(1.0)

    def replica_urls(self, deployment: str = DEPLOYMENT) -> list[str]:
        snap = LocalState(self.home / "state").load_replicas()
        return [r.url for r in snap.replicas if r.deployment == deployment] if snap else []

    def stop(self) -> None:
        stop_processes(self.procs, 60)
        self.nats.stop()


def _key() -> tuple[str, ApiKeyRecord]:
    key_id, secret = new_secret()
    salt, digest = hash_secret(secret)
    return secret, ApiKeyRecord(key_id=key_id, name="bench", salt=salt, hash=digest, scopes=["inference"])


# Label values that split an engine counter into series worth keeping apart.
_SERIES_LABELS = ("tier", "direction")


def counters_from_metrics(text: str) -> dict[str, float]:
    """An engine's /metrics counters (`*_total`) by series, e.g.
    `fleet_engine_kv_tier_hits_total{tier=host}`; other labels (model) summed over."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            labels = ",".join(f"{k}={s.labels[k]}" for k in _SERIES_LABELS if k in s.labels)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


async def engine_counters(urls: list[str]) -> dict[str, float]:
    """`counters_from_metrics` summed over the replicas at `urls`."""
    total: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for url in urls:
            text = (await client.get(url.rstrip("/") + "/metrics")).text
            for key, value in counters_from_metrics(text).items():
                total[key] = total.get(key, 0.0) + value
    return total


async def engine_hits(urls: list[str]) -> tuple[float, float]:
    c = await engine_counters(urls)
    return c.get("fleet_engine_prefix_cache_hits_total", 0.0), c.get(
        "fleet_engine_prefix_cache_queries_total", 0.0
    )


async def ask(
    client: httpx.AsyncClient, url: str, key: str, turn: Turn, max_tokens: int, model: str = DEPLOYMENT
) -> None:
    body = {
        "model": model,
        "messages": turn.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    parts: list[str] = []
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status_code != 200:
            turn.text = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if not parts:
                        turn.ttft_s = time.perf_counter() - start
                    parts.append(piece)
    turn.text = "".join(parts)
    turn.ok = True


async def chat_phase(
    phase: Phase,
    url: str,
    key: str,
    convs: list[list[str]],
    max_tokens: int,
    concurrency: int,
    replay: list[Turn] | None = None,
) -> None:
    """Each conversation's turns in order (its next prompt holds the model's reply); the
    conversations run `concurrency` at a time. `replay` re-sends those exact prompts."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), trust_env=False) as client:

        async def conversation(i: int, users: list[str]) -> None:
            async with sem:
                messages: list[dict] = [{"role": "system", "content": SYSTEM}]
                for k, user in enumerate(users):
                    if replay is not None:
                        turn = Turn(i, k, replay[i * len(users) + k].messages)
                    else:
                        messages = [*messages, {"role": "user", "content": user}]
                        turn = Turn(i, k, messages)
                    await ask(client, url, key, turn, max_tokens)
                    phase.turns.append(turn)
                    messages = [*turn.messages, {"role": "assistant", "content": turn.text}]

        start = time.perf_counter()
        await asyncio.gather(*(conversation(i, users) for i, users in enumerate(convs)))
        phase.wall_s = time.perf_counter() - start
    phase.turns.sort(key=lambda t: (t.conversation, t.turn))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))] if s else float("nan")


async def run(ns: argparse.Namespace) -> int:
    home = Path(tempfile.mkdtemp(prefix="fleet-prefix-bench-"))
    fleet = Fleet(home, ns.replicas, ns.max_model_len)
    try:
        await fleet.start()
        console.print(f"fleet under {home}: waiting for {ns.replicas} SmolLM2 replicas ...")
        await fleet.wait_ready()
        urls = fleet.replica_urls()
        key = fleet.secret
        a = conversations(ns.conversations, ns.turns, 0, "A")
        b = conversations(ns.conversations, ns.turns, ns.conversations, "B")
        phases = [Phase("A", "least-load"), Phase("B", "prefix"), Phase("A again", "prefix")]
        for phase, convs in zip(phases, (a, b, a)):
            h0, q0 = await engine_hits(urls)
            replay = phases[0].turns if phase.name == "A again" else None
            console.print(f"phase {phase.name}: {phase.routing} ...")
            await chat_phase(
                phase, fleet.gateways[phase.routing], key, convs, ns.max_tokens, ns.concurrency, replay
            )
            h1, q1 = await engine_hits(urls)
            phase.hits, phase.queries = h1 - h0, q1 - q0
        rows = []
        for p in phases:
            ttft = [t.ttft_s for t in p.turns if t.ok and t.ttft_s > 0]
            later = [t.ttft_s for t in p.turns if t.ok and t.turn > 0 and t.ttft_s > 0]
            rows.append(
                [
                    f"{p.name} ({p.routing})",
                    sum(t.ok for t in p.turns),
                    pct(ttft, 50),
                    pct(ttft, 90),
                    statistics.mean(later) if later else float("nan"),
                    f"{100 * p.hits / p.queries:.1f}%" if p.queries else "-",
                    p.wall_s,
                ]
            )
        equal = sum(x.text == y.text and x.ok for x, y in zip(phases[0].turns, phases[2].turns))
        print_table(
            f"{ns.conversations} conversations x {ns.turns} turns, {ns.replicas} SmolLM2 replicas (1 thread each), "
            f"max_tokens {ns.max_tokens}, {ns.concurrency} conversations at a time",
            [
                "phase (routing)",
                "ok",
                "TTFT p50 s",
                "TTFT p90 s",
                "TTFT mean s (turns 2+)",
                "engine prefix hit rate",
                "wall s",
            ],
            rows,
            caption=f"greedy text equal under least-load and prefix: {equal}/{len(phases[0].turns)}  (machine: shared, loaded)",
        )
        ll, px = phases[0], phases[1]
        ttft_ll = [t.ttft_s for t in ll.turns if t.ok]
        ttft_px = [t.ttft_s for t in px.turns if t.ok]
        console.print(
            f"TTFT p50 least-load/prefix: {pct(ttft_ll, 50) / pct(ttft_px, 50):.2f}x, "
            f"p90: {pct(ttft_ll, 90) / pct(ttft_px, 90):.2f}x"
        )
        return 0 if equal == len(phases[0].turns) else 1
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    ns = p.parse_args(argv)
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(run_main(main))
