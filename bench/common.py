"""Shared pieces of the engine benchmarks: memory and roofline measurement, request loops,
and table printing (their inputs, data sets and models, come from `bench.inputs`).

Everything here measures and reports; nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psutil
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from bench.inputs import MissingInputError

if TYPE_CHECKING:
    import openai

EXIT_MISSING_INPUT = 2

T = TypeVar("T")

# Redirected output keeps whole table rows instead of wrapping at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def set_threads(n: int | None) -> int:
    """Pins torch's intra-op threads (None: torch's default) and returns the count in use.

    On a shared, oversubscribed CPU, fewer threads than cores can be several times faster:
    each op waits for its slowest thread to get scheduled."""
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def speculation_note(config: Any) -> str:
    """Whether ours ran with speculative decoding (a `SpeculativeConfig` or None), for the tables."""
    if config is None:
        return "speculative decoding off"
    gate = config.disable_by_batch_size
    return (
        f"speculative decoding {config.method} (k = {config.num_speculative_tokens}, "
        f"drafts only below batch {gate})"
        if gate is not None
        else f"speculative decoding {config.method} (k = {config.num_speculative_tokens}, any batch)"
    )


def machine_note(device: str, threads: int) -> str:
    """One line on what the numbers were measured on, load included (they are noisy under load)."""
    import torch

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"torch {torch.__version__}, device {device}, {threads} torch threads, "
        f"{os.cpu_count()} CPUs, load average {load}"
    )


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------- memory


def process_peak_rss_bytes() -> int:
    """Peak resident set of this process since it started (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class RSSMonitor:
    """Samples this process's RSS on a thread, so each benchmark phase gets its own peak
    (ru_maxrss only knows the whole process's)."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self._interval = interval_s
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_bytes = 0
        self.peak_bytes = 0

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> RSSMonitor:
        self.start_bytes = self.peak_bytes = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20


# --------------------------------------------------------------------------- roofline


class RooflineResult(BaseModel):
    dtype: str
    device: str
    size: int
    reps: int
    seconds_per_matmul: float
    gflops: float


def matmul_roofline(dtype: str, size: int = 2048, reps: int = 3, device: str = "cpu") -> RooflineResult:
    """Best-of-`reps` GFLOP/s of a size^3 matmul: what this machine's math units can reach."""
    import torch

    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device).to(tdtype)
    b = torch.randn(size, size, generator=gen, device=device).to(tdtype)
    torch.matmul(a, b)  # warm-up: thread pools, kernel selection
    synchronize(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return RooflineResult(
        dtype=dtype,
        device=device,
        size=size,
        reps=reps,
        seconds_per_matmul=best,
        gflops=2.0 * size**3 / best / 1e9,
    )


# --------------------------------------------------------------------------- model FLOPs


class DecoderShape(Protocol):
    """What both engine.config.ModelConfig and a transformers LlamaConfig expose."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def matmul_params(cfg: DecoderShape) -> int:
    """Weights a token multiplies through: every projection plus the LM head (embedding
    lookups and norms are not matmuls)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_attention_heads * d * 2 + h * cfg.num_key_value_heads * d * 2
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp) + h * cfg.vocab_size


def flops_per_token(cfg: DecoderShape) -> float:
    """2 FLOPs per multiply-add over the matmul weights (attention over the context excluded)."""
    return 2.0 * matmul_params(cfg)


def attention_flops(cfg: DecoderShape, num_tokens: int) -> float:
    """QK^T and PV FLOPs of a sequence whose tokens 1..num_tokens each attend to all earlier ones."""
    per_position = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return per_position * num_tokens * (num_tokens + 1) / 2


def request_flops(cfg: DecoderShape, prompt_len: int, output_len: int) -> float:
    """Model FLOPs one request needs: every prompt and output token through the weights, plus
    causal attention (the last output token is never fed back, a negligible overcount)."""
    total = prompt_len + output_len
    return flops_per_token(cfg) * total + attention_flops(cfg, total)


# --------------------------------------------------------------------------- output


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    caption: str | None = None,
    min_width: int | None = None,
) -> None:
    """`min_width`: print at least this wide (a wide table kept whole in a file)."""
    table = Table(title=title, caption=caption, caption_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    if min_width is not None and console.width < min_width:
        Console(width=min_width).print(table)
        return
    console.print(table)


def fmt(v: object) -> str:
    if isinstance(v, float):
        if v == 0 or abs(v) >= 100:
            return f"{v:,.1f}"
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "-" if v is None else str(v)


@contextmanager
def progress(total: int, desc: str, unit: str = "req") -> Iterator[Callable[[int], object]]:
    """A tqdm bar on stderr; yields its `update`."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def openai_client(
    url: str, concurrency: int, timeout_s: float, api_key: str = "unused"
) -> openai.AsyncOpenAI:
    """An `openai.AsyncOpenAI` for `url` with a connection pool a little larger than
    `concurrency` (no request waits on a socket) and no retries (a failure is a result)."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, http_client=http)


async def run_bounded(
    requests: Iterable[Callable[[], Awaitable[T]]],
    concurrency: int,
    errors: tuple[type[BaseException], ...],
    tick: Callable[[int], object] | None = None,
) -> list[T | None]:
    """Every request, at most `concurrency` in flight; results in order. One that raises
    one of `errors` is printed and stands as None, so a refused or dropped request is
    counted, not the end of the run (anything else propagates); `tick(1)` after each."""
    gate = asyncio.Semaphore(concurrency)

    async def guarded(request: Callable[[], Awaitable[T]]) -> T | None:
        async with gate:
            try:
                return await request()
            except errors as err:
                console.print(f"[red]request failed:[/red] {err}")
                return None
            finally:
                if tick is not None:
                    tick(1)

    return list(await asyncio.gather(*(guarded(r) for r in requests)))


BUSY_LOOP = "while True:\n    pass\n"


@contextmanager
def cpu_contention(processes: int) -> Iterator[list[int]]:
    """`processes` CPU-bound competitors (pure-Python busy loops, one core each) for the block.

    What a benchmark's "under contention" means here: the systems compared in one run all
    share the machine with the same steady competitors, so their ratio shows which degrades
    more. Yields the competitors' pids; they are stopped (and reaped) on exit, however the
    block ends."""
    import subprocess

    from fleet_base.processes import stop_processes

    procs = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
        for _ in range(max(0, processes))
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        stop_processes(procs, timeout=5.0)


def batch_sweep_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments of a bench that times decode steps over batch sizes: model and sizes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    return p


def write_json(path: str | None, report: BaseModel) -> None:
    """Saves `report` as indented JSON where the run asked for a file (`--json`)."""
    if path:
        Path(path).write_text(report.model_dump_json(indent=2), encoding="utf-8")


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Runs a benchmark's main, turning absent inputs into a clear message and exit code 2."""
    try:
        return main(argv)
    except MissingInputError as err:
        console.print(f"[red]missing input:[/red] {err}")
        return EXIT_MISSING_INPUT
