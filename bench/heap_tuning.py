"""The C heap under a gateway's request mix, with `fleet_base.heap_trim.tune()`, each of its
two settings alone, and without.

Each side runs in a fresh process, one after the other (same seed): 16 concurrent tasks
read request bodies of heavy-tailed sizes (Pareto from 2 KiB, a few of them megabytes, as
hostile and long-context clients send), parse them with the gateway's own
`parse_off_loop` (large bodies on worker threads), keep the last 64 parsed requests alive
(the ones in flight) and a bounded history of small records (what a gateway keeps per
request), with the trimmer running every `--trim-s`. RSS is sampled every 1,000 requests;
the table gives it after the warm-up and at the end, the growth per 10k requests after the
warm-up (least squares) and the requests' wall time (what the mapped buffers cost), as the
median and range over `--repeat` runs of each side, in alternating order. Measures, never
asserts:

    PYTHONPATH=. python -m bench.heap_tuning --requests 20000 --warmup 4000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np

from bench.common import print_table, run_main

SAMPLE_EVERY = 1000


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _body(rng: random.Random) -> bytes:
    size = min(4 * 2**20, int(2048 * rng.paretovariate(1.1)))
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "lorem")) for _ in range(size // 6))
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 16, "stream": True}
    ).encode()


SIDES = {"glibc": (), "mmap_threshold": ("mmap_threshold",), "arena_max": ("arena_max",), "both": ("mmap_threshold", "arena_max")}  # fmt: skip


async def _child(side: str, requests: int, seed: int, trim_s: float) -> None:
    from agent.gateway.inputs import parse_off_loop
    from fleet_base import heap_trim

    applied = heap_trim.tune(SIDES[side]) if SIDES[side] else {}
    heap_trim.start(trim_s, tune_allocator=False)
    rng = random.Random(seed)
    in_flight: collections.deque = collections.deque(maxlen=64)
    history: collections.deque = collections.deque(maxlen=5000)
    samples: list[tuple[int, float]] = []
    done = 0
    lock = asyncio.Lock()

    async def worker() -> None:
        nonlocal done
        while True:
            async with lock:
                if done >= requests:
                    return
                done += 1
                n = done
                raw = _body(rng)
            chunks = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]  # as the server reads it
            info = await parse_off_loop(b"".join(chunks), "chat")
            in_flight.append(info)
            history.append(
                {"n": n, "tokens": info.prompt_tokens, "t": time.monotonic(), "id": f"req-{n:08d}"}
            )
            if n % SAMPLE_EVERY == 0:
                samples.append((n, _rss_mib()))
            await asyncio.sleep(0)

    began = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(16)))
    elapsed = time.monotonic() - began
    print(json.dumps({"applied": applied, "samples": samples, "elapsed_s": elapsed}))


def _run_side(side: str, ns: argparse.Namespace) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "FLEET_MALLOC"))
    }
    out = subprocess.run(
        [sys.executable, "-m", "bench.heap_tuning", "--child", side, "--requests", str(ns.requests),
         "--seed", str(ns.seed), "--trim-s", str(ns.trim_s)],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    measured = sorted((n, r) for n, r in result["samples"] if n >= ns.warmup)
    return {
        "applied": result["applied"],
        "warm": measured[0][1],
        "end": measured[-1][1],
        "growth": float(np.polyfit(*zip(*measured, strict=True), 1)[0]) * 10000,  # least squares
        "wall": result["elapsed_s"],
    }


def _spread(values: list[float], signed: bool = False) -> str:
    mid = statistics.median(values)
    f = "{:+.2f}" if signed else "{:.1f}"
    return (
        f.format(mid)
        if len(values) == 1
        else f"{f.format(mid)} ({f.format(min(values))} .. {f.format(max(values))})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60000)
    ap.add_argument("--warmup", type=int, default=10000, help="requests before growth is measured")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every side, the order reversed each time")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--trim-s", type=float, default=5.0)
    ap.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        asyncio.run(_child(ns.child, ns.requests, ns.seed, ns.trim_s))
        return 0
    if ns.requests < ns.warmup + 3 * SAMPLE_EVERY or ns.repeat < 1:
        ap.error(f"--requests must exceed --warmup by at least {3 * SAMPLE_EVERY}, and --repeat be >= 1")
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(ns.repeat):
        for side in list(SIDES) if r % 2 == 0 else list(reversed(SIDES)):
            runs[side].append(_run_side(side, ns))
    rows = [
        [
            "glibc defaults" if side == "glibc" else f"tune(): {got[0]['applied']}",
            *(_spread([g[k] for g in got], signed=k == "growth") for k in ("warm", "end", "growth", "wall")),
        ]
        for side, got in runs.items()
    ]
    print_table(
        f"{ns.requests} gateway-shaped requests, warm-up {ns.warmup}, trim every {ns.trim_s} s; "
        f"median (min .. max) of {ns.repeat} runs",
        ["allocator", "RSS after warm-up MiB", "RSS at end MiB", "growth MiB / 10k req", "requests' wall s"],
        rows,
        min_width=160,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
