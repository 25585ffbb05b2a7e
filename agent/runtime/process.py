"""Runtime `process`: each replica is a `python -m engine.server` child on a free port.

- argv from `agent.runtime.command.replica_argv` (a list, never a shell; the spec's
  flags checked, the host's own flags winning).
- each replica runs in its own session/process group (start_new_session) with stdout and
  stderr appended to `state_dir/logs/<replica_id>.log`, so it outlives an agent killed
  with SIGKILL and a restarted agent can adopt it (see `adopt`); every poll rotates that
  log once it is over `replica.log_max_bytes` (`agent.runtime.replica_logs`).
- ready when GET /health answers 200 (the engine listens at once and says 503 while it
  loads); failed when the process exits (exit code and log tail, the replica token masked,
  reported), when it is not ready within `agent.runtime.base.startup_timeout_s` (longer for
  a foreign engine, as on Kubernetes), or when a ready replica stops answering /health for
  `UNHEALTHY_AFTER_S` (then it is killed, so the restart is clean).
- GPUs: on a host with GPUs each replica gets its own `replica_gpu_count` devices as
  CUDA_VISIBLE_DEVICES (`agent.runtime.gpus`), held until it is gone and claimed again on
  adoption from the process's environment (else runtime.json); a replica that cannot get
  them is not started (retried after the backoff).
- the command line written to the log and kept in the handle has secret values masked
  (`fleet_base.engines.redact_argv`); no launcher puts the key in argv to begin with.
- stop: SIGTERM to the group (the engine drains in-flight requests, bounded by the
  `--drain-timeout` we pass), SIGKILL after `drain_timeout_s` plus a grace.

A replica whose `spec.engine` is foreign (vLLM, SGLang, llama.cpp) runs that engine's own
server (`agent.runtime.foreign`): on loopback, its health path from
`fleet_base.engines.CAPABILITIES`, adopted by its executable and port. An engine that stops
at once on SIGTERM (llama-server cuts in-flight requests) is first waited on until its
/metrics shows no running or waiting request, within the drain timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from agent.engine_kv_subscriber import (
    adopt_kv_events_endpoint,
    kv_events_endpoint_for,
    release_kv_events_endpoint,
)
from agent.inventory import gpu_indices
from agent.runtime.base import Probe, ReplicaHandle, Runtime, startup_timeout_s
from agent.runtime.command import ENGINE_MODULE, replica_argv
from agent.runtime.drain import wait_idle
from agent.runtime.foreign import LOOPBACK, Launch, foreign_launch
from agent.runtime.gpus import GpuAllocator, cuda_env, replica_gpu_count, visible_indices
from agent.runtime.replica_logs import rotate_if_large
from agent.security.replica_auth import replica_env, replica_headers
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import CAPABILITIES, redact_argv, redact_text
from fleet_base.local_state import LocalState
from fleet_base.ports import free_port
from fleet_base.protocol import ReplicaSpec, ReplicaState
from fleet_base.security.tls import replica_verify

log = logging.getLogger(__name__)

UNHEALTHY_AFTER_S = 10.0
KILL_GRACE_S = 5.0
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 8192

_ROOT = Path(__file__).resolve().parents[2]


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a replica's log (bounded read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class ProcessRuntime(Runtime):
    name = "process"
    # The `python -m` module of a replica (adoption checks a process's command line for it).
    module = ENGINE_MODULE
    # Whether a spec's foreign engine runs that engine (the sim runtime simulates every engine).
    runs_foreign_engines = True

    def __init__(
        self,
        config: ClusterConfig,
        *,
        unhealthy_after_s: float = UNHEALTHY_AFTER_S,
        gpus: Sequence[int] | None = None,
    ) -> None:
        """`gpus`: the device indices replicas are given (default: this host's, nvidia-smi's)."""
        self.config = config
        self.node_name = config.node_name
        self.logs_dir = LocalState(config.state_dir).logs_dir
        self.unhealthy_after_s = unhealthy_after_s
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # pid -> our own child
        self._last_ok: dict[int, float] = {}  # pid -> last /health 200
        self._http = httpx.AsyncClient(timeout=2.0, verify=replica_verify(config.security))
        self.gpus = GpuAllocator(self.gpu_inventory() if gpus is None else gpus)

    def gpu_inventory(self) -> list[int]:
        """The GPU indices this runtime hands out (a simulated replica uses none)."""
        return gpu_indices()

    # ----------------------------------------------------------------- start

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.config.replica.env, **replica_env(self.config.security)}
        if self.config.model_cache_dir is not None:  # the agent's cache is the replica's
            env["FLEET_MODEL_CACHE"] = str(Path(self.config.model_cache_dir).expanduser())
        if (_ROOT / "engine").is_dir():  # a source checkout: make `engine` importable
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        return env

    def replica_argv(self, spec: ReplicaSpec, port: int) -> list[str]:
        """The command line of one replica (subclasses launch something else)."""
        return replica_argv(spec, self.config, port=port)

    def _launch(self, spec: ReplicaSpec) -> Launch:
        """argv, added environment, address and scheme of one replica (raises InvalidSpec)."""
        if spec.engine != "fleet" and self.runs_foreign_engines:
            port = free_port(LOOPBACK)
            kv_events = kv_events_endpoint_for(  # vLLM, SGLang
                spec.replica_id,
                spec.engine,
                LocalState(self.config.state_dir).kv_events_dir,
                spec.engine_args,
            )
            return foreign_launch(spec, port, self.config.security, self.config.model_cache_dir, kv_events)
        host = self.config.replica.host
        port = free_port(host)
        return Launch(self.replica_argv(spec, port), port, host=host, https=self.config.security.enabled)

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        try:
            devices = self.gpus.allocate(spec.replica_id, replica_gpu_count(spec))
            launch = self._launch(spec)
            proc, log_path = self._spawn(spec, launch, devices)
        except BaseException:  # nothing runs: free what was taken for it
            self._release(spec.replica_id)
            raise
        self._children[proc.pid] = proc
        argv, host, port = redact_argv(launch.argv), launch.host, launch.port
        create_time = None
        with contextlib.suppress(psutil.Error):
            create_time = psutil.Process(proc.pid).create_time()
        log.info("replica %s: pid %d on port %d", spec.replica_id, proc.pid, port)
        return ReplicaHandle(
            replica_id=spec.replica_id,
            spec=spec,
            url=f"{'https' if launch.https else 'http'}://{_url_host(host)}:{port}",
            port=port,
            pid=proc.pid,
            create_time=create_time,
            log_path=str(log_path),
            argv=argv,
            gpus=list(devices),
            note=launch.note,
        )

    def _spawn(
        self, spec: ReplicaSpec, launch: Launch, devices: Sequence[int]
    ) -> tuple[subprocess.Popen[bytes], Path]:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"{spec.replica_id}.log"
        with open(log_path, "ab") as out:
            shown = " ".join(redact_argv(launch.argv))
            gpus = f" (GPUs {','.join(map(str, devices))})" if devices else ""
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} agent starts{gpus}: {shown}\n".encode())
            if launch.note:
                out.write(f"--- agent note: {launch.note}\n".encode())
                log.warning("replica %s: %s", spec.replica_id, launch.note)
            out.flush()
            proc = subprocess.Popen(
                launch.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self._env(), **launch.env, **cuda_env(devices)},
                start_new_session=True,
            )
        return proc, log_path

    # ----------------------------------------------------------------- liveness

    def _exited(self, handle: ReplicaHandle) -> tuple[bool, int | None]:
        """(exited, exit code if known)."""
        if handle.pid is None:
            return True, None
        child = self._children.get(handle.pid)
        if child is not None:
            code = child.poll()
            return code is not None, code
        return not self._same_live_process(handle), None

    def _same_live_process(self, handle: ReplicaHandle) -> bool:
        """The pid is alive, not a zombie, and is still our engine (not a reused pid)."""
        if handle.pid is None:
            return False
        try:
            proc = psutil.Process(handle.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                # Its main thread is gone; other threads may still be finishing the exit.
                return _thread_count(handle.pid) > 1
            if handle.create_time is not None and abs(proc.create_time() - handle.create_time) > 1.0:
                return False
            cmdline = proc.cmdline()
        except psutil.Error:
            return False
        return self._identity(handle) in cmdline and str(handle.port) in cmdline

    def _identity(self, handle: ReplicaHandle) -> str:
        """What a replica's command line holds: our module, or a foreign engine's executable."""
        if handle.spec.engine != "fleet" and self.runs_foreign_engines and handle.argv:
            return handle.argv[0]
        return self.module

    def _health_path(self, handle: ReplicaHandle) -> str:
        return CAPABILITIES[handle.spec.engine].health_path if self.runs_foreign_engines else "/health"

    async def _health(self, url: str, path: str = "/health") -> tuple[int, str]:
        """(HTTP status or 0 when unreachable, the engine's status word)."""
        try:
            r = await self._http.get(f"{url}{path}")
        except httpx.HTTPError:
            return 0, ""
        try:
            word = str(r.json().get("status", ""))
        except ValueError:
            word = ""
        return r.status_code, word

    async def poll(self, handle: ReplicaHandle) -> Probe:
        if handle.log_path:
            rotate_if_large(
                handle.log_path, self.config.replica.log_max_bytes, self.config.replica.log_backups
            )
        exited, code = self._exited(handle)
        if exited:
            self._forget(handle)
            tail = self._log_tail(handle)
            what = f"exited with code {code}" if code is not None else "exited"
            return Probe(state=ReplicaState.failed, exit_code=code, error=f"{what}; log tail:\n{tail}")
        status, word = await self._health(handle.url, self._health_path(handle))
        now = time.time()
        assert handle.pid is not None
        if status == 200:
            self._last_ok[handle.pid] = now
            return Probe(state=ReplicaState.ready)
        if word == "draining":
            return Probe(state=ReplicaState.draining)
        if word in ("dead", "stalled"):  # stopped, or hung with work: restart it
            await self.kill(handle)
            return Probe(state=ReplicaState.failed, error=f"the engine loop {word} (/health: {word}); killed")
        last_ok = self._last_ok.get(handle.pid)
        if last_ok is not None:  # was ready: tolerate a short blip
            if now - last_ok > self.unhealthy_after_s:
                await self.kill(handle)
                return Probe(
                    state=ReplicaState.failed,
                    error=f"stopped answering /health for {now - last_ok:.0f} s; killed",
                )
            return Probe(state=ReplicaState.ready)
        timeout = startup_timeout_s(handle.spec, self.config)
        if now - handle.started_at > timeout:
            await self.kill(handle)
            tail = self._log_tail(handle)
            return Probe(
                state=ReplicaState.failed, error=f"not ready after {timeout:.0f} s; log tail:\n{tail}"
            )
        return Probe(state=ReplicaState.starting)

    # ----------------------------------------------------------------- stop

    def _signal(self, handle: ReplicaHandle, sig: int) -> None:
        if handle.pid is None or not self._same_live_process_or_child(handle):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handle.pid, sig)  # its own session: pgid == pid

    def _same_live_process_or_child(self, handle: ReplicaHandle) -> bool:
        if handle.pid in self._children:
            return self._children[handle.pid].poll() is None
        return self._same_live_process(handle)

    async def _wait_exit(self, handle: ReplicaHandle, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self._exited(handle)[0]:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def stop(self, handle: ReplicaHandle, drain_timeout_s: float) -> int | None:
        started = time.monotonic()
        if self.runs_foreign_engines and not CAPABILITIES[handle.spec.engine].drains_on_sigterm:
            await wait_idle(
                self._http,
                handle.url,
                handle.spec.engine,
                drain_timeout_s,
                replica_headers(self.config.security),
                gone=lambda: self._exited(handle)[0],
            )
        self._signal(handle, signal.SIGTERM)
        left = max(0.0, drain_timeout_s - (time.monotonic() - started))
        if not await self._wait_exit(handle, left + KILL_GRACE_S):
            log.warning("replica %s did not exit after draining; killing", handle.replica_id)
            self._signal(handle, signal.SIGKILL)
            await self._wait_exit(handle, 10.0)
        code = self._exited(handle)[1]
        self._forget(handle)
        return code

    async def kill(self, handle: ReplicaHandle) -> None:
        self._signal(handle, signal.SIGKILL)
        await self._wait_exit(handle, 10.0)
        self._forget(handle)

    def _log_tail(self, handle: ReplicaHandle) -> str:
        """The replica log's tail for a failure's error, with the replica token masked."""
        return redact_text(log_tail(handle.log_path), [self.config.security.replica_token])

    def _release(self, replica_id: str) -> None:
        release_kv_events_endpoint(replica_id)
        self.gpus.release(replica_id)

    def _forget(self, handle: ReplicaHandle) -> None:
        self._release(handle.replica_id)
        if handle.pid is not None:
            self._last_ok.pop(handle.pid, None)
            child = self._children.pop(handle.pid, None)
            if child is not None:
                child.poll()  # reap

    # ----------------------------------------------------------------- adopt

    async def adopt(self, handle: ReplicaHandle) -> bool:
        if not self._same_live_process(handle):
            return False
        status, _ = await self._health(handle.url, self._health_path(handle))
        if status == 0:
            log.warning(
                "replica %s (pid %s) is alive but does not answer; killing it", handle.replica_id, handle.pid
            )
            self._signal(handle, signal.SIGKILL)
            return False
        if status == 200 and handle.pid is not None:
            self._last_ok[handle.pid] = time.time()
        adopt_kv_events_endpoint(handle.replica_id, handle.spec.engine, handle.argv)
        self.gpus.claim(handle.replica_id, self._adopted_gpus(handle))
        log.info("adopted replica %s (pid %s, %s)", handle.replica_id, handle.pid, handle.url)
        return True

    def _adopted_gpus(self, handle: ReplicaHandle) -> list[int]:
        """The devices an adopted replica runs on: its process's CUDA_VISIBLE_DEVICES, else
        what runtime.json recorded."""
        if not self.gpus.inventory or handle.pid is None:
            return []
        try:
            found = visible_indices(psutil.Process(handle.pid).environ())
        except psutil.Error:
            found = None
        return found if found is not None else list(handle.gpus)

    async def close(self) -> None:
        await self._http.aclose()
