"""A hostile multi-turn chat trace with prefix information, in Mooncake's JSONL shape (as
`bench.multi_turn_trace` writes), for reading a KV tier and a router against their bound
on a workload harder than the real ones we have. Nothing is tuned to it.

What makes it hostile, each against a cache and a router:
- bursts: conversation starts are Poisson at a base rate, multiplied by `burst_x` during
  bursts (exponential lengths around `burst_s`, one every `burst_every_s` on average), so
  the busiest minute is several times the median one and queues form at any fleet size;
- heavy-tailed turns: `one_shot_share` of conversations are single requests, the rest have
  a Pareto turn count (alpha 1.3, capped at 80), so most are short and a few very long, and think times are lognormal with a long
  tail (median 20 s, sigma 1.5): a returning user often finds their history evicted;
- long shared prefixes: system prompts are lognormal around 4,000 tokens (sigma 1.0, up to
  24,000), the apps' popularity Zipf-like (a few apps carry most chats, many are rare), so
  the prefixes worth keeping are long and of very uneven value;
- pasted documents: user messages are lognormal around `message_tokens` with sigma 1.3 (up
  to 12,000), and a `doc_share` of conversations opens with a document of its own (lognormal
  around 6,000 tokens): long prompts only their own later turns reuse;
- cut histories: a conversation past `max_context` tokens drops its oldest turns, keeping
  the system prompt: its history is then a new chain nobody holds.

Block ids are content addressed as in `bench.multi_turn_trace`: a full block inside an
app's system prompt has one id for every conversation of that app, a full block of a
conversation's history the same id in its later turns (until the history is cut), and a
prompt's partial last block is its own.

    python -m bench.hostile_chat_trace out.jsonl [--seconds 7200] [--seed 5] [--rate 1.2]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from pathlib import Path

from bench.multi_turn_trace import BLOCK_TOKENS, _BlockIds, _lognormal, write_jsonl

MAX_TURNS = 80
PARETO_ALPHA = 1.3


def _starts(rng: random.Random, seconds: float, rate: float, burst_x: float, burst_s: float, every_s: float) -> list[float]:  # fmt: skip
    """Conversation starts: Poisson at `rate`, `burst_x` times that within bursts."""
    out: list[float] = []
    bursts: list[tuple[float, float]] = []
    t = rng.expovariate(1 / every_s)
    while t < seconds:
        length = rng.expovariate(1 / burst_s)
        bursts.append((t, t + length))
        t += length + rng.expovariate(1 / every_s)
    t = 0.0
    peak = rate * burst_x
    while True:  # thinning of a Poisson process at the peak rate
        t += rng.expovariate(peak)
        if t >= seconds:
            return out
        inside = any(a <= t < b for a, b in bursts)
        if inside or rng.random() < 1 / burst_x:
            out.append(t)


def generate(
    seconds: float = 7200.0,
    seed: int = 5,
    rate: float = 1.2,
    apps: int = 300,
    burst_x: float = 6.0,
    burst_s: float = 45.0,
    burst_every_s: float = 300.0,
    max_context: int = 32_000,
    doc_share: float = 0.7,
    message_tokens: float = 2000.0,
    turns_alpha: float = PARETO_ALPHA,
    one_shot_share: float = 0.75,
) -> list[tuple[float, int, int, list[int]]]:
    """(arrival s, prompt tokens, output tokens, block ids), in arrival order. The defaults
    are at least as hostile as the one real conversation trace we know of (an hour, 12k-token
    prompts on average, 37% ideal reuse, a sized fleet's device KV holding under 5% of its
    distinct blocks): ~16k-token prompts, ~4% of the distinct blocks on the sized fleet's
    devices; its ideal reuse is higher (~53%: the shared system prompts)."""
    rng = random.Random(seed)
    system = [_lognormal(rng, 4000, 1.0, 256, 24_000) for _ in range(apps)]
    weights = [1 / (i + 1) ** 1.1 for i in range(apps)]
    ids = _BlockIds()
    # (at, conversation, turn, turns, app, history tokens, epoch of the history's ids)
    heap: list[tuple[float, int, int, int, int, int, int]] = []
    for conv, t in enumerate(_starts(rng, seconds, rate, burst_x, burst_s, burst_every_s)):
        app = rng.choices(range(apps), weights)[0]
        turns = 1 if rng.random() < one_shot_share else min(MAX_TURNS, int(rng.paretovariate(turns_alpha)))
        heapq.heappush(heap, (t, conv, 0, turns, app, system[app], 0))
    out = []
    request = 0
    while heap:
        at, c, turn, turns, app, history, epoch = heapq.heappop(heap)
        message = _lognormal(rng, message_tokens, 1.3, 4, 12_000)
        if turn == 0 and rng.random() < doc_share:
            message += _lognormal(rng, 6000, 0.6, 500, 20_000)
        prompt = history + message
        if prompt > max_context:  # the client drops the oldest turns: a new history chain
            epoch += 1
            prompt = system[app] + (prompt - system[app]) // 3
        reply = _lognormal(rng, 250, 0.9, 1, 4000)
        blocks = []
        for i in range(math.ceil(prompt / BLOCK_TOKENS)):
            end = (i + 1) * BLOCK_TOKENS
            if end > prompt:
                blocks.append(ids("request", request))
            elif end <= system[app]:
                blocks.append(ids("app", app, i))
            else:
                blocks.append(ids("conversation", c, epoch, i))
        out.append((at, prompt, reply, blocks))
        request += 1
        nxt = at + rng.lognormvariate(math.log(20), 1.5)
        if turn + 1 < turns and nxt < seconds:
            heapq.heappush(heap, (nxt, c, turn + 1, turns, app, prompt + reply, epoch))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hostile_chat_trace", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--seconds", type=float, default=7200.0)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--rate", type=float, default=1.2, help="conversation starts per second outside bursts")
    args = p.parse_args(argv)
    rows = generate(args.seconds, args.seed, args.rate)
    write_jsonl(rows, args.out)
    prompts = sorted(r[1] for r in rows)
    print(
        f"wrote {len(rows)} requests over {args.seconds:g} s to {args.out} "
        f"(prompt tokens mean {sum(prompts) / len(prompts):,.0f}, p50 {prompts[len(prompts) // 2]:,}, "
        f"max {prompts[-1]:,})"
    )


if __name__ == "__main__":
    main()
