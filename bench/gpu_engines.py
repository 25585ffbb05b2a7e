"""Fleet's engine against vLLM on one GPU machine, both behind the same local Fleet.

A local fleet (`fleetctl up`, the process runtime; the agent offers the GPUs nvidia-smi
reports) serves the same model twice, one engine at a time so neither competes for the GPU:
`fleetctl deploy gpu-fleet --engine fleet` then `fleetctl deploy gpu-vllm --engine vllm`,
each deleted after its run. Through the gateway, with the fleet's API key, every prompt is
sent as a greedy streaming chat completion with `logprobs` (the generated tokens, as each
engine names them). Per engine: TTFT p50/p90 (first content chunk, one stream at a time),
output tokens/s of one stream and of `--concurrency` streams (tokens from `usage`). Per
prompt: token-level greedy agreement of vLLM with Fleet (same tokens up to the first
divergence, share of Fleet's tokens matched). Nothing is asserted: a near-tie can flip a
greedy token between two correct engines, and every token after it differs.

Without a GPU, or without vLLM installed, it says so and exits 2.

    PYTHONPATH=. .venv/bin/python -m bench.gpu_engines --model Qwen/Qwen2.5-0.5B-Instruct --prompts 16
    PYTHONPATH=. .venv/bin/python -m bench.gpu_engines --model /data/llama-3.1-8b --max-tokens 128 -e max_num_seqs=64
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from bench.common import console, print_table, run_main, write_json
from bench.inputs import MissingInputError
from bench.weights_agreement import prefix_len

ENGINES = ("fleet", "vllm")
REGION = "gpu-local"
PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List five prime numbers greater than 100.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Translate 'The weather is nice today' into French, German and Spanish.",
    "What are the differences between TCP and UDP?",
    "Give a haiku about autumn leaves.",
    "How does a hash map handle collisions?",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Why do we see phases of the Moon?",
    "Describe the water cycle for a ten-year-old.",
    "What is 17 multiplied by 23? Show your steps.",
    "Suggest a name for a coffee shop run by robots, and explain it.",
    "What does the `yield` keyword do in Python?",
    "Compare the economies of the Roman Republic and the Roman Empire briefly.",
]


class Completion(BaseModel):
    """One greedy streamed answer."""

    tokens: list[str]  # the generated tokens as the engine names them (logprobs)
    completion_tokens: int  # from `usage`
    ttft_s: float | None
    seconds: float


class EngineRun(BaseModel):
    engine: str
    sequential: list[Completion]  # one stream at a time, in prompt order
    batched_tokens: int  # every prompt again, `concurrency` in flight
    batched_seconds: float
    concurrency: int


class EngineSummary(BaseModel):
    engine: str
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tokens_per_s_single: float
    tokens_per_s_batched: float
    output_tokens: int


class PromptAgreement(BaseModel):
    prompt: int
    reference_tokens: int
    other_tokens: int
    first_divergence: int | None  # step of the first differing token; None: identical
    matched: float  # share of the reference's tokens before the first divergence


class Report(BaseModel):
    model: str
    max_tokens: int
    gpus: list[str]
    summaries: list[EngineSummary]
    agreement: list[PromptAgreement]


# --------------------------------------------------------------------------- pure parts


def unavailable(gpus: Sequence[tuple[str, float]], vllm_found: bool) -> str | None:
    """Why this machine cannot run the comparison (None: it can)."""
    if not gpus:
        return "no NVIDIA GPU here (nvidia-smi reports none): run bench.gpu_engines on a GPU machine"
    if not vllm_found:
        return "vLLM is not installed (no `vllm` command or module): `pip install vllm` in this environment"
    return None


def fleet_model(model: str) -> str:
    """`--model` as `fleetctl deploy --model` takes it: an existing path made absolute, a
    Hugging Face id (`org/name`) as an hf:// URI, anything else (an alias, a URI) as given."""
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser().resolve())
    if "://" not in model and model.count("/") == 1 and not model.startswith((".", "/")):
        return f"hf://{model}"
    return model


def deploy_argv(engine: str, name: str, model: str, gpus: int, engine_args: Sequence[str]) -> list[str]:
    """`fleetctl deploy` of one engine's deployment: one replica of `gpus` GPUs, unless the
    engine arguments give parallel sizes (the control plane then takes the count from them)."""
    from fleet_base.engines import parallel_args

    argv = ["deploy", name, "--model", model, "--engine", engine, "--replicas", "1"]
    keys = {item.split("=", 1)[0]: True for item in engine_args}
    if not parallel_args(engine, keys):  # type: ignore[arg-type]
        argv += ["--gpus", str(gpus)]
    for item in engine_args:
        argv += ["-e", item]
    return [*argv, "--output", "json"]


def last_json(text: str) -> dict:
    """The JSON object `fleetctl --output json` printed, after any progress lines."""
    decoder = json.JSONDecoder()
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    for start in starts:
        if text[start : start + 1] == "{":
            try:
                obj, end = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                continue
            if not text[end:].strip():
                return obj
    raise RuntimeError(f"no JSON object in fleetctl's output: {text[-500:]!r}")


def token_agreement(reference: list[list[str]], other: list[list[str]]) -> list[PromptAgreement]:
    """Per prompt, how far `other`'s greedy tokens follow `reference`'s."""
    rows = []
    for i, (ref, got) in enumerate(zip(reference, other, strict=True)):
        same = prefix_len(ref, got)
        identical = ref == got
        rows.append(
            PromptAgreement(
                prompt=i,
                reference_tokens=len(ref),
                other_tokens=len(got),
                first_divergence=None if identical else same,
                matched=1.0 if identical else same / max(1, len(ref)),
            )
        )
    return rows


def summarize(run: EngineRun) -> EngineSummary:
    ttfts = [c.ttft_s * 1000 for c in run.sequential if c.ttft_s is not None]
    tokens = sum(c.completion_tokens for c in run.sequential)
    seconds = sum(c.seconds for c in run.sequential)
    return EngineSummary(
        engine=run.engine,
        ttft_p50_ms=float(np.percentile(ttfts, 50)) if ttfts else None,
        ttft_p90_ms=float(np.percentile(ttfts, 90)) if ttfts else None,
        tokens_per_s_single=tokens / seconds if seconds > 0 else 0.0,
        tokens_per_s_batched=run.batched_tokens / run.batched_seconds if run.batched_seconds > 0 else 0.0,
        output_tokens=tokens,
    )


def summary_rows(summaries: Sequence[EngineSummary]) -> list[list[object]]:
    """One row per engine, with vLLM / Fleet as the last row when both ran."""
    rows: list[list[object]] = [
        [
            s.engine,
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.tokens_per_s_single,
            s.tokens_per_s_batched,
            s.output_tokens,
        ]
        for s in summaries
    ]
    by = {s.engine: s for s in summaries}
    if {"fleet", "vllm"} <= set(by):
        f, v = by["fleet"], by["vllm"]

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        rows.append(
            [
                "vllm / fleet",
                ratio(v.ttft_p50_ms, f.ttft_p50_ms),
                ratio(v.ttft_p90_ms, f.ttft_p90_ms),
                ratio(v.tokens_per_s_single, f.tokens_per_s_single),
                ratio(v.tokens_per_s_batched, f.tokens_per_s_batched),
                None,
            ]
        )
    return rows


def agreement_rows(rows: Sequence[PromptAgreement]) -> list[list[object]]:
    out: list[list[object]] = [
        [
            r.prompt,
            r.reference_tokens,
            r.other_tokens,
            "-" if r.first_divergence is None else r.first_divergence,
            r.matched,
        ]
        for r in rows
    ]
    if rows:
        exact = sum(r.first_divergence is None for r in rows)
        mean = sum(r.matched for r in rows) / len(rows)
        out.append([f"all ({exact}/{len(rows)} identical)", None, None, None, mean])
    return out


def print_report(rep: Report) -> None:
    print_table(
        f"Fleet vs vLLM on {rep.model} ({', '.join(rep.gpus)}), greedy, max_tokens {rep.max_tokens}",
        ["engine", "TTFT p50 ms", "TTFT p90 ms", "tok/s 1 stream", "tok/s batched", "output tokens"],
        summary_rows(rep.summaries),
        caption="TTFT and 1-stream tok/s: one request at a time; batched: every prompt, --concurrency in flight",
    )
    print_table(
        "Greedy agreement of vLLM with Fleet, token by token",
        ["prompt", "fleet tokens", "vllm tokens", "first divergence", "matched"],
        agreement_rows(rep.agreement),
        caption="matched: share of Fleet's tokens before the first divergence (a near-tie flip changes all after it)",
    )


# --------------------------------------------------------------------------- the fleet


class LocalFleet:
    """A local fleet under its own FLEET_HOME, driven through `fleetctl` as a user would."""

    def __init__(self, home: Path, log: Callable[[str], None] = console.print) -> None:
        self.home = home
        self.env = {**os.environ, "FLEET_HOME": str(home)}
        self.log = log
        self.gateway = ""
        self.key = ""

    def fleetctl(self, *args: str, timeout: float = 900.0) -> dict:
        cmd = [sys.executable, "-m", "control_plane.cli", *args]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(
                f"fleetctl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}"
            )
        return last_json(out.stdout) if "--output" in args else {}

    def up(self) -> LocalFleet:
        self.log(f"starting a local fleet in {self.home}")
        up = self.fleetctl("up", "--regions", REGION, "--detach", "--output", "json")
        self.gateway, self.key = up["clusters"][0]["gateway"], up["key"]
        return self

    def deploy(self, argv: list[str], name: str, timeout: float) -> None:
        self.fleetctl(*argv)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.fleetctl("status", name, "--output", "json")
            if status.get("ready_replicas", 0) >= 1:
                return
            time.sleep(2.0)
        raise RuntimeError(
            f"{name} not ready after {timeout:.0f} s (logs under {self.home}; --keep-home keeps them)"
        )

    def delete(self, name: str) -> None:
        self.fleetctl("delete", name, "--output", "json")

    def down(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "control_plane.cli", "down"],
            env=self.env,
            capture_output=True,
            timeout=120,
        )


async def complete(client, name: str, prompt: str, max_tokens: int) -> Completion:
    """One greedy streamed chat completion with its generated tokens and timings."""
    t0 = time.perf_counter()
    ttft = None
    tokens: list[str] = []
    usage = 0
    stream = await client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if ttft is None and choice.delta.content:
                ttft = time.perf_counter() - t0
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
    return Completion(tokens=tokens, completion_tokens=usage, ttft_s=ttft, seconds=time.perf_counter() - t0)


async def measure(url: str, key: str, name: str, prompts: list[str], args: argparse.Namespace) -> EngineRun:
    from bench.common import openai_client

    client = openai_client(url, args.concurrency, timeout_s=600.0, api_key=key)
    try:
        await complete(client, name, prompts[0], 8)  # warm-up: CUDA graphs, compile caches
        sequential = [await complete(client, name, p, args.max_tokens) for p in prompts]
        gate = asyncio.Semaphore(args.concurrency)

        async def bounded(p: str) -> Completion:
            async with gate:
                return await complete(client, name, p, args.max_tokens)

        t0 = time.perf_counter()
        batched = await asyncio.gather(*(bounded(p) for p in prompts))
        seconds = time.perf_counter() - t0
    finally:
        await client.close()
    return EngineRun(
        engine=name,
        sequential=sequential,
        batched_tokens=sum(c.completion_tokens for c in batched),
        batched_seconds=seconds,
        concurrency=args.concurrency,
    )


def prompts_for(n: int) -> list[str]:
    """`n` prompts: the built-in set, then numbered variants of it."""
    return [
        PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (variant {i // len(PROMPTS)})")
        for i in range(n)
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face id (org/name) or local path")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8, help="streams in flight in the batched pass")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per replica (both engines)")
    p.add_argument("--max-model-len", type=int, default=4096, help="context both engines reserve")
    p.add_argument("-e", "--engine-arg", action="append", default=[], help="vLLM flag KEY=VALUE (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds for a replica to be ready")
    p.add_argument("--keep-home", action="store_true", help="keep the fleet's FLEET_HOME (logs) afterwards")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.concurrency < 1:
        p.error("--prompts, --max-tokens and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from agent.inventory import detect_gpus

    args = parse_args(argv)
    gpus = detect_gpus()
    vllm_found = shutil.which("vllm") is not None or importlib.util.find_spec("vllm") is not None
    why = unavailable(gpus, vllm_found)
    if why is not None:
        raise MissingInputError(why)
    model = fleet_model(args.model)
    prompts = prompts_for(args.prompts)
    home = Path(tempfile.mkdtemp(prefix="fleet-gpu-engines-"))
    fleet = LocalFleet(home)
    runs: list[EngineRun] = []
    try:
        fleet.up()
        for engine in ENGINES:
            name = f"gpu-{engine}"
            extra = [f"max_model_len={args.max_model_len}"]
            extra += args.engine_arg if engine == "vllm" else []
            console.print(f"deploying {model} with --engine {engine}")
            fleet.deploy(deploy_argv(engine, name, model, args.gpus, extra), name, args.ready_timeout)
            run = asyncio.run(measure(fleet.gateway, fleet.key, name, prompts, args))
            runs.append(run.model_copy(update={"engine": engine}))
            fleet.delete(name)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        console.print(f"[red]{err}[/red]")
        return 1
    finally:
        fleet.down()
        if not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)
    by = {r.engine: r for r in runs}
    report = Report(
        model=args.model,
        max_tokens=args.max_tokens,
        gpus=[f"{name} {mem:.0f} GiB" for name, mem in gpus],
        summaries=[summarize(r) for r in runs],
        agreement=token_agreement(
            [c.tokens for c in by["fleet"].sequential], [c.tokens for c in by["vllm"].sequential]
        ),
    )
    print_report(report)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
