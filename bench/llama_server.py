"""llama.cpp's `llama-server` as a child process on loopback: its command line and readiness."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

from bench.engine_throughput import Workload
from fleet_base.processes import stop_process

SERVED_NAME = "smollm2-135m"


def slot_context(workload: Workload) -> int:
    """Tokens one llama-server slot must hold: the longest prompt plus the longest output,
    rounded up to 256."""
    need = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    return -(-need // 256) * 256


def llama_server_command(
    binary: Path, model: Path, port: int, threads: int, parallel: int, ctx_per_slot: int
) -> list[str]:
    """Continuous batching over `parallel` slots, each `ctx_per_slot` tokens, on loopback; no host
    prompt cache (`--cache-ram 0`: it would copy slot states to RAM between requests, and the
    benchmark turns prompt caching off on both sides)."""
    return [
        str(binary),
        "--model", str(model),
        "--alias", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--parallel", str(parallel),
        "--ctx-size", str(parallel * ctx_per_slot),
        "--cache-ram", "0",
        "--cont-batching",
    ]  # fmt: skip


class LlamaServer:
    """`llama-server` as a child process; ready when /health says 200."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> LlamaServer:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}; {self._tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"llama-server not ready after {timeout:.0f} s; {self._tail()}")

    def _tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-30:]
        return "log tail:\n" + "\n".join(lines)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
