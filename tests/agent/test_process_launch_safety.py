"""What the process runtime keeps to itself and gives back when it starts a foreign engine:
the replica token in no command line, log line the agent writes, stored handle or failure
text (for each engine, against stand-ins that report what they got and, as SGLang does,
print their parsed key); the KV-event socket and GPUs freed when a launch fails; and the
foreign engines' longer startup bound."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.engine_kv_subscriber import ENDPOINTS
from agent.runtime import process as process_mod
from agent.runtime.base import ReplicaHandle, startup_timeout_s
from agent.runtime.foreign import EngineUnavailable
from agent.runtime.process import ProcessRuntime
from fleet_base.protocol import ReplicaSpec, ReplicaState
from fleet_base.security.tls import Credentials
from tests.agent.conftest import cluster_config
from tests.polling import eventually

TOKEN = "replica-token-7f3a9c"

# Reports what it was given, then exits: the failure's log tail is what reaches events.
REPORTER = """
import hashlib, os, sys
args = sys.argv[1:]
key = os.environ.get("VLLM_API_KEY") or os.environ.get("LLAMA_API_KEY") or ""
if "--api-key" in args:
    key = args[args.index("--api-key") + 1]
print("cmdline:", open("/proc/self/cmdline").read().replace(chr(0), " "), flush=True)
print("key sha256:", hashlib.sha256(key.encode()).hexdigest(), flush=True)
print("server_args=ServerArgs(api_key=%r)" % key, flush=True)
sys.exit(3)
"""


def _secure(tmp_path: Path) -> Credentials:
    for name in ("ca.pem", "replica.pem", "replica.key"):
        (tmp_path / name).write_text("x")
    (tmp_path / "token").write_text(TOKEN)
    return Credentials(
        ca_file=tmp_path / "ca.pem",
        replica_cert=tmp_path / "replica.pem",
        replica_key=tmp_path / "replica.key",
        replica_token_file=tmp_path / "token",
    )


def _install_reporter(tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if engine == "sglang":  # `python -m sglang.launch_server` with a stand-in package
        pkg = tmp_path / "site" / "sglang"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "launch_server.py").write_text(f"if __name__ == '__main__':\n    exec({REPORTER!r})\n")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
        monkeypatch.setenv("FLEET_SGLANG_PYTHON", sys.executable)
        return
    path = tmp_path / "bin" / engine
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{REPORTER}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv({"vllm": "FLEET_VLLM", "llama.cpp": "FLEET_LLAMA_SERVER"}[engine], str(path))


def _spec(engine: str, replica_id: str = "r1", **kw: object) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=replica_id, deployment="d", version=1, model="/models/m.gguf", engine=engine, **kw
    )


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
async def test_the_replica_token_reaches_the_engine_and_nothing_else(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_reporter(tmp_path, engine, monkeypatch)
    monkeypatch.setattr(process_mod, "replica_verify", lambda creds: True)  # the stand-in CA is no PEM
    config = cluster_config(tmp_path, "nats://127.0.0.1:1", security=_secure(tmp_path).model_dump())
    rt = ProcessRuntime(config, gpus=[])
    handle = await rt.start(_spec(engine))
    try:
        probes = []

        async def failed() -> bool:
            probes.append(await rt.poll(handle))
            return probes[-1].state == ReplicaState.failed

        await eventually(failed, 20, "the stand-in exits", 0.05)
        log = Path(handle.log_path).read_text()
        assert f"key sha256: {hashlib.sha256(TOKEN.encode()).hexdigest()}" in log  # the engine has it
        assert TOKEN not in " ".join(handle.argv) and TOKEN not in handle.model_dump_json()
        (cmdline,) = [line for line in log.splitlines() if line.startswith("cmdline:")]
        assert TOKEN not in cmdline  # what /proc/<pid>/cmdline shows every local user
        assert all(TOKEN not in line for line in log.splitlines() if line.startswith("---"))
        error = probes[-1].error
        assert "api_key='***'" in error and TOKEN not in error  # what replica_failed carries
    finally:
        await rt.kill(handle)
        await rt.close()


async def test_a_failed_launch_frees_its_kv_event_socket_and_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = cluster_config(tmp_path, "nats://127.0.0.1:1")
    rt = ProcessRuntime(config, gpus=[0, 1])
    monkeypatch.delenv("FLEET_VLLM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no vllm anywhere
    with pytest.raises(EngineUnavailable):
        await rt.start(_spec("vllm"))
    assert "r1" not in ENDPOINTS._sockets and rt.gpus.free() == [0, 1]

    _install_reporter(tmp_path, "vllm", monkeypatch)

    def no_popen(*args: object, **kw: object) -> None:
        raise OSError("exec format error")

    monkeypatch.setattr(process_mod.subprocess, "Popen", no_popen)
    with pytest.raises(OSError):
        await rt.start(_spec("vllm"))
    assert "r1" not in ENDPOINTS._sockets and rt.gpus.free() == [0, 1]
    await rt.close()


@pytest.mark.parametrize(
    ("engine", "state"), [("vllm", ReplicaState.starting), ("fleet", ReplicaState.failed)]
)
async def test_a_foreign_engine_gets_the_longer_startup_bound(
    tmp_path: Path, engine: str, state: ReplicaState
) -> None:
    """The process runtime bounds a start as Kubernetes does: 700 s is too long for our
    engine (startup_timeout_s 600) but within a foreign one's 1800."""
    config = cluster_config(
        tmp_path,
        "nats://127.0.0.1:1",
        replica={"startup_timeout_s": 600},
        kubernetes={"engine_startup_timeout_s": 1800},
    )
    assert startup_timeout_s(_spec(engine), config) == (600 if engine == "fleet" else 1800)
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "--port", "9"]
    proc = subprocess.Popen(argv, start_new_session=True)
    rt = ProcessRuntime(config, gpus=[])
    rt.module = argv[0]  # our engine's replica is known by its module in the command line
    handle = ReplicaHandle(
        replica_id="r1",
        spec=_spec(engine),
        url="http://127.0.0.1:9",
        port=9,
        pid=proc.pid,
        argv=argv,
        started_at=time.time() - 700,
    )
    try:
        probe = await rt.poll(handle)
        assert probe.state == state, probe.error
    finally:
        proc.kill()
        proc.wait()
        await rt.close()
