"""What routing pays to ask a replica's prefill wait, by queue length: the kept queue
(`kv_tier_cost.PendingPrefills`, its end kept as prefills are sent and done) against the
baseline, a fresh fold over the same prefills (`kv_tier_cost.queue_wait_s`), which is what
the gateway and the simulator did for every replica on every request.

Each round at a steady queue length sends one prefill, asks the wait as a routing decision
would, and completes the oldest, so the queue stays at its length; both sides see the same
prefills and must answer the same waits (checked, to 1e-9 s). A burst leaves queues hundreds
to thousands long, where the fold's cost grows with the queue and the kept end's does not.

    python -m bench.prefill_queue [--lengths 1,10,100,1000,5000] [--rounds 2000]

A benchmark: it measures and prints a table; it asserts no timing."""

from __future__ import annotations

import argparse
import random
import time

from rich.console import Console
from rich.table import Table

from fleet_base.kv_tier_cost import PendingPrefills, PrefillTiming, long_prefill_timing, queue_wait_s

TIMING = PrefillTiming(s_per_token=1e-4, step_s=0.03)


def measure(length: int, rounds: int, timing: PrefillTiming, seed: int = 1) -> tuple[float, float]:
    """Microseconds per routing ask (one send, one ask, one completion), kept and folded."""
    rng = random.Random(seed)
    kept, folded = PendingPrefills(), PendingPrefills()
    now, keys = 0.0, []
    for _ in range(length):
        now += rng.expovariate(20.0)
        tokens = rng.randint(16, 16_000)
        keys.append((kept.add(now, tokens), folded.add(now, tokens)))
    sends = []
    for _ in range(rounds):
        now += rng.expovariate(20.0)
        sends.append((now, rng.randint(16, 16_000)))

    started = time.perf_counter()
    kept_waits = []
    pending = list(keys)
    for at, tokens in sends:
        pending.append((kept.add(at, tokens), None))
        kept_waits.append(kept.wait_s(at, timing, short=timing.long_threshold > 0))
        kept.pop(pending.pop(0)[0])
    kept_us = (time.perf_counter() - started) / rounds * 1e6

    started = time.perf_counter()
    fold_waits = []
    pending = list(keys)
    for at, tokens in sends:
        pending.append((None, folded.add(at, tokens)))
        fold_waits.append(queue_wait_s(folded.items(), at, timing, short=timing.long_threshold > 0))
        folded.pop(pending.pop(0)[1])
    fold_us = (time.perf_counter() - started) / rounds * 1e6

    worst = max(abs(a - b) for a, b in zip(kept_waits, fold_waits, strict=True))
    if worst > 1e-9:
        raise SystemExit(f"the kept end differs from the fold by {worst:g} s at length {length}")
    return kept_us, fold_us


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1,10,100,1000,5000", help="queue lengths to hold")
    p.add_argument("--rounds", type=int, default=2000, help="routing asks per length")
    a = p.parse_args(argv)
    table = Table(title="A replica's prefill wait, asked per routing decision (us per ask)")
    for col in ("queue length", "timing", "kept end (ours)", "fold (baseline)", "fold / ours"):
        table.add_column(col, justify="right")
    for timing, name in ((TIMING, "no cap"), (long_prefill_timing(TIMING, 2048, 8192), "long-prefill cap")):
        for length in (int(x) for x in a.lengths.split(",")):
            ours, base = measure(length, a.rounds, timing)
            table.add_row(f"{length:,}", name, f"{ours:.1f}", f"{base:.1f}", f"{base / ours:.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
