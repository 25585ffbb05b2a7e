"""Our HTTP server against llama.cpp's `llama-server` on the same GGUF and the same requests.

The workload is `bench/engine_throughput.py`'s: ShareGPT first turns under the chat template,
output lengths drawn from the Azure 2023 conversation trace, greedy, EOS ignored. Both servers
get the identical token ids through `/v1/completions` from the same OpenAI SDK client
(non-streaming), prefix/prompt caching off in both. Each server runs alone (never both at
once): concurrency 1 on the first `--single-requests`, then every request with
`--concurrency` in flight. Tokens are counted from each response's `usage`, and every request
is checked to have produced exactly its requested count. llama-server is built once from the
`llama-cpp-python` sdist's vendored llama.cpp (`bench/llama_cpp_build.py`) and cached.

    PYTHONPATH=. .venv/bin/python -m bench.vs_llama_cpp
    PYTHONPATH=. .venv/bin/python -m bench.vs_llama_cpp --num-prompts 8 --single-requests 2 --max-tokens-cap 32
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from pydantic import BaseModel, computed_field

from bench import llama_cpp_build
from bench.common import (
    console,
    openai_client,
    print_table,
    progress,
    run_bounded,
    run_main,
    speculation_note,
    write_json,
)
from bench.engine_throughput import Workload, make_workload
from bench.inputs import load_azure_output_lengths, load_sharegpt_prompts, resolve_model
from bench.llama_server import SERVED_NAME, LlamaServer, llama_server_command, slot_context

GOALS = {"single": 1.0, "batched": 2.0}  # ours / llama-server, useful tokens/s


class RequestResult(BaseModel):
    requested: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float


class LevelResult(BaseModel):
    server: str  # "ours" | "llama-server"
    level: str  # "single" | "batched"
    concurrency: int
    num_requests: int
    seconds: float
    requested_tokens: int
    prompt_tokens: int
    completion_tokens: int
    useful_tokens: int  # each request's completion tokens, capped at what it asked for
    short_requests: int  # fewer completion tokens than requested (EOS not ignored, or cut off)
    errors: int
    load_average: float  # 1-minute, when the level started

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0


def level_result(
    server: str,
    level: str,
    concurrency: int,
    results: Sequence[RequestResult | None],
    seconds: float,
    load: float,
) -> LevelResult:
    done = [r for r in results if r is not None]
    return LevelResult(
        server=server,
        level=level,
        concurrency=concurrency,
        num_requests=len(results),
        seconds=seconds,
        requested_tokens=sum(r.requested for r in done),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        completion_tokens=sum(r.completion_tokens for r in done),
        useful_tokens=sum(min(r.completion_tokens, r.requested) for r in done),
        short_requests=sum(r.completion_tokens < r.requested for r in done),
        errors=len(results) - len(done),
        load_average=load,
    )


def request_body_extras() -> dict[str, object]:
    """Fields outside OpenAI's schema both servers need: run to max_tokens whatever EOS says,
    and do not reuse a slot's cached prompt (llama-server's; ours ignores unknown fields)."""
    return {"ignore_eos": True, "cache_prompt": False}


async def run_level(
    url: str,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    concurrency: int,
    timeout_s: float,
    tick: Callable[[int], object] | None = None,
) -> tuple[list[RequestResult | None], float]:
    """Every prompt through `url`'s /v1/completions with at most `concurrency` in flight."""
    import openai

    client = openai_client(url, concurrency, timeout_s)

    async def one(ids: list[int], n: int) -> RequestResult:
        t0 = time.perf_counter()
        resp = await client.completions.create(
            model=SERVED_NAME, prompt=ids, max_tokens=n, temperature=0, extra_body=request_body_extras()
        )
        usage = resp.usage
        return RequestResult(
            requested=n,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            seconds=time.perf_counter() - t0,
        )

    async with client:
        await one(prompts[0][:16], 2)  # warm-up: connection, first-step costs
        t0 = time.perf_counter()
        requests = [functools.partial(one, p, n) for p, n in zip(prompts, output_lens, strict=True)]
        results = await run_bounded(requests, concurrency, (openai.APIError, httpx.HTTPError), tick)
        seconds = time.perf_counter() - t0
    return results, seconds


# --------------------------------------------------------------------------- runs


def measure(server: str, url: str, workload: Workload, args: argparse.Namespace) -> list[LevelResult]:
    """Concurrency 1 on the first `single_requests`, then everything at `concurrency`."""
    out: list[LevelResult] = []
    n1 = min(args.single_requests, workload.size)
    plan = [("single", 1, n1), ("batched", args.concurrency, workload.size)]
    for level, conc, n in plan:
        if n == 0:
            continue
        load = os.getloadavg()[0]
        with progress(n, f"{server}, concurrency {conc}") as tick:
            results, seconds = asyncio.run(
                run_level(url, workload.prompts[:n], workload.output_lens[:n], conc, args.timeout, tick)
            )
        out.append(level_result(server, level, conc, results, seconds, load))
    return out


def ours_speculative_config(flags: list[str]) -> object:
    """The speculative setting `python -m engine.server` gets from these flags (its default if none)."""
    from engine.server.launcher import build_parser
    from engine.server.spec_flags import speculative_config

    return speculative_config(build_parser().parse_args(["--model", "m", *flags]))


def run_ours(model: Path, workload: Workload, args: argparse.Namespace, log_dir: Path) -> list[LevelResult]:
    from engine.server.process import ServerProcess

    extra = ["--served-model-name", SERVED_NAME, "--no-prefix-caching"]
    extra += ["--threads", str(args.threads)] if args.threads else []
    extra += shlex.split(args.ours_args)
    log = log_dir / "ours.log"
    console.print(f"starting python -m engine.server {' '.join(extra)} (log: {log}) ...")
    console.print(
        f"ours: {speculation_note(ours_speculative_config(extra))} (the server's default unless flags say)"
    )
    server = ServerProcess(*extra, model=str(model), log_path=log).start(timeout=args.start_timeout)
    try:
        return measure("ours", server.url, workload, args)
    finally:
        server.stop()


def run_llama(
    binary: Path, model: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[LevelResult]:
    from fleet_base.ports import free_port

    parallel = args.parallel or args.concurrency
    threads = args.threads or llama_cpp_build.available_cores()
    port = free_port()
    cmd = llama_server_command(binary, model, port, threads, parallel, slot_context(workload))
    log = log_dir / "llama-server.log"
    console.print(f"starting {shlex.join(cmd)} (log: {log}) ...")
    server = LlamaServer(cmd, port, log).start(timeout=args.start_timeout)
    try:
        return measure("llama-server", server.url, workload, args)
    finally:
        server.stop()


# --------------------------------------------------------------------------- report


class Report(BaseModel):
    workload: dict[str, object]
    llama_server: dict[str, object]
    results: list[LevelResult]
    ratios: dict[str, float]  # level -> ours / llama-server useful tok/s


def ratios(results: Sequence[LevelResult]) -> dict[str, float]:
    by = {(r.server, r.level): r for r in results}
    out: dict[str, float] = {}
    for level in GOALS:
        ours, theirs = by.get(("ours", level)), by.get(("llama-server", level))
        if ours and theirs and theirs.tokens_per_s > 0:
            out[level] = ours.tokens_per_s / theirs.tokens_per_s
    return out


def print_report(rep: Report) -> None:
    rows = []
    for r in rep.results:
        rows.append(
            [
                r.server,
                r.concurrency,
                r.num_requests,
                r.prompt_tokens,
                r.requested_tokens,
                r.useful_tokens,
                r.short_requests,
                r.errors,
                r.seconds,
                r.tokens_per_s,
                r.load_average,
            ]
        )
    cols = ["server", "concurrency", "requests", "prompt tok", "requested tok", "useful tok", "short"]
    print_table(
        "Servers, each alone (useful tokens/s from usage.completion_tokens)",
        [*cols, "errors", "seconds", "useful tok/s", "load avg"],
        rows,
    )
    by = {(r.server, r.level): r for r in rep.results}
    summary = []
    for level, goal in GOALS.items():
        ours, theirs = by.get(("ours", level)), by.get(("llama-server", level))
        ratio = rep.ratios.get(level)
        summary.append(
            [
                f"concurrency {(ours or theirs).concurrency}" if (ours or theirs) else level,
                ours.tokens_per_s if ours else None,
                theirs.tokens_per_s if theirs else None,
                ratio,
                f">= {goal:g}x",
                None if ratio is None else ("yes" if ratio >= goal else "no"),
            ]
        )
    w, ls = rep.workload, rep.llama_server
    print_table(
        "ours vs llama-server",
        ["level", "ours tok/s", "llama-server tok/s", "ours / llama-server", "goal", "met"],
        summary,
        caption=(
            f"{w['num_requests']} ShareGPT prompts ({w['prompt_tokens']:,} prompt tokens), Azure conv output "
            f"lengths ({w['output_tokens']:,} tokens), greedy, ignore_eos, same token ids via /v1/completions; "
            f"llama-server {ls.get('version')} ({ls.get('isa')}), {ls.get('parallel')} slots, "
            f"{ls.get('threads')} threads; {os.cpu_count()} CPUs."
        ),
    )


def parse_cmake_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"not a CMake option {text!r}: want NAME=VALUE")
    return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.vs_llama_cpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="GGUF alias or path, served by both")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the output-length draw")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer ShareGPT prompts")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="clip every drawn output length")
    p.add_argument("--single-requests", type=int, default=8, help="requests at concurrency 1")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight in the batched level")
    p.add_argument("--parallel", type=int, default=None, help="llama-server slots (default: --concurrency)")
    p.add_argument(
        "--threads", type=int, default=None, help="both servers (default: llama-server all cores, ours tuned)"
    )
    p.add_argument(
        "--ours-args", default="", help="extra flags for python -m engine.server, e.g. '--weights auto'"
    )
    p.add_argument("--llama-cpp-python-version", default=llama_cpp_build.DEFAULT_VERSION)
    p.add_argument("--llama-server", type=Path, default=None, help="use this binary instead of building one")
    p.add_argument(
        "--cmake-option", type=parse_cmake_option, action="append", default=[], metavar="NAME=VALUE"
    )
    p.add_argument("--jobs", type=int, default=None, help="build jobs (default: available cores)")
    p.add_argument("--build-only", action="store_true", help="build (or find) llama-server and exit")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to get ready")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a timeout, Ctrl-C's cousin) unwinds like an exception, so the server child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console.width = max(console.width, 140)
    model = resolve_model(args.model)
    built: llama_cpp_build.BuiltServer | None = None
    if not args.skip_llama and args.llama_server is None:
        try:
            built = llama_cpp_build.ensure_llama_server(
                args.llama_cpp_python_version, dict(args.cmake_option), args.jobs
            )
        except llama_cpp_build.BuildError as err:
            console.print(f"[red]could not build llama-server:[/red] {err}")
            return 1
        console.print(f"llama-server: {built.binary} ({'cached' if built.cached else 'built now'})")
    if args.build_only:
        return 0
    from engine.tokenizer import Tokenizer

    lens = load_azure_output_lengths(args.num_prompts, args.seed)
    if args.max_tokens_cap:
        lens = [min(n, args.max_tokens_cap) for n in lens]
    workload = make_workload(
        Tokenizer.from_path(model), load_sharegpt_prompts(), lens, args.max_prompt_tokens
    )
    console.print(
        f"{workload.size} prompts ({sum(len(p) for p in workload.prompts):,} tokens), "
        f"{sum(lens):,} output tokens; model {model}"
    )
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vs-llama-cpp-"))
    results: list[LevelResult] = []
    failed: list[str] = []
    binary = args.llama_server or (built.binary if built else None)
    runs: list[tuple[str, Callable[[], list[LevelResult]]]] = []
    if not args.skip_ours:
        runs.append(("ours", lambda: run_ours(model, workload, args, log_dir)))
    if binary is not None:
        runs.append(("llama-server", lambda b=binary: run_llama(b, model, workload, args, log_dir)))
    for name, run in runs:
        try:
            results += run()
        except (RuntimeError, TimeoutError) as err:  # a server that would not start: keep the other
            console.print(f"[red]{name} could not be measured:[/red] {err}")
            failed.append(name)
    on = [
        k
        for k, v in (built.options if built else {}).items()
        if k in llama_cpp_build.ISA_OPTIONS.values() and v == "ON"
    ]
    rep = Report(
        workload={
            "num_requests": workload.size,
            "prompt_tokens": sum(len(p) for p in workload.prompts),
            "output_tokens": sum(workload.output_lens),
            "single_requests": min(args.single_requests, workload.size),
            "concurrency": args.concurrency,
        },
        llama_server={
            "binary": str(binary) if binary else None,
            "version": built.version if built else ("(given binary)" if binary else "(not run)"),
            "isa": ", ".join(on) or "unknown",
            "parallel": args.parallel or args.concurrency,
            "threads": args.threads or llama_cpp_build.available_cores(),
        },
        results=results,
        ratios=ratios(results),
    )
    print_report(rep)
    write_json(args.json_path, rep)
    bad = sum(r.errors + r.short_requests for r in results) + len(failed)
    if bad:
        console.print(
            f"[red]{bad} failures: requests failed or came back short, or a server did not start[/red]"
        )
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
