"""A synthetic RAG pipeline trace (embed the question, then answer it with retrieved
passages), hostile on purpose: bursty arrivals (`bench.bursty_trace`'s on/off process,
Pareto gaps, per-burst rates) and heavy-tailed costs in every step: the question lognormal,
the passages retrieved Pareto (a few requests drag in many), the answers lognormal with a
long tail. Not a real trace and nothing is tuned to it; use several seeds.

    python -m bench.pipeline_trace out.jsonl [--duration-s 1800] [--seed 1] [--shape dense]

Writes `fleetctl simulate`'s pipeline trace format (JSON lines, `steps` in call order:
`control_plane.simulate.trace.load_pipeline_trace`), so `fleetctl simulate --trace out.jsonl
--slo-e2e 4s` replays it."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from bench.bursty_trace import SHAPES, _lognormal, _pareto, generate

PASSAGE_TOKENS = 256
MAX_PASSAGES = 24


def pipeline_rows(seconds: float, seed: int = 1, shape: str = "dense") -> list[dict[str, object]]:
    """One pipeline request per arrival of the bursty process; the same for the same arguments."""
    rng = random.Random(f"pipeline/{seed}")
    out = []
    for at, _, _ in generate(seconds, seed, shape):
        question = _lognormal(rng, 60, 0.8, 4, 2048)
        passages = int(_pareto(rng, 1.0, 1.2, MAX_PASSAGES))
        answer = _lognormal(rng, 180, 1.0, 1, 2048)
        out.append(
            {
                "at": round(at, 4),
                "steps": [
                    {"step": "embed", "prompt_tokens": question, "output_tokens": 1},
                    {"step": "answer", "prompt_tokens": question + passages * PASSAGE_TOKENS + 64,
                     "output_tokens": answer},
                ],
            }
        )  # fmt: skip
    return out


def write_jsonl(rows: list[dict[str, object]], path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("out", type=Path)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shape", choices=sorted(SHAPES), default="dense")
    args = p.parse_args(argv)
    rows = pipeline_rows(args.duration_s, args.seed, args.shape)
    write_jsonl(rows, args.out)
    answer = sorted(int(r["steps"][1]["prompt_tokens"]) for r in rows)  # type: ignore[index]
    q = lambda x: answer[min(len(answer) - 1, math.floor(x * len(answer)))] if answer else 0  # noqa: E731
    print(f"wrote {len(rows)} pipeline requests over {args.duration_s:g} s to {args.out} ({args.shape}, "
          f"seed {args.seed}): answer prompt p50 {q(0.5)} / p90 {q(0.9)} / p99 {q(0.99)} tokens")  # fmt: skip


if __name__ == "__main__":
    main()
