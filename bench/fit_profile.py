"""Fit a simulated-replica profile (`fleet_base.profile.PerfProfile`) to a running engine
replica by measuring it over HTTP, so `runtime: sim` and `fleetctl simulate` can stand in
for our own engine.

    python -m bench.fit_profile --url http://127.0.0.1:8000 --name smollm2-135m-cpu
    python -m bench.fit_profile --launch --model smollm2-135m --name smollm2-135m-cpu -- --threads 2

- prefill: time of a request with a P-token prompt (token ids) and max_tokens 1, for
  each P in --prompt-sizes: prefill plus a fixed HTTP overhead;
- decode step: B concurrent streams (short prompts, ignore_eos) generating
  --decode-tokens tokens each; the step time at batch B is the median over the streams
  of (last token - first token) / (tokens - 1);
- each point is the best of --repeats runs: on a shared machine, other load only ever
  makes a run slower;
- cold start: with --launch, the time from starting `python -m engine.server` to its
  first 200 on /health (else --cold-start);
- KV capacity and batch limit: --kv-capacity-tokens / --max-num-seqs (the engine's own
  limits; defaults: max_model_len x the largest batch measured, and that batch).

Prints what it measured as a table and writes the profile JSON (default
fleet_base/profiles/<name>.json). It measures; it never asserts timings."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from fleet_base.profile import PROFILES_DIR, PerfProfile


async def _completion(
    client: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int
) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t


async def _stream_step(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> float | None:
    body = {"model": model, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    if len(stamps) < 2:
        return None
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def measure(
    url: str, model: str, prompt_sizes: list[int], batches: list[int], decode_tokens: int, repeats: int
) -> tuple[dict[int, float], dict[int, float], int]:
    async with httpx.AsyncClient(timeout=600) as client:
        card = (await client.get(f"{url}/v1/models")).json()["data"][0]
        model = model or card["id"]
        max_len = int(card.get("max_model_len") or 2048)
        await _completion(client, url, model, [1] * 8, 2)  # warm-up
        prefill: dict[int, float] = {}
        for p in prompt_sizes:
            ids = [(i % 200) + 1 for i in range(min(p, max_len - 2))]
            prefill[p] = min([await _completion(client, url, model, ids, 1) for _ in range(repeats)])
        decode: dict[int, float] = {}
        for b in batches:
            runs = []
            for _ in range(repeats):
                steps = await asyncio.gather(
                    *(_stream_step(client, url, model, decode_tokens) for _ in range(b))
                )
                good = [s for s in steps if s is not None]
                if good:
                    runs.append(statistics.median(good))
            if runs:
                decode[b] = min(runs)
        return prefill, decode, max_len


def fit(
    name: str,
    prefill: dict[int, float],
    decode: dict[int, float],
    *,
    kv_capacity_tokens: int,
    max_num_seqs: int,
    cold_start_s: float,
    description: str,
    gpu_model: str = "cpu",
    hourly_price: float = 0.0,
) -> PerfProfile:
    """The measured points as a profile; a later point never below an earlier one, so
    noise cannot make a bigger prompt or batch look faster."""

    def monotone(points: dict[int, float]) -> tuple[list[float], list[float]]:
        xs = sorted(points)
        ys: list[float] = []
        for x in xs:
            ys.append(round(max([points[x], *ys[-1:]]), 6))
        return [float(x) for x in xs], ys

    px, py = monotone(prefill)
    dx, dy = monotone(decode)
    return PerfProfile(
        name=name,
        description=description,
        source="bench.fit_profile (measured over HTTP)",
        gpu_model=gpu_model,
        hourly_price=hourly_price,
        prefill_tokens=px,
        prefill_s=py,
        decode_batch=dx,
        decode_step_s=dy,
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=max_num_seqs,
        max_prefill_tokens=int(max(px)),
        cold_start_s=round(cold_start_s, 2),
    )


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m bench.fit_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", help="a running replica (else --launch)")
    p.add_argument(
        "--launch", action="store_true", help="start `python -m engine.server --model M` and time it"
    )
    p.add_argument("--model", default="", help="served model name (--url) or model to launch")
    p.add_argument("--name", required=True, help="profile name")
    p.add_argument("--prompt-sizes", default="16,64,256,1024")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--cold-start", type=float, default=0.0)
    p.add_argument("--gpu-model", default="cpu")
    p.add_argument("--hourly-price", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.url and not args.launch:
        p.error("give --url of a running replica or --launch")
    prompt_sizes, batches = _ints(args.prompt_sizes), _ints(args.batches)
    server = None
    cold = args.cold_start
    url = args.url
    if args.launch:
        from engine.server.process import ServerProcess  # bench may import the engine

        t = time.perf_counter()
        server = ServerProcess(*extra, model=args.model or "smollm2-135m").start()
        cold = time.perf_counter() - t
        url = server.url
    try:
        prefill, decode, max_len = asyncio.run(
            measure(
                url,
                "" if args.launch else args.model,
                prompt_sizes,
                batches,
                args.decode_tokens,
                args.repeats,
            )
        )
    finally:
        if server is not None:
            server.stop()
    seqs = args.max_num_seqs or max(batches)
    prof = fit(
        args.name,
        prefill,
        decode,
        kv_capacity_tokens=args.kv_capacity_tokens or max_len * seqs,
        max_num_seqs=seqs,
        cold_start_s=cold,
        description=f"fitted to {args.model or url} by bench.fit_profile",
        gpu_model=args.gpu_model,
        hourly_price=args.hourly_price,
    )
    print(f"{'prompt tokens':>14} {'prefill s':>10}")
    for x, y in zip(prof.prefill_tokens, prof.prefill_s, strict=True):
        print(f"{int(x):>14} {y:>10.4f}")
    print(f"{'batch':>14} {'step s':>10}")
    for x, y in zip(prof.decode_batch, prof.decode_step_s, strict=True):
        print(f"{int(x):>14} {y:>10.4f}")
    print(
        f"cold start {prof.cold_start_s:.2f} s; kv capacity {prof.kv_capacity_tokens} tokens; max_num_seqs {seqs}"
    )
    out = args.out or PROFILES_DIR / f"{prof.name}.json"
    out.write_text(prof.model_dump_json(indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
