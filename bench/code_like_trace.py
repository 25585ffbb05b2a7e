"""A synthetic trace shaped like the Azure 2023 code trace: long prompts (lognormal around
2,000 tokens, 100..8,000), short outputs (lognormal around 25, 1..500), Poisson arrivals
whose rate swings between 1.5 and 6.5 requests/s over `period_s`. A guard that autoscaling
defaults hold on a workload unlike the conversation trace; it is not the real trace and
nothing is tuned to it.

    python -m bench.code_like_trace out.csv [--seconds 3600] [--seed 7]

Writes the Azure CSV columns (TIMESTAMP, ContextTokens, GeneratedTokens), so
`fleetctl simulate --trace out.csv` reads it like the real one."""

from __future__ import annotations

import argparse
import math
import random
from datetime import datetime, timedelta
from pathlib import Path


def generate(seconds: float, seed: int = 7, period_s: float = 2400.0) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens), in arrival order."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(4.0 + 2.5 * math.sin(2 * math.pi * t / period_s))
        if t >= seconds:
            return out
        prompt = int(min(8000, max(100, rng.lognormvariate(math.log(2000), 0.6))))
        output = int(min(500, max(1, rng.lognormvariate(math.log(25), 0.8))))
        out.append((t, prompt, output))


def write_csv(rows: list[tuple[float, int, int]], path: Path) -> None:
    base = datetime(2023, 11, 16, 18, 0, 0)
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for t, prompt, output in rows:
            stamp = (base + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f")
            f.write(f"{stamp},{prompt},{output}\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.code_like_trace", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    rows = generate(args.seconds, args.seed)
    write_csv(rows, args.out)
    print(f"wrote {len(rows)} requests over {args.seconds:g} s to {args.out}")


if __name__ == "__main__":
    main()
