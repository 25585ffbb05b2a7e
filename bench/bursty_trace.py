"""A synthetic trace shaped like a coding assistant's traffic, which comes in bursts: on/off
arrivals, bursts of tens of seconds separated by minutes of near-silence, the gaps heavy-tailed,
the prompts inside a burst long, over a low background. A smooth synthetic trace (as
`bench.code_like_trace`) hides what bursts do to an autoscaler: it scales down in each lull and
meets the next burst cold. It is not a real trace and nothing is tuned to it; use several seeds.

The process, per named shape (`SHAPES`):

- background: Poisson arrivals at `background_rps`, prompts lognormal around
  `background_prompt` tokens;
- bursts alternate with gaps: a gap is Pareto (`gap_min_s`, tail index `gap_alpha`,
  truncated at `gap_max_s`: a few lulls last many minutes), a burst lasts lognormal around
  `burst_s` seconds;
- within a burst, Poisson arrivals at a rate drawn per burst (lognormal around `burst_rps`);
  each burst draws its own typical prompt (lognormal around `burst_prompt`: a repository's
  context), its requests lognormal around that;
- outputs are short (lognormal around `output`, at most `output_max`).

`code` (the default) puts the busiest 10-second windows' prompt tokens at about 10-15x the
trace's mean (about 5k prompt tokens/s), the gaps at one to a few minutes. `sharp`: rarer,
harder bursts after longer lulls (peaks well above 15x). `dense`: bursts every half minute to
two, many lulls shorter than a 60 s cold start.

    python -m bench.bursty_trace out.csv [--duration-s 3600] [--seed 1] [--shape code]

Writes the Azure CSV columns (TIMESTAMP, ContextTokens, GeneratedTokens), so
`fleetctl simulate --trace out.csv` reads it like the real ones, and prints the statistics
above (`describe`)."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from bench.code_like_trace import write_csv

Row = tuple[float, int, int]  # (arrival s, prompt tokens, output tokens)
PROMPT_MAX = 32_768  # the profiles' longest measured prefill


@dataclass(frozen=True)
class BurstShape:
    background_rps: float
    background_prompt: float
    burst_rps: float
    burst_rps_sigma: float
    burst_s: float
    burst_s_sigma: float
    burst_prompt: float
    burst_prompt_sigma: float  # between bursts (each burst's own typical prompt)
    prompt_sigma: float  # between the requests of one burst
    gap_min_s: float
    gap_alpha: float
    gap_max_s: float
    output: float = 30.0
    output_max: int = 1000


SHAPES: dict[str, BurstShape] = {
    "code": BurstShape(
        background_rps=0.5,
        background_prompt=1200,
        burst_rps=9.0,
        burst_rps_sigma=0.25,
        burst_s=20.0,
        burst_s_sigma=0.5,
        burst_prompt=2500,
        burst_prompt_sigma=0.25,
        prompt_sigma=0.6,
        gap_min_s=60.0,
        gap_alpha=1.5,
        gap_max_s=1200.0,
    ),
    "sharp": BurstShape(
        background_rps=0.3,
        background_prompt=1200,
        burst_rps=16.0,
        burst_rps_sigma=0.4,
        burst_s=12.0,
        burst_s_sigma=0.5,
        burst_prompt=3000,
        burst_prompt_sigma=0.4,
        prompt_sigma=0.6,
        gap_min_s=120.0,
        gap_alpha=1.3,
        gap_max_s=1800.0,
    ),
    "dense": BurstShape(
        background_rps=0.5,
        background_prompt=1200,
        burst_rps=6.0,
        burst_rps_sigma=0.35,
        burst_s=15.0,
        burst_s_sigma=0.5,
        burst_prompt=2500,
        burst_prompt_sigma=0.35,
        prompt_sigma=0.6,
        gap_min_s=25.0,
        gap_alpha=1.8,
        gap_max_s=600.0,
    ),
}


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def _pareto(rng: random.Random, lo: float, alpha: float, hi: float) -> float:
    return min(hi, lo * rng.paretovariate(alpha))


def bursts(seconds: float, seed: int = 1, shape: str = "code") -> list[tuple[float, float]]:
    """(start s, end s) of each burst: the on periods, in order (the first after a gap)."""
    s = SHAPES[shape]
    rng = random.Random(f"bursts/{seed}")
    out, t = [], 0.0
    while True:
        t += _pareto(rng, s.gap_min_s, s.gap_alpha, s.gap_max_s)
        if t >= seconds:
            return out
        end = min(seconds, t + rng.lognormvariate(math.log(s.burst_s), s.burst_s_sigma))
        out.append((t, end))
        t = end


def generate(seconds: float, seed: int = 1, shape: str = "code") -> list[Row]:
    """(arrival s, prompt tokens, output tokens), in arrival order; the same for the same
    (seconds, seed, shape). Separate random streams for the schedule, the background and the
    bursts' contents, so changing one part of a shape does not reshuffle the others."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    s = SHAPES[shape]
    rows: list[Row] = []
    bg = random.Random(f"background/{seed}")
    t = 0.0
    while s.background_rps > 0:
        t += bg.expovariate(s.background_rps)
        if t >= seconds:
            break
        rows.append(
            (
                t,
                _lognormal(bg, s.background_prompt, 0.8, 16, PROMPT_MAX),
                _lognormal(bg, s.output, 1.0, 1, s.output_max),
            )
        )
    rng = random.Random(f"burst-contents/{seed}")
    for start, end in bursts(seconds, seed, shape):
        rate = rng.lognormvariate(math.log(s.burst_rps), s.burst_rps_sigma)
        typical = rng.lognormvariate(math.log(s.burst_prompt), s.burst_prompt_sigma)
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            rows.append(
                (
                    t,
                    _lognormal(rng, typical, s.prompt_sigma, 64, PROMPT_MAX),
                    _lognormal(rng, s.output, 1.0, 1, s.output_max),
                )
            )
    rows.sort()
    return rows


@dataclass(frozen=True)
class TraceStats:
    requests: int
    prompt_tokens_per_s: float  # the trace's mean
    peak_10s_ratio: float  # the busiest 10 s window's prompt tokens/s over the mean
    gap_median_s: float  # between bursts, as the trace shows them (`busy_windows`)
    gap_p90_s: float
    burst_prompt_mean: float  # mean prompt of requests in busy windows
    quiet_prompt_mean: float  # ... and in the others


def window_tokens(rows: list[Row], seconds: float, window_s: float = 10.0) -> list[int]:
    """Prompt tokens arriving in each window of `window_s`, from 0 to `seconds`."""
    out = [0] * max(1, math.ceil(seconds / window_s))
    for t, prompt, _ in rows:
        out[min(len(out) - 1, int(t // window_s))] += prompt
    return out


def describe(rows: list[Row], seconds: float, window_s: float = 10.0) -> TraceStats:
    """What the trace shows, measured on it (not on the generator's parameters): a window is
    busy when its prompt tokens exceed 3x the mean; a gap is a run of quiet windows between
    two busy ones."""
    windows = window_tokens(rows, seconds, window_s)
    mean = sum(windows) / len(windows)
    busy = [w > 3 * mean for w in windows]
    gaps, run, seen = [], 0, False
    for b in busy:
        if b:
            if seen and run:
                gaps.append(run * window_s)
            seen, run = True, 0
        else:
            run += 1
    gaps.sort()

    def q(p: float) -> float:
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else math.nan

    inside = [p for t, p, _ in rows if busy[min(len(busy) - 1, int(t // window_s))]]
    outside = [p for t, p, _ in rows if not busy[min(len(busy) - 1, int(t // window_s))]]
    return TraceStats(
        requests=len(rows),
        prompt_tokens_per_s=mean / window_s,
        peak_10s_ratio=max(windows) / mean if mean else math.nan,
        gap_median_s=q(0.5),
        gap_p90_s=q(0.9),
        burst_prompt_mean=sum(inside) / len(inside) if inside else math.nan,
        quiet_prompt_mean=sum(outside) / len(outside) if outside else math.nan,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.bursty_trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", type=Path)
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shape", choices=sorted(SHAPES), default="code")
    args = p.parse_args(argv)
    rows = generate(args.duration_s, args.seed, args.shape)
    write_csv(rows, args.out)
    st = describe(rows, args.duration_s)
    print(
        f"wrote {len(rows)} requests over {args.duration_s:g} s to {args.out} ({args.shape}, seed {args.seed}): "
        f"{st.prompt_tokens_per_s:,.0f} prompt tok/s mean, busiest 10 s {st.peak_10s_ratio:.1f}x the mean, "
        f"gaps between bursts median {st.gap_median_s:g} s / p90 {st.gap_p90_s:g} s, "
        f"mean prompt {st.burst_prompt_mean:,.0f} in bursts / {st.quiet_prompt_mean:,.0f} between"
    )


if __name__ == "__main__":
    main()
