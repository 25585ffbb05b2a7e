"""A foreign engine's replica in the process runtime: the executable lookup, its command
line (flags Fleet sets, `-e` pass-through under the same checks, the key kept out of argv),
TLS only where the build serves it (else a note), the model handed over as a local path,
and a full start -> ready -> drain -> stop against a stand-in `llama-server` (a few lines of
Python that answer /health and /metrics the way llama-server documents; it is a stand-in,
not llama.cpp: tests/e2e/test_llama_cpp_engine.py runs the real one)."""

from __future__ import annotations

import asyncio
import stat
import sys
import time
from pathlib import Path

import pytest

from agent.gateway.plan import Attempt
from agent.replica import Replica, lora_slots
from agent.replica_metrics import engine_sources, parse_metrics
from agent.runtime.base import InvalidSpec
from agent.runtime.command import foreign_argv
from agent.runtime.foreign import EngineUnavailable, foreign_launch, local_model_path
from agent.runtime.process import ProcessRuntime
from fleet_base.engine_binaries import EngineNotFound, cached_llama_server, find_executable, serves_tls
from fleet_base.protocol import ReplicaSpec, ReplicaState
from fleet_base.security.tls import Credentials
from tests.agent.conftest import cluster_config
from tests.polling import eventually

STAND_IN = """
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
key = os.environ.get("LLAMA_API_KEY", "")
born = time.monotonic()
busy_file = os.environ.get("STAND_IN_BUSY_FILE", "")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, body, ctype="application/json"):
        data = body.encode()
        self.send_response(code); self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            if time.monotonic() - born < 0.3:
                return self._send(503, json.dumps({"error": {"code": 503, "message": "Loading model"}}))
            return self._send(200, json.dumps({"status": "ok"}))
        if key and self.headers.get("authorization") != "Bearer " + key:
            return self._send(401, json.dumps({"error": {"message": "Invalid API Key"}}))
        if self.path == "/metrics":
            busy = 1 if busy_file and os.path.exists(busy_file) else 0
            return self._send(200, "llamacpp:requests_processing %d\\nllamacpp:requests_deferred 0\\n" % busy, "text/plain")
        self._send(404, "{}")
srv = ThreadingHTTPServer(("127.0.0.1", port), H)
def stop(*_):
    print("stand-in: SIGTERM", flush=True)
    threading.Thread(target=srv.shutdown).start()
signal.signal(signal.SIGTERM, stop)
print("stand-in llama-server argv:", " ".join(args), flush=True)
srv.serve_forever()
"""


def _stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "llama-server"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _spec(model: str = "/models/smollm2.gguf", **kw: object) -> ReplicaSpec:
    base: dict = dict(replica_id="r1", deployment="smollm2-cpp", version=1, model=model, engine="llama.cpp")
    return ReplicaSpec(**{**base, **kw})


# ----------------------------------------------------------------- lookup


def test_the_executable_is_found_env_then_path_then_the_build_cache(tmp_path: Path) -> None:
    binary = _stand_in(tmp_path)
    cache = tmp_path / "cache"
    built = cache / "bin" / "0.3.36-abc" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_bytes(binary.read_bytes())
    built.chmod(0o755)
    empty = {"PATH": str(tmp_path / "nowhere"), "FLEET_LLAMA_CPP_CACHE": str(tmp_path / "none")}
    with pytest.raises(EngineNotFound, match="FLEET_LLAMA_SERVER"):
        find_executable("llama.cpp", empty)
    assert find_executable("llama.cpp", {**empty, "FLEET_LLAMA_CPP_CACHE": str(cache)}) == str(built)
    on_path = {"PATH": str(binary.parent), "FLEET_LLAMA_CPP_CACHE": str(cache)}
    assert find_executable("llama.cpp", on_path) == str(binary)
    explicit = {**on_path, "FLEET_LLAMA_SERVER": str(built)}
    assert find_executable("llama.cpp", explicit) == str(built)
    with pytest.raises(EngineNotFound, match="not an executable"):
        find_executable("llama.cpp", {**on_path, "FLEET_LLAMA_SERVER": str(tmp_path / "missing")})
    assert cached_llama_server(cache) == built
    with pytest.raises(EngineNotFound):
        find_executable("vllm", {"PATH": str(tmp_path / "nowhere")})


def test_tls_support_is_read_from_the_build(tmp_path: Path) -> None:
    with_ssl, without = tmp_path / "a", tmp_path / "b"
    with_ssl.write_bytes(b"\0" * (1 << 20) + b"running with SSL: key = %s" + b"\0" * 100)
    without.write_bytes(b"\0" * 100 + b"the server is built without SSL support")
    assert serves_tls("llama.cpp", str(with_ssl)) and not serves_tls("llama.cpp", str(without))
    assert serves_tls("vllm", str(without))  # uvicorn serves TLS in every build


# ----------------------------------------------------------------- command line


def test_the_command_line_sets_fleets_flags_and_passes_engine_args_through() -> None:
    spec = _spec(engine_args={"n_gpu_layers": 99, "ctx_size": 4096, "cont_batching": True, "seed": None})
    argv = foreign_argv(spec, model_path="/m.gguf", port=8123, host="127.0.0.1", api_key="s3cret")
    assert argv[1:3] == ["-m", "/m.gguf"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--alias") + 1] == "smollm2-cpp" and "--metrics" in argv
    assert "s3cret" not in argv and "--api-key" not in argv  # LLAMA_API_KEY instead
    assert argv[-5:] == ["--n-gpu-layers", "99", "--ctx-size", "4096", "--cont-batching"]


@pytest.mark.parametrize(
    "engine_args", [{"api_key": "x"}, {"host": "0.0.0.0"}, {"alias": "b"}, {"x": "--evil"}]
)
def test_engine_args_that_would_undo_fleets_flags_are_refused(engine_args: dict) -> None:
    with pytest.raises(InvalidSpec):
        foreign_argv(_spec(engine_args=engine_args), model_path="/m.gguf", port=1, host="127.0.0.1")


def test_llama_cpp_replicas_offer_no_lora_slots() -> None:
    assert lora_slots(_spec(max_adapters=4)) == 0 and lora_slots(_spec(engine="vllm", max_adapters=4)) == 4


# ----------------------------------------------------------------- TLS and the model


def _secure(tmp_path: Path) -> Credentials:
    for name in ("ca.pem", "replica.pem", "replica.key"):
        (tmp_path / name).write_text("x")
    (tmp_path / "token").write_text("replica-token-1")
    return Credentials(
        ca_file=tmp_path / "ca.pem",
        replica_cert=tmp_path / "replica.pem",
        replica_key=tmp_path / "replica.key",
        replica_token_file=tmp_path / "token",
    )


def test_a_build_without_tls_serves_loopback_http_and_says_so(tmp_path: Path, monkeypatch) -> None:
    binary = _stand_in(tmp_path)  # no "running with SSL" in it
    monkeypatch.setenv("FLEET_LLAMA_SERVER", str(binary))
    creds = _secure(tmp_path)
    launch = foreign_launch(_spec(), 8123, creds, None)
    assert not launch.https and launch.host == "127.0.0.1"
    assert "no TLS support" in launch.note and "--ssl-cert-file" not in launch.argv
    assert launch.env == {"LLAMA_API_KEY": creds.replica_token}
    binary.write_text(binary.read_text() + "\n# running with SSL\n")
    launch = foreign_launch(_spec(), 8124, creds, None)
    assert launch.https and not launch.note
    assert launch.argv[launch.argv.index("--ssl-cert-file") + 1] == str(creds.replica_cert)


def test_a_remote_model_is_handed_over_as_its_cached_file(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable, match="not in the node cache"):
        local_model_path(_spec(model="hf://org/repo/model.gguf"), tmp_path / "cache")
    assert local_model_path(_spec(model="~/m.gguf"), None) == str(Path("~/m.gguf").expanduser())


# ----------------------------------------------------------------- metrics


LLAMACPP_METRICS = """\
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
llamacpp:tokens_predicted_total 40
llamacpp:tokens_predicted_seconds_total 2
llamacpp:requests_processing 3
llamacpp:requests_deferred 5
llamacpp:kv_cache_usage_ratio 0.25
vllm:num_requests_waiting 99
"""


def test_a_llama_cpp_scrape_reads_only_llamacpp_series() -> None:
    sample = parse_metrics(LLAMACPP_METRICS, "llama.cpp")
    assert (sample.running, sample.waiting, sample.kv_cache_usage) == (3, 5, 0.25)
    assert (sample.prompt_tokens, sample.generation_tokens, sample.itl_sum) == (120, 40, 2)
    assert all(n.startswith("llamacpp:") for names in engine_sources("llama.cpp").values() for n in names)
    assert parse_metrics(LLAMACPP_METRICS).waiting == 99  # unscoped: the first known name wins


# ----------------------------------------------------------------- gateway


def test_streams_on_a_foreign_replica_are_not_migrated(tmp_path: Path) -> None:
    from agent.gateway.router import Router

    fleet = Replica(_spec(engine="fleet", replica_id="f1")).status()
    cpp = Replica(_spec(replica_id="c1")).status()
    assert cpp.engine == "llama.cpp" and cpp.max_adapters == 0

    class View:
        replicas = [fleet, cpp]

    router = Router.__new__(Router)
    router.view = View()  # type: ignore[assignment]
    assert router.continues(Attempt("primary", "", name="f1"))
    assert not router.continues(Attempt("primary", "", name="c1"))
    assert router.continues(Attempt("peer", "", name="peer-west", is_peer=True))


# ----------------------------------------------------------------- the runtime


async def test_start_ready_drain_and_stop_a_stand_in_llama_server(tmp_path: Path, monkeypatch) -> None:
    binary = _stand_in(tmp_path)
    busy = tmp_path / "busy"
    monkeypatch.setenv("FLEET_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("STAND_IN_BUSY_FILE", str(busy))
    config = cluster_config(tmp_path, "nats://127.0.0.1:1")
    rt = ProcessRuntime(config)
    handle = await rt.start(_spec(model=str(tmp_path / "m.gguf")))
    try:
        assert handle.url.startswith("http://127.0.0.1:") and handle.argv[0] == str(binary)
        assert (await rt.poll(handle)).state == ReplicaState.starting  # /health 503 while loading

        async def ready() -> bool:
            probe = await rt.poll(handle)
            assert probe.state != ReplicaState.failed, probe.error
            return probe.state == ReplicaState.ready

        await eventually(ready, 20, "the stand-in ready", 0.05)
        assert await ProcessRuntime(config).adopt(handle)  # found again by executable and port
        busy.write_text("1")  # a request in flight: stop waits for it before SIGTERM
        t0 = time.monotonic()

        async def finish() -> None:
            await eventually(lambda: time.monotonic() - t0 > 0.6, 5, "a while", 0.05)
            busy.unlink()

        done = asyncio.create_task(finish())
        await rt.stop(handle, drain_timeout_s=5)
        await done
        assert time.monotonic() - t0 >= 0.6
        assert "stand-in: SIGTERM" in Path(handle.log_path).read_text()
    finally:
        await rt.kill(handle)
        await rt.close()
