"""Cold start in parts: pull, load, warm-up, first token; cold cache vs warm cache vs a
plain local file (the baseline), with peak memory during the load against the weights'
size. The model is served from a real S3-compatible server (moto's) started here.

    python -m bench.coldstart                       # SmolLM2 (the installed GGUF), CPU
    python -m bench.coldstart --model PATH --device cuda   # a bigger model on a GPU

Each scenario runs in a fresh process (its memory and page tables are its own):
- cold: empty node cache -> `s3://` pull -> load;
- warm: the same cache, populated -> a cache hit -> load;
- local: the file itself, no cache (what the engine did before model URIs).
Peak RSS is sampled during the load; anonymous RSS is the part not backed by the file
(mmap'd weights are file-backed pages; a copy of them is anonymous). It measures and
prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import console, mib, print_table, run_main
from bench.inputs import ROOT, resolve_model
from fleet_base.ports import free_port, wait_port

PROMPT = "Write one sentence about the sea."


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class MemorySampler:
    """Peak VmRSS and RssAnon of this process over a block, sampled every 10 ms."""

    def __init__(self) -> None:
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, _status_kib("VmRSS") * 1024)
        self.peak_anon = max(self.peak_anon, _status_kib("RssAnon") * 1024)

    def __enter__(self) -> MemorySampler:
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def child(args: argparse.Namespace) -> int:
    """One scenario in this process: pull (if a URI), load, warm up, first request; JSON out."""
    from engine import LLM, SamplingParams
    from fleet_base.models import ModelCache, is_remote

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out: dict[str, float | int | bool | None] = {"pull_s": None, "downloaded": None}
    path = args.target
    if is_remote(args.target):
        t0 = time.perf_counter()
        result = ModelCache(args.cache).pull(args.target)
        out["pull_s"] = time.perf_counter() - t0
        out["downloaded"] = result.downloaded
        path = str(ModelCache(args.cache).model_dir(result.entry))
    kwargs = {"device": args.device} if args.device else {}
    before = _status_kib("RssAnon") * 1024  # after the pull: the load's own memory
    with MemorySampler() as mem:
        t0 = time.perf_counter()
        llm = LLM(model=path, **kwargs)
        out["load_s"] = time.perf_counter() - t0
    params = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    t0 = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    out["warmup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    out["first_token_s"] = time.perf_counter() - t0
    out.update(peak_rss=mem.peak_rss, peak_anon=mem.peak_anon - before, weights_in_memory=params)
    if args.device and args.device.startswith("cuda"):
        import torch

        out["gpu_peak"] = torch.cuda.max_memory_allocated()
    print("RESULT " + json.dumps(out))
    return 0


def _run_child(target: str, cache: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    argv = [sys.executable, "-m", "bench.coldstart", "--child", "--target", target, "--cache", str(cache)]
    if args.device:
        argv += ["--device", args.device]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"scenario {target} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[7:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf file to serve from S3")
    p.add_argument("--device", default=None, help="engine device (default: the engine's choice)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per scenario")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    model = resolve_model(args.model)
    if not model.is_file():
        console.print("[red]--model must be a single file (a .gguf) to upload[/red]")
        return 2
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    if not wait_port("127.0.0.1", port, 20.0):
        raise RuntimeError(f"the S3 server did not listen on port {port}")
    creds = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    env = {**os.environ, **creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "PYTHONPATH": str(ROOT)}
    try:
        s3 = boto3.session.Session().client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        s3.create_bucket(Bucket="bench")
        s3.upload_file(str(model), "bench", model.name)
        uri = f"s3://bench/{model.name}"
        with tempfile.TemporaryDirectory(prefix="fleet-coldstart-") as tmp:
            cache = Path(tmp) / "cache"
            results = {
                "cold cache (s3 pull)": _run_child(uri, cache, args, env),
                "warm cache (hit)": _run_child(uri, cache, args, env),
                "local file (baseline)": _run_child(str(model), cache, args, env),
            }
    finally:
        server.stop()
    size = model.stat().st_size
    gpu = all("gpu_peak" in r for r in results.values())
    rows = []
    for name, r in results.items():
        total = sum(r[k] or 0.0 for k in ("pull_s", "load_s", "warmup_s", "first_token_s"))
        rows.append(
            [
                name,
                r["pull_s"],
                r["load_s"],
                r["warmup_s"],
                r["first_token_s"],
                total,
                mib(r["peak_rss"]),
                mib(r["peak_anon"]),
                mib(r["weights_in_memory"]),
                *([mib(r["gpu_peak"])] if gpu else []),
            ]
        )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print_table(
        f"cold start of {model.name} ({mib(size):.1f} MiB file)",
        [
            "scenario",
            "pull s",
            "load s",
            "warm-up s",
            "first token s",
            "total s",
            "peak RSS MiB",
            "peak anon MiB (load)",
            "weights in memory MiB",
            *(["GPU peak MiB"] if gpu else []),
        ],
        rows,
        caption=f"device {args.device or 'default'}; {os.cpu_count()} CPUs, load average {load}; "
        "peak anon = anonymous memory the load added (copies and dequantized weights, not mmap'd file pages)",
    )
    if args.json:
        args.json.write_text(json.dumps({"file_bytes": size, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
