"""What security costs on the request path: the same local fleet twice in one run, once
plaintext (no TLS, anonymous NATS, plain HTTP to the replica, the old path) and once
secured as `fleetctl up` runs it (HTTPS to the replica with its token, per-key cache salt,
TLS NATS). One region, one replica, the same streamed requests through the gateway at
concurrency 1 and `--concurrency`; prints TTFT and output tokens/s for both.

    PYTHONPATH=. .venv/bin/python -m bench.trust_overhead --requests 16
    PYTHONPATH=. .venv/bin/python -m bench.trust_overhead --runtime sim   # no torch: path overhead only

Both fleets run one after the other (never two model replicas at once). Prefix caching
stays on, and both see the same prompts in the same order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import console, print_table, progress, run_main
from control_plane.local.fleet import LocalFleet, wait_http
from fleet_base.ports import free_port

REGION = "local-east"
NAME = "bench"


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if check():
                return
        time.sleep(0.3)
    raise RuntimeError(f"timed out: {what}")


class BenchFleet:
    def __init__(self, home: Path, secure: bool, runtime: str, model: str) -> None:
        self.local = LocalFleet(home, secure=secure)
        self.state = self.local.new_state([REGION])
        self.runtime, self.model = runtime, model
        self.gateway = ""
        self.key = ""

    def __enter__(self) -> BenchFleet:
        local, state = self.local, self.state
        local.save(state)
        local.start_nats(state, port=free_port())
        cp = local.start_control_plane(state, port=free_port())
        token_file = local.home / "admin-token"
        _wait(lambda: wait_http(f"{cp.url}/healthz", 1.0) and token_file.exists(), 120, "control plane")
        api = httpx.Client(
            base_url=cp.url, headers={"authorization": f"Bearer {token_file.read_text().strip()}"}, timeout=30
        )
        config = local.write_cluster_config(state, REGION, 0, 1, ["--threads", "1"], self.runtime)
        config = config.model_copy(
            update={"gateway": config.gateway.model_copy(update={"port": free_port()})}
        )
        config.dump(local.dir / "clusters" / REGION / "cluster.yaml")
        local.start_cluster(state, config)
        self.gateway = config.gateway.url
        _wait(lambda: wait_http(f"{self.gateway}/health", 1.0), 120, "gateway")
        self.key = api.post("/v1/keys", json={"name": "bench", "scopes": ["inference"]}).json()["key"]
        body: dict = {"name": NAME, "model": self.model, "replicas": 1}
        if self.runtime == "sim":
            body["engine_args"] = {"cold_start": 0.2}
        api.post("/v1/deployments", json=body).raise_for_status()
        _wait(lambda: api.get(f"/v1/deployments/{NAME}").json()["ready_replicas"] >= 1, 900, "replica ready")
        _wait(lambda: self.chat("warm up", 2)[0] is not None, 60, "first answer")
        return self

    def __exit__(self, *exc) -> None:
        self.local.down(timeout=10)

    def chat(self, prompt: str, max_tokens: int) -> tuple[float | None, int, float]:
        """(TTFT s, completion tokens, total s) of one streamed request."""
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        ttft, tokens = None, 0
        with httpx.stream(
            "POST",
            f"{self.gateway}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {self.key}"},
            timeout=300,
        ) as r:
            if r.status_code != 200:
                return None, 0, time.perf_counter() - started
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if (
                    ttft is None
                    and event.get("choices")
                    and event["choices"][0].get("delta", {}).get("content")
                ):
                    ttft = time.perf_counter() - started
                if event.get("usage"):
                    tokens = int(event["usage"].get("completion_tokens") or 0)
        return ttft, tokens, time.perf_counter() - started


def measure(fleet: BenchFleet, prompts: list[str], concurrency: int, max_tokens: int, label: str) -> dict:
    results: list[tuple[float | None, int, float]] = []
    started = time.perf_counter()
    with progress(len(prompts), label) as update, ThreadPoolExecutor(concurrency) as pool:
        for result in pool.map(lambda p: fleet.chat(p, max_tokens), prompts):
            results.append(result)
            update(1)
    wall = time.perf_counter() - started
    ttfts = sorted(t for t, _, _ in results if t is not None)
    return {
        "ok": len(ttfts),
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "tokens_per_s": sum(n for _, n, _ in results) / wall if wall else 0.0,
    }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trust_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runtime", choices=["process", "sim"], default="process")
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed benchmark still takes its fleet down
    model = args.model if args.runtime == "process" else "sim"
    prompts = [f"In two sentences, explain topic number {i} of cloud security." for i in range(args.requests)]
    rows = []
    measured: dict[str, dict[int, dict]] = {}
    for secure in (False, True):
        label = "TLS + identities" if secure else "plaintext (old path)"
        with tempfile.TemporaryDirectory(prefix="fleet-bench-") as home:
            console.print(f"bringing up a {label} fleet ({args.runtime} runtime) ...")
            with BenchFleet(Path(home), secure, args.runtime, model) as fleet:
                measured[label] = {}
                for conc in sorted({1, args.concurrency}):
                    m = measure(fleet, prompts, conc, args.max_tokens, f"{label}, concurrency {conc}")
                    measured[label][conc] = m
                    rows.append([label, conc, m["ok"], m["ttft_p50_ms"], m["ttft_p90_ms"], m["tokens_per_s"]])
    print_table(
        f"Gateway path, {args.requests} streamed requests x {args.max_tokens} tokens ({args.runtime} runtime)",
        ["path", "concurrency", "ok", "TTFT p50 ms", "TTFT p90 ms", "output tok/s"],
        rows,
        caption="Same prompts, same run, one fleet after the other; a shared, loaded 2-core machine is noisy.",
    )
    base, sec = measured["plaintext (old path)"], measured["TLS + identities"]
    for conc in base:
        b, s = base[conc], sec[conc]
        if b["ttft_p50_ms"] and s["ttft_p50_ms"] and b["tokens_per_s"]:
            console.print(
                f"concurrency {conc}: TTFT p50 {s['ttft_p50_ms'] - b['ttft_p50_ms']:+.1f} ms "
                f"({s['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x), tokens/s {s['tokens_per_s'] / b['tokens_per_s']:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
