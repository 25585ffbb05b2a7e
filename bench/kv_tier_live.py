"""The host KV tier and tier-aware prefix routing, live: four arms in one run,
{tier off, tier on (host = `--host-x` x device)} x {least-load, prefix routing}, on three
real SmolLM2 replicas per tier setting behind the gateways of `bench.prefix_routing`'s
local fleet (one nats-server, one agent, a least-load and a prefix gateway; deployment
`kv-off` without a host tier, `kv-host` with one; the same device KV on both).

The workload is multi-turn chat whose working set is several times the fleet's device KV,
generated as hostile as `bench.hostile_chat_trace` (its burst process, Pareto turn counts,
Zipf app popularity), time-compressed to fit minutes: conversation starts in bursts; each
belongs to an app whose system prompt every conversation of that app repeats; lognormal
user messages (sigma 1.3) and pasted documents on some first turns; lognormal think times
with a long tail, so a returning user often finds their history evicted from the device;
histories past `--max-context` tokens drop their oldest turns (a new chain nobody holds).
Every turn's prompt is the system prompt plus the kept history (with the model's own
greedy replies) plus the new message. The text is real ShareGPT text.

Every arm sends the same plan (same lengths, same text, same timing, open loop), but its
system prompts start with the arm's own tag, so no arm finds another's prefixes cached.
The least-load arms run first on each deployment, so the prefix arms start with caches
full of the least-load arm's (useless) blocks, as a long-running replica's are.

TTFT is the client's (request sent -> first streamed token). Hit rates are the engines'
own over the arm: device and host from `fleet_engine_kv_tier_hits_total{tier}` (blocks x
block size) and the total from `fleet_engine_prefix_cache_hits_total`, each over
`fleet_engine_prefix_cache_queries_total` (prompt tokens looked up). Throughput is prompt
and generated tokens (the engines' counters) per second of the arm's wall time. Ratios are
to least-load with the tier off. It measures and prints; it asserts nothing about time.

    PYTHONPATH=. .venv/bin/python -m bench.kv_tier_live
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import console, print_table, run_main
from bench.hostile_chat_trace import PARETO_ALPHA, _starts
from bench.multi_turn_trace import _lognormal
from bench.prefix_routing import Fleet, Turn, ask, engine_counters, pct
from fleet_base.profile import load_profile

TIER_OFF, TIER_ON = "kv-off", "kv-host"
LEAST_LOAD, PREFIX = "least-load", "prefix"
BLOCK_SIZE = 16
PROFILE = "smollm2-135m-cpu"  # kv_bytes_per_token of SmolLM2-135M on CPU (float32)

Q_DEVICE = "fleet_engine_kv_tier_hits_total{tier=device}"
Q_HOST = "fleet_engine_kv_tier_hits_total{tier=host}"
Q_HITS = "fleet_engine_prefix_cache_hits_total"
Q_QUERIES = "fleet_engine_prefix_cache_queries_total"
Q_PROMPT = "fleet_engine_prompt_tokens_total"
Q_GENERATED = "fleet_engine_generation_tokens_total"
Q_PREEMPT = "fleet_engine_preemptions_total"


@dataclass(frozen=True)
class Arm:
    """One of the four: which deployment (tier off or on) through which gateway."""

    deployment: str
    routing: str

    @property
    def name(self) -> str:
        return f"tier {'on' if self.deployment == TIER_ON else 'off'}, {self.routing}"


# Run order: least-load first on each deployment (see the module docstring); arms[0] is the baseline.
ARMS = (Arm(TIER_OFF, LEAST_LOAD), Arm(TIER_ON, LEAST_LOAD), Arm(TIER_OFF, PREFIX), Arm(TIER_ON, PREFIX))


@dataclass(frozen=True)
class Shape:
    """The workload's knobs: hostile_chat_trace's distributions at minutes, not hours."""

    seed: int = 9
    seconds: float = 30.0  # span of conversation starts
    rate: float = 0.45  # starts per second outside bursts
    burst_x: float = 6.0
    burst_s: float = 5.0
    burst_every_s: float = 20.0
    apps: int = 12
    system_tokens: float = 300.0  # median, lognormal sigma 1.0
    message_tokens: float = 100.0  # median, lognormal sigma 1.3
    doc_share: float = 0.3  # first turns that open with a pasted document
    doc_tokens: float = 500.0  # median, lognormal sigma 0.6
    think_s: float = 2.5  # median, lognormal sigma 1.2
    max_think_s: float = 12.0
    max_turns: int = 8
    max_context: int = 1600  # prompt tokens a client keeps (system + history + message)
    reply_tokens: int = 16  # max_tokens of every turn


@dataclass(frozen=True)
class TurnPlan:
    think_s: float  # after the previous reply (0 for the first turn)
    user_tokens: int
    first_kept: int  # the oldest earlier turn still in the history


@dataclass(frozen=True)
class ConversationPlan:
    conversation: int
    app: int
    start_s: float
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class Workload:
    shape: Shape
    system_tokens: tuple[int, ...]  # per app
    conversations: tuple[ConversationPlan, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def prompt_tokens(self) -> list[int]:
        """Each request's prompt length as planned (replies at their full `reply_tokens`)."""
        out = []
        reply = self.shape.reply_tokens
        for c in self.conversations:
            for k, t in enumerate(c.turns):
                history = sum(c.turns[j].user_tokens + reply for j in range(t.first_kept, k))
                out.append(self.system_tokens[c.app] + history + t.user_tokens)
        return out

    def distinct_tokens(self) -> int:
        """Tokens of every distinct prefix chain: the working set an unlimited cache holds."""
        apps = {c.app for c in self.conversations}
        reply = self.shape.reply_tokens
        own = 0
        for c in self.conversations:
            for k, t in enumerate(c.turns):
                own += t.user_tokens + reply
                if k and t.first_kept != c.turns[k - 1].first_kept:  # a cut history: a new chain
                    own += sum(c.turns[j].user_tokens + reply for j in range(t.first_kept, k))
        return sum(self.system_tokens[a] for a in apps) + own


def plan_workload(shape: Shape) -> Workload:
    rng = random.Random(shape.seed)
    system = tuple(
        _lognormal(rng, shape.system_tokens, 1.0, 32, shape.max_context // 2) for _ in range(shape.apps)
    )
    weights = [1 / (i + 1) ** 1.1 for i in range(shape.apps)]
    starts = _starts(rng, shape.seconds, shape.rate, shape.burst_x, shape.burst_s, shape.burst_every_s)
    reply = shape.reply_tokens
    convs = []
    for n, start in enumerate(starts):
        app = rng.choices(range(shape.apps), weights)[0]
        count = min(shape.max_turns, int(rng.paretovariate(PARETO_ALPHA)))
        room = shape.max_context - system[app]
        turns: list[TurnPlan] = []
        for k in range(count):
            user = _lognormal(rng, shape.message_tokens, 1.3, 4, room)
            if k == 0 and rng.random() < shape.doc_share:
                user = min(room, user + _lognormal(rng, shape.doc_tokens, 0.6, 100, room))
            think = (
                0.0 if k == 0 else min(shape.max_think_s, rng.lognormvariate(math.log(shape.think_s), 1.2))
            )
            first = turns[-1].first_kept if turns else 0
            while first < k and sum(turns[j].user_tokens + reply for j in range(first, k)) + user > room:
                first += 1  # the client drops the oldest turn
            turns.append(TurnPlan(think, user, first))
        convs.append(ConversationPlan(n, app, start, tuple(turns)))
    return Workload(shape, system, tuple(convs))


class Texts:
    """Real text of about n tokens for each (kind, id): windows of one ShareGPT token
    stream at offsets derived from the key, so every arm gets the same text."""

    def __init__(self, stream: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self.stream = list(stream)
        self.decode = decode

    def __call__(self, n: int, *key: object) -> str:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        span = max(1, len(self.stream) - n)
        start = int.from_bytes(digest, "big") % span
        return self.decode(self.stream[start : start + n])


def load_texts() -> Texts:
    from bench.inputs import load_sharegpt_prompts, resolve_model
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model("smollm2-135m"))
    stream: list[int] = []
    for text in load_sharegpt_prompts():
        stream.extend(tok.encode(text + "\n\n", add_special_tokens=False))
        if len(stream) >= 200_000:
            break
    return Texts(stream, tok.decode)


def messages_for(
    workload: Workload, c: ConversationPlan, k: int, replies: Sequence[str], tag: str, texts: Texts
) -> list[dict[str, str]]:
    """Turn k's chat: the app's system prompt (behind the arm's tag), the kept history, the message."""
    out = [{"role": "system", "content": f"{tag} {texts(workload.system_tokens[c.app], 'system', c.app)}"}]
    for j in range(c.turns[k].first_kept, k):
        out.append({"role": "user", "content": texts(c.turns[j].user_tokens, "user", c.conversation, j)})
        out.append({"role": "assistant", "content": replies[j]})
    out.append({"role": "user", "content": texts(c.turns[k].user_tokens, "user", c.conversation, k)})
    return out


@dataclass
class ArmResult:
    arm: Arm
    turns: list[Turn] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # engine counter deltas over the arm
    wall_s: float = 0.0
    cut: bool = False  # stopped at the arm's time limit: turns not sent are missing from `turns`


async def run_arm(
    arm: Arm,
    tag: str,
    url: str,
    key: str,
    workload: Workload,
    texts: Texts,
    result: ArmResult,
    limit_s: float = math.inf,
) -> None:
    """The whole plan, open loop: each conversation starts at its time, each next turn a
    think time after the previous reply; cut at `limit_s`."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), trust_env=False) as client:

        async def conversation(c: ConversationPlan) -> None:
            await asyncio.sleep(c.start_s)
            replies: list[str] = []
            for k, t in enumerate(c.turns):
                await asyncio.sleep(t.think_s)
                turn = Turn(c.conversation, k, messages_for(workload, c, k, replies, tag, texts))
                try:
                    await ask(client, url, key, turn, workload.shape.reply_tokens, arm.deployment)
                except httpx.HTTPError as e:  # counted as not ok; the conversation goes on
                    turn.text = f"{type(e).__name__}: {e}"
                result.turns.append(turn)
                replies.append(turn.text)

        start = time.perf_counter()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(conversation(c) for c in workload.conversations)),
                None if math.isinf(limit_s) else limit_s,
            )
        except TimeoutError:
            result.cut = True
        result.wall_s = time.perf_counter() - start


def failures(r: ArmResult, most: int = 3) -> list[str]:
    """The arm's distinct failure texts (status and body, or the client's error), most common first."""
    counts: dict[str, int] = {}
    for t in r.turns:
        if not t.ok:
            counts[t.text[:300]] = counts.get(t.text[:300], 0) + 1
    return [f"{n}x {text}" for text, n in sorted(counts.items(), key=lambda kv: -kv[1])[:most]]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(b) else math.nan


def arm_row(r: ArmResult, base: ArmResult, block_size: int = BLOCK_SIZE) -> list[Any]:
    """One table row: TTFT, hit rates per tier, throughput, and the ratios to `base`."""

    def ttft(x: ArmResult, q: float) -> float:
        return pct([t.ttft_s for t in x.turns if t.ok and t.ttft_s > 0], q)

    def tok_s(x: ArmResult) -> float:
        return (
            (x.counters.get(Q_PROMPT, 0.0) + x.counters.get(Q_GENERATED, 0.0)) / x.wall_s
            if x.wall_s
            else math.nan
        )

    c = r.counters
    queries = c.get(Q_QUERIES, 0.0)

    def share(v: float) -> str:
        return f"{100 * v / queries:.1f}%" if queries else "-"

    return [
        r.arm.name + (" (cut)" if r.cut else ""),
        f"{sum(t.ok for t in r.turns)}/{len(r.turns)}",
        ttft(r, 50),
        ttft(r, 90),
        share(c.get(Q_DEVICE, 0.0) * block_size),
        share(c.get(Q_HOST, 0.0) * block_size),
        share(c.get(Q_HITS, 0.0)),
        int(c.get(Q_PREEMPT, 0.0)),
        tok_s(r),
        r.wall_s,
        ratio(ttft(r, 50), ttft(base, 50)),
        ratio(ttft(r, 90), ttft(base, 90)),
        ratio(tok_s(r), tok_s(base)),
    ]


HEADERS = [
    "arm",
    "ok",
    "TTFT p50 s",
    "TTFT p90 s",
    "hit device",
    "hit host",
    "hit total",
    "preempt",
    "tok/s (prompt+gen)",
    "wall s",
    "p50 / base",
    "p90 / base",
    "tok/s / base",
]


def print_results(results: Sequence[ArmResult], title: str, caption: str) -> None:
    base = results[0]
    print_table(title, HEADERS, [arm_row(r, base) for r in results], caption=caption)


def describe(workload: Workload, replicas: int, device_tokens: int, host_x: float) -> str:
    prompts = workload.prompt_tokens()
    distinct = workload.distinct_tokens()
    fleet_device = replicas * device_tokens
    reuse = 1 - distinct / sum(prompts) if prompts else 0.0
    return (
        f"{len(workload.conversations)} conversations, {workload.requests} requests (turns max "
        f"{max((len(c.turns) for c in workload.conversations), default=0)}), prompts mean "
        f"{sum(prompts) / max(1, len(prompts)):,.0f} / max {max(prompts, default=0):,} tokens; working set "
        f"{distinct:,} tokens = {distinct / fleet_device:.1f}x the fleet's device KV ({replicas} x "
        f"{device_tokens:,}), host tier {host_x:g}x device; ideal reuse ~{100 * reuse:.0f}% of prompt tokens"
    )


def max_model_len(max_context: int, max_tokens: int) -> int:
    """Room for the planned prompt, the chat template's tokens around each message and the reply."""
    return max_context + 256 + max_tokens


def engine_args(device_tokens: int, host_x: float, max_num_seqs: int) -> dict[str, dict[str, Any]]:
    """Both deployments' engine_args: the same device KV, a host tier on one."""
    device_bytes = device_tokens * load_profile(PROFILE).kv_bytes_per_token
    common = {"kv_cache_memory": device_bytes, "block_size": BLOCK_SIZE, "max_num_seqs": max_num_seqs}
    return {
        TIER_OFF: common,
        TIER_ON: {**common, "kv_offloading_size": host_x * device_bytes / (1 << 30)},
    }


async def run(ns: argparse.Namespace) -> int:
    shape = Shape(
        seed=ns.seed, seconds=ns.seconds, rate=ns.rate, reply_tokens=ns.max_tokens, max_context=ns.max_context
    )
    workload = plan_workload(shape)
    about = describe(workload, ns.replicas, ns.device_tokens, ns.host_x)
    console.print(about)
    about += f"; machine load average {os.getloadavg()[0]:.2f} before the fleet"
    texts = load_texts()
    home = Path(tempfile.mkdtemp(prefix="fleet-kv-tier-bench-"))
    fleet = Fleet(
        home,
        ns.replicas,
        max_model_len(ns.max_context, ns.max_tokens),
        engine_args(ns.device_tokens, ns.host_x, ns.max_num_seqs),
    )
    results = [ArmResult(arm) for arm in ARMS]
    try:
        await fleet.start()
        console.print(f"fleet under {home}: waiting for 2 x {ns.replicas} SmolLM2 replicas ...")
        started = time.perf_counter()
        await fleet.wait_ready()
        console.print(f"ready after {time.perf_counter() - started:.0f} s")
        urls = {d: fleet.replica_urls(d) for d in (TIER_OFF, TIER_ON)}
        warm = Workload(
            shape,
            workload.system_tokens,
            tuple(
                ConversationPlan(c.conversation, c.app, 0.0, c.turns[:1]) for c in workload.conversations[:3]
            ),
        )
        for arm in ARMS:  # code paths (engines, each gateway's tokenizer) warm; no arm's prefixes cached
            warmed = ArmResult(arm)
            await run_arm(arm, "[warm-up]", fleet.gateways[arm.routing], fleet.secret, warm, texts, warmed)
            for line in failures(warmed):
                console.print(f"  warm-up {arm.name} failed: {line}", markup=False)
        for i, result in enumerate(results):
            arm = result.arm
            console.print(f"arm {i + 1}/{len(results)}: {arm.name} ...")
            before = await engine_counters(urls[arm.deployment])
            url = fleet.gateways[arm.routing]
            await run_arm(arm, f"[run {i + 1}]", url, fleet.secret, workload, texts, result, ns.arm_limit)
            result.counters = delta(await engine_counters(urls[arm.deployment]), before)
            result.turns.sort(key=lambda t: (t.conversation, t.turn))
            console.print(
                f"  {sum(t.ok for t in result.turns)}/{len(result.turns)} ok in {result.wall_s:.0f} s"
            )
            for line in failures(result):
                console.print(f"  failed: {line}", markup=False)
        print_results(
            results,
            f"Host KV tier x routing, live: {ns.replicas} SmolLM2-135M replicas per arm (1 torch thread each), "
            f"max_tokens {ns.max_tokens}; ratios to {results[0].arm.name}",
            about,
        )
        return 0 if all(t.ok for r in results for t in r.turns) else 1
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3, help="per deployment (tier off, tier on)")
    p.add_argument("--device-tokens", type=int, default=2048, help="device KV per replica, in tokens")
    p.add_argument("--host-x", type=float, default=4.0, help="host tier size, times the device KV")
    p.add_argument("--max-context", type=int, default=Shape.max_context)
    p.add_argument("--max-tokens", type=int, default=Shape.reply_tokens)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seconds", type=float, default=Shape.seconds, help="span of conversation starts")
    p.add_argument(
        "--rate", type=float, default=Shape.rate, help="conversation starts per second outside bursts"
    )
    p.add_argument("--seed", type=int, default=Shape.seed)
    p.add_argument("--arm-limit", type=float, default=240.0, help="seconds before an arm is cut")
    ns = p.parse_args(argv)
    if ns.device_tokens < max_model_len(ns.max_context, ns.max_tokens):
        p.error(
            f"--device-tokens must hold one whole request ({max_model_len(ns.max_context, ns.max_tokens)})"
        )
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(run_main(main))
