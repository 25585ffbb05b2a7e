"""Start `python -m engine.server` as a child process and wait until it is ready.

Tests and `bench/serve.py` use this; it speaks to the server over HTTP only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from fleet_base.ports import free_port
from fleet_base.processes import stop_process

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A replica on 127.0.0.1 at a free port; `health_codes` records what /health said while loading."""

    def __init__(
        self, *args: str, model: str = "smollm2-135m", log_path: Path | None = None, root: Path = ROOT
    ) -> None:
        self.root = root  # the checkout whose code runs (a benchmark's "before" is another one)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = log_path
        self.health_codes: list[int] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(self.root), os.environ.get("PYTHONPATH")])),
        }
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.server", *self.args],
            cwd=self.root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine server exited with {self.proc.returncode}; {self._tail()}")
                try:
                    code = client.get(f"{self.url}/health").status_code
                except httpx.TransportError:
                    code = 0
                if code:
                    self.health_codes.append(code)
                if code == 200:
                    return self
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"engine server not ready after {timeout:.0f} s; {self._tail()}")

    def _tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return "log tail:\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        return "(no log; pass log_path)"

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        code = stop_process(self.proc, timeout)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
