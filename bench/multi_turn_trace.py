"""A synthetic multi-turn chat trace with prefix information, in Mooncake's JSONL shape
(`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token blocks), so
`fleetctl simulate --trace out.jsonl` reads it like the real one. A check of prefix
routing and of prefix-aware sizing on a workload other than the Mooncake file; it is not
a real trace and nothing is tuned to it.

- conversations start as Poisson arrivals whose rate swings between 0.2 and 0.6 per
  second over `period_s`; each belongs to one of `apps` applications, whose system
  prompt (lognormal around 1,500 tokens) every conversation of that app repeats;
- a conversation has a geometric number of turns (mean 4, at most 16); every turn's
  prompt is the previous prompt plus the model's reply plus a new user message
  (lognormal around 150 tokens), after a think time (lognormal around 30 s);
- replies are lognormal around 200 tokens (1..2,000);
- block ids are content addressed: a full block inside an app's system prompt has the
  same id in every conversation of that app, a full block of a conversation's history the
  same id in each of its later turns, and a prompt's partial last block is its own.

    python -m bench.multi_turn_trace out.jsonl [--seconds 3600] [--seed 11] [--apps 6]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from pathlib import Path

BLOCK_TOKENS = 512  # as Mooncake's hash_ids (control_plane.simulate.trace)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


class _BlockIds:
    """Content-addressed block ids: one integer per distinct (owner, block index)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[object, ...], int] = {}

    def __call__(self, *key: object) -> int:
        return self._ids.setdefault(key, len(self._ids))


def generate(
    seconds: float, seed: int = 11, apps: int = 6, period_s: float = 2400.0
) -> list[tuple[float, int, int, list[int]]]:
    """(arrival s, prompt tokens, output tokens, block ids), in arrival order."""
    rng = random.Random(seed)
    system = [_lognormal(rng, 1500, 0.7, 64, 8000) for _ in range(apps)]
    ids = _BlockIds()
    heap: list[tuple[float, int, int, int, int]] = []  # (at, conversation, turn, app, history)
    t, conv = 0.0, 0
    while True:  # conversation starts
        t += rng.expovariate(0.4 + 0.2 * math.sin(2 * math.pi * t / period_s))
        if t >= seconds:
            break
        app = rng.randrange(apps)
        heapq.heappush(heap, (t, conv, 0, app, system[app]))
        conv += 1
    out = []
    request = 0
    while heap:
        at, c, turn, app, history = heapq.heappop(heap)
        prompt = history + _lognormal(rng, 150, 0.9, 4, 4000)
        reply = _lognormal(rng, 200, 0.8, 1, 2000)
        blocks = []
        for i in range(math.ceil(prompt / BLOCK_TOKENS)):
            end = (i + 1) * BLOCK_TOKENS
            if end > prompt:
                blocks.append(ids("request", request))  # partial: this prompt's own
            elif end <= system[app]:
                blocks.append(ids("app", app, i))
            else:
                blocks.append(ids("conversation", c, i))
        out.append((at, prompt, reply, blocks))
        request += 1
        nxt = at + rng.lognormvariate(math.log(30), 0.8)
        if turn + 1 < 16 and rng.random() < 0.75 and nxt < seconds:
            heapq.heappush(heap, (nxt, c, turn + 1, app, prompt + reply))
    return out


def write_jsonl(rows: list[tuple[float, int, int, list[int]]], path: Path) -> None:
    with open(path, "w") as f:
        for at, prompt, output, blocks in rows:
            f.write(
                json.dumps(
                    {
                        "timestamp": round(at * 1000),
                        "input_length": prompt,
                        "output_length": output,
                        "hash_ids": blocks,
                    }
                )
                + "\n"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multi_turn_trace", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--apps", type=int, default=6)
    args = p.parse_args(argv)
    rows = generate(args.seconds, args.seed, args.apps)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} requests over {args.seconds:g} s to {args.out}")


if __name__ == "__main__":
    main()
