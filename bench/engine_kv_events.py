"""What reading a vLLM replica's KV events costs the agent, against its bound.

Batches are laid out as vLLM publishes them (msgspec map structs, 32-byte hashes, the cache
salt in the first block's `extra_keys`): one batch per scheduler step holding the newly full
blocks of `--requests-per-step` prompts, the prompts' lengths heavy-tailed (lognormal,
median 512 tokens, capped at 32k), a third of them continuing an earlier prompt (a parent in the
map), and token ids from a 128k vocabulary. Three rows:

- bound: Fleet's own hashing of the same token ids (`hash_block`), the work no translation
  can skip;
- translate: msgpack decode + `FleetHashTranslator` (what the follower does per batch);
- over ZMQ: the same batches from a PUB on loopback through `EngineKvFollower` into the
  relay's publish path (a stand-in NATS link that only counts), with the event loop's
  largest stall measured by a 10 ms ticker.

Then a flood: 10^6 removal events in 1000 batches (inside every bound), the stall and the rate.

    PYTHONPATH=. .venv/bin/python -m bench.engine_kv_events
    PYTHONPATH=. .venv/bin/python -m bench.engine_kv_events --steps 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from agent.engine_kv_subscriber import EngineKvEndpoints, EngineKvFollower
from agent.engine_kv_translate import FleetHashTranslator, Op
from bench.engine_kv_layouts import MBatch as Batch
from bench.engine_kv_layouts import MRemoved as BlockRemoved
from bench.engine_kv_layouts import MStored as BlockStored
from fleet_base.block_hash import hash_block, root_hash
from fleet_base.engine_kv_events import decode_engine_events

BS = 16
VOCAB = 128_256


def workload(steps: int, per_step: int, seed: int) -> tuple[list[bytes], int]:
    """Encoded batches and the number of blocks they store."""
    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    tails: list[bytes] = []  # engine hashes of earlier prompts' last blocks
    out, blocks = [], 0
    for step in range(steps):
        events = []
        for _ in range(per_step):
            n = max(1, min(2048, int(rng.lognormvariate(3.47, 1.0))))  # blocks; median 32 (512 tokens)
            tokens = [rng.randrange(VOCAB) for _ in range(n * BS)]
            parent = rng.choice(tails) if tails and rng.random() < 1 / 3 else None
            hashes, prev = [], parent
            for i in range(n):
                prev = hashlib.sha256(repr((prev, tokens[i * BS : (i + 1) * BS])).encode()).digest()
                hashes.append(prev)
            extra = [["salt-key-a"] if parent is None else None] + [None] * (n - 1)
            events.append(BlockStored(hashes, parent, tokens, BS, None, "GPU", None, extra))
            tails.append(hashes[-1])
            blocks += n
        out.append(enc.encode(Batch(ts=float(step), events=events)))
    return out, blocks


def bound_rate(payloads: list[bytes]) -> float:
    """Blocks/s of Fleet's hashing alone over the same token ids (parents taken as roots)."""
    decoded = [decode_engine_events(p) for p in payloads]
    start = time.perf_counter()
    n = 0
    root = root_hash("salt-key-a")
    for batch in decoded:
        for e in batch.events:
            parent = root
            for i in range(len(e.block_hashes)):
                parent = hash_block(parent, e.token_ids[i * BS : (i + 1) * BS])
                n += 1
    return n / (time.perf_counter() - start)


def translate_rate(payloads: list[bytes]) -> tuple[float, Counter[str]]:
    t = FleetHashTranslator()
    outcomes: Counter[str] = Counter()
    start = time.perf_counter()
    for p in payloads:
        outcomes.update(t.apply(decode_engine_events(p).events).outcomes)
    return outcomes["stored"] / (time.perf_counter() - start), outcomes


async def over_zmq(payloads: list[bytes]) -> tuple[float, float, Counter[tuple[str, str]]]:
    """(seconds, the loop's largest stall in s, counts) through a real socket pair."""
    endpoints = EngineKvEndpoints()
    ipc_dir = tempfile.mkdtemp(prefix="fleet-kv-bench-")
    e = endpoints.endpoint_for("bench", "vllm", Path(ipc_dir))
    assert e is not None
    _, sub = endpoints.get("bench") or (None, None)
    assert sub is not None
    counts: Counter[tuple[str, str]] = Counter()

    async def publish(ops: list[Op], snapshot: bool, block_size: int) -> bool:
        return True

    follower = EngineKvFollower("bench", "vllm", sub, None, publish, counts=counts, ctx=endpoints.ctx)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(e.publish)  # an ipc:// endpoint: the engine binds it
    stalls: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            stalls.append(time.perf_counter() - t - 0.01)

    run = asyncio.create_task(follower.run())
    tick = asyncio.create_task(ticker())
    seq = 0
    while not counts[("vllm", "batches")]:  # the subscription reached the PUB
        await pub.send_multipart(
            [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode(Batch(0.0, []))]
        )
        seq += 1
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    counts.clear()
    start = time.perf_counter()
    for p in payloads:
        await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), p])
        seq += 1
    want, deadline = len(payloads), time.perf_counter() + 300
    done = ("batches", "rate", "invalid", "oversize")
    while sum(counts[("vllm", k)] for k in done) < want and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - start
    for task in (run, tick):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    ctx.destroy(linger=0)
    endpoints.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)
    return elapsed, max(stalls, default=0.0), counts


def flood(events: int, per_batch: int) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    return [
        enc.encode(Batch(ts=0.0, events=[BlockRemoved([i * per_batch + j], "GPU") for j in range(per_batch)]))
        for i in range(events // per_batch)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--requests-per-step", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    payloads, blocks = workload(args.steps, args.requests_per_step, args.seed)
    mib = sum(map(len, payloads)) / 2**20
    print(f"workload: {len(payloads)} batches, {blocks} blocks of {BS} tokens, {mib:.1f} MiB of msgpack")
    bound = bound_rate(payloads)
    rate, outcomes = translate_rate(payloads)
    elapsed, stall, counts = asyncio.run(over_zmq(payloads))
    zmq_rate = counts[("vllm", "stored")] / elapsed
    print(f"\n{'row':<28}{'blocks/s':>12}{'us/block':>10}{'x bound':>9}{'max stall ms':>14}")
    for name, r, s in (
        ("bound: Fleet hashing only", bound, None),
        ("translate (decode+rehash)", rate, None),
        ("over ZMQ (follower)", zmq_rate, stall),
    ):
        stall_ms = "" if s is None else f"{s * 1000:.1f}"
        print(f"{name:<28}{r:>12,.0f}{1e6 / r:>10.2f}{bound / r:>9.2f}{stall_ms:>14}")
    placed = outcomes["stored"] / blocks
    print(f"\ntranslated blocks placed: {placed:.3f} (unknown parents: {outcomes['unknown_parent']})")
    rate_refused = counts[("vllm", "rate")]
    print(f"over ZMQ: batches refused by the per-replica budget: {rate_refused}")
    storm = flood(10**6, 1000)
    storm_s, storm_stall, storm_counts = asyncio.run(over_zmq(storm))
    applied = storm_counts[("vllm", "batches")]
    print(
        f"\nflood: 10^6 removals in {len(storm)} batches over ZMQ: {applied} batches applied, "
        f"{storm_counts[('vllm', 'rate')]} refused (budget), "
        f"{storm_counts[('vllm', 'unknown_block')]:,} removals dropped (unknown) in {storm_s:.1f} s "
        f"({storm_counts[('vllm', 'unknown_block')] / storm_s:,.0f} events/s), "
        f"max loop stall {storm_stall * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
