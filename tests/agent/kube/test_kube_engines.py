"""Replica pods of foreign engines (vLLM, SGLang, llama.cpp): the engine's image and its own
server as the command, the replica identity without a secret value in the pod object, GPUs
from the parallel sizes, /dev/shm, probes on the engine's health path, the startup bound,
the drain grace, the model volume read-only with the verified local path, the KV-event port.
Checked against the official 1.30 schemas; the runtime test creates pods through the fake
API server (a stand-in for a real one). Nothing here runs an engine."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from agent.runtime.base import InvalidSpec
from agent.runtime.command import foreign_argv
from agent.runtime.foreign import EngineUnavailable
from agent.runtime.kube_engine import kv_events_endpoints, pod_model_path
from agent.runtime.kube_pod import CREDENTIALS_DIR, replica_pod, termination_grace_s
from agent.runtime.kubernetes import KubernetesRuntime
from control_plane.security.pki import FleetPki
from fleet_base.cluster_config import ClusterConfig, ReplicaConfig
from fleet_base.engines import SGLANG_SHIM, kv_events_config
from fleet_base.kube_config import ENGINE_IMAGES, KubernetesConfig
from fleet_base.models import ModelCache, source_for
from fleet_base.models.cache import MANIFEST, CachedFile, CacheEntry, cache_key
from fleet_base.protocol import ReplicaSpec, Resources
from fleet_base.security.tls import Credentials
from tests.agent.kube.conftest import NAMESPACE, POOLS, config_for, validate
from tests.agent.kube.fake_apiserver import FakeApiServer

SECRET = "fleet-replica-credentials"
H100 = POOLS[1]
GPU = "nvidia.com/gpu"
HF_URI = "hf://Qwen/Qwen2.5-7B-Instruct@" + "c" * 40
GGUF_URI = "hf://Qwen/Qwen2.5-7B-Instruct-GGUF@" + "d" * 40
FOREIGN = ["vllm", "sglang", "llama.cpp"]


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    return FleetPki(tmp_path_factory.mktemp("pki")).cluster(
        "gke-east", hosts=[f"*.fleet-replicas.{NAMESPACE}.svc"]
    )


def secure_config(creds: Credentials, **kube: object) -> ClusterConfig:
    return ClusterConfig(
        cluster="gke-east",
        security=creds,
        pools=POOLS,
        replica=ReplicaConfig(drain_timeout_s=45.0, startup_timeout_s=600),
        kubernetes=KubernetesConfig(namespace=NAMESPACE, replica_secret=SECRET, **kube),
    )


def engine_spec(
    engine: str, args: dict | None = None, gpus: int = 1, model: str = "/models/qwen", **kw
) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id="chat-v1-abc123",
        deployment="chat",
        version=1,
        model=model,
        engine=engine,
        engine_args=args or {},
        resources=Resources(gpu_models=["H100"], gpu_count=gpus),
        pool="h100",
        **kw,
    )


def container(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def cached(cache: ModelCache, uri: str, files: list[str]) -> Path:
    """`uri` as a complete cache entry (the layout a pull leaves), without a store."""
    key = cache_key(source_for(uri).canonical)
    folder = cache.root / "models" / key
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"x")
    entry = CacheEntry(
        uri=uri,
        pinned_uri=uri,
        key=key,
        files=[CachedFile(name=n, size=1, sha256="0" * 64) for n in files],
        size_bytes=len(files),
        pulled_at=time.time(),
        pull_s=0.0,
    )
    (folder / MANIFEST).write_text(entry.model_dump_json())
    return folder


@pytest.mark.parametrize("engine", FOREIGN)
def test_secure_engine_pod_holds_no_secret_and_serves_the_replica_identity(
    creds: Credentials, engine: str
) -> None:
    config = secure_config(creds)
    pod = replica_pod(engine_spec(engine), config, H100)
    validate(pod)
    text = json.dumps(pod)
    for secret_file in (creds.replica_key, creds.replica_cert, creds.replica_token_file):
        assert secret_file is not None and secret_file.read_text().strip() not in text
    c = container(pod)
    argv, env = c["command"], env_of(c)
    token_ref = {"secretKeyRef": {"name": SECRET, "key": "replica-token"}}
    # the key only in the variable the engine's process reads (SGLang's shim for SGLang), so
    # the container's command line (/proc/<pid>/cmdline) holds neither it nor a $(VAR) of it
    assert "--api-key" not in argv and not any("$(" in a for a in argv)
    var = {"vllm": "VLLM_API_KEY", "llama.cpp": "LLAMA_API_KEY", "sglang": "FLEET_SGLANG_API_KEY"}[engine]
    assert env[var]["valueFrom"] == token_ref
    assert all("value" in e or "valueFrom" in e for e in c["env"])
    assert not [
        e
        for e in c["env"]
        if "valueFrom" in e
        and e["name"] not in ("FLEET_ENGINE_API_KEY", "VLLM_API_KEY", "LLAMA_API_KEY", "FLEET_SGLANG_API_KEY")
    ]
    # TLS with the replica certificate of the secret volume (only its two files)
    cert, key = f"{CREDENTIALS_DIR}/replica.pem", f"{CREDENTIALS_DIR}/replica.key"
    if engine == "llama.cpp":
        assert (flag(argv, "--ssl-cert-file"), flag(argv, "--ssl-key-file")) == (cert, key)
    else:
        assert (flag(argv, "--ssl-certfile"), flag(argv, "--ssl-keyfile")) == (cert, key)
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "credentials"]
    assert [i["key"] for i in vol["secret"]["items"]] == ["replica.pem", "replica.key"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "https", "scheme": "HTTPS"}
    assert pod["spec"]["hostname"] and pod["spec"]["subdomain"] == "fleet-replicas"


@pytest.mark.parametrize("engine", FOREIGN)
def test_engine_pod_runs_the_engines_image_and_its_own_server(creds: Credentials, engine: str) -> None:
    config = secure_config(creds)
    spec = engine_spec(engine, {"max_model_len": 8192})
    c = container(replica_pod(spec, config, H100))
    assert c["image"] == ENGINE_IMAGES[engine]
    head = {
        "vllm": ["vllm", "serve", "/models/qwen"],
        "sglang": ["python3", "-c", SGLANG_SHIM],
        "llama.cpp": ["llama-server"],
    }
    assert c["command"][: len(head[engine])] == head[engine]
    assert flag(c["command"], "--port") == "8000" and flag(c["command"], "--host") == "0.0.0.0"
    assert c["command"][-2:] == ["--max-model-len", "8192"]  # the user's -e last
    name_flag = "--alias" if engine == "llama.cpp" else "--served-model-name"
    assert flag(c["command"], name_flag) == "chat"
    assert "engine.server" not in json.dumps(c) and "--drain-timeout" not in c["command"]
    # the same hardening as our engine's pod
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert env_of(c)["HOME"]["value"] == "/tmp"
    other = secure_config(creds, engine_images={engine: "registry.local/mine:1"})
    assert container(replica_pod(spec, other, H100))["image"] == "registry.local/mine:1"
    assert other.kubernetes.engine_images["vllm" if engine != "vllm" else "sglang"] != "registry.local/mine:1"


def test_fleet_engine_pod_is_unchanged(creds: Credentials) -> None:
    config = secure_config(creds)
    pod = replica_pod(engine_spec("fleet"), config, H100)
    c = container(pod)
    assert c["image"] == config.kubernetes.image and c["command"][1:3] == ["-m", "engine.server"]
    assert not [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert [p["name"] for p in c["ports"]] == ["https"]


@pytest.mark.parametrize(
    ("engine", "args", "gpus", "want"),
    [
        ("vllm", {"tensor_parallel_size": 4}, 1, "4"),
        ("vllm", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, 1, "8"),
        ("vllm", {}, 2, "2"),  # the spec's count when it asks for more
        ("sglang", {"tp_size": 8}, 1, "8"),
        ("sglang", {"tp_size": 2}, 1, "2"),
        ("llama.cpp", {}, 1, "1"),
    ],
)  # fmt: skip
def test_gpus_are_the_parallel_size(
    creds: Credentials, engine: str, args: dict, gpus: int, want: str
) -> None:
    pod = replica_pod(engine_spec(engine, args, gpus=gpus), secure_config(creds), H100)
    validate(pod)
    resources = container(pod)["resources"]
    assert resources["requests"][GPU] == resources["limits"][GPU] == want


def test_a_parallel_size_that_is_no_count_is_an_invalid_spec(creds: Credentials) -> None:
    with pytest.raises(InvalidSpec, match="tensor_parallel_size"):
        replica_pod(engine_spec("vllm", {"tensor_parallel_size": "all"}), secure_config(creds), H100)


@pytest.mark.parametrize("engine", FOREIGN)
def test_shared_memory_probes_startup_and_drain(creds: Credentials, engine: str) -> None:
    config = secure_config(creds, shm_size="16Gi", engine_startup_timeout_s=2400)
    pod = replica_pod(engine_spec(engine), config, H100)
    c = container(pod)
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2400
    assert c["readinessProbe"]["failureThreshold"] * c["readinessProbe"]["periodSeconds"] <= 15
    assert pod["spec"]["terminationGracePeriodSeconds"] == termination_grace_s(45.0) >= 45
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    # our engine keeps its own (shorter) startup bound
    fleet = container(replica_pod(engine_spec("fleet"), config, H100))["startupProbe"]
    assert fleet["failureThreshold"] == math.ceil(600 / fleet["periodSeconds"])


@pytest.mark.parametrize("engine", FOREIGN)
def test_kv_events_are_off_on_kubernetes_unless_the_operator_opts_in(creds: Credentials, engine: str) -> None:
    """ZMQ here has neither TLS nor a client identity: by default no pod binds a KV-event or
    replay socket on the pod network, even with `security`, and the agent subscribes to none."""
    config = secure_config(creds)
    assert config.kubernetes.kv_events == "off"
    spec = engine_spec(engine)
    pod = replica_pod(spec, config, H100)
    c = container(pod)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"https": 8000}
    assert "--kv-events-config" not in c["command"]
    assert kv_events_endpoints(spec, "10.0.0.7", config) is None
    # the NetworkPolicy tells foreign engines' pods by this label
    assert pod["metadata"]["labels"]["fleet.dev/engine"] == engine
    with pytest.raises(ValueError):
        KubernetesConfig(kv_events="curve")


@pytest.mark.parametrize("engine", FOREIGN)
def test_kv_events_port_for_engines_that_publish_over_zmq(creds: Credentials, engine: str) -> None:
    config = secure_config(creds, kv_events="plaintext", kv_events_port=5600, kv_replay_port=5601)
    spec = engine_spec(engine)
    c = container(replica_pod(spec, config, H100))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if engine == "llama.cpp":
        assert ports == {"https": 8000} and "--kv-events-config" not in c["command"]
        assert kv_events_endpoints(spec, "10.0.0.7", config) is None
        return
    assert ports == {"https": 8000, "kv-events": 5600, "kv-replay": 5601}
    kv_config = flag(c["command"], "--kv-events-config")
    assert kv_config == kv_events_config(engine, "tcp://*:5600", replay_endpoint="tcp://*:5601")
    assert json.loads(kv_config)["publisher"] == "zmq"
    assert kv_events_endpoints(spec, "10.0.0.7", config) == ("tcp://10.0.0.7:5600", "tcp://10.0.0.7:5601")
    assert kv_events_endpoints(spec, "fd00::7", config) == ("tcp://[fd00::7]:5600", "tcp://[fd00::7]:5601")
    assert kv_events_endpoints(engine_spec("fleet"), "10.0.0.7", config) is None


@pytest.mark.parametrize(
    ("engine", "model", "files", "want"),
    [
        ("vllm", HF_URI, ["config.json", "model.safetensors"], ""),
        ("sglang", HF_URI, ["config.json", "model.safetensors"], ""),
        ("llama.cpp", GGUF_URI, ["README.md", "qwen-q4_k_m-00001-of-00002.gguf", "qwen-q4_k_m-00002-of-00002.gguf"], "/qwen-q4_k_m-00001-of-00002.gguf"),
    ],
)  # fmt: skip
def test_model_uri_becomes_the_verified_path_in_the_read_only_volume(
    creds: Credentials, tmp_path: Path, engine: str, model: str, files: list[str], want: str
) -> None:
    config = secure_config(creds)
    cache = ModelCache(tmp_path / "agent-view")
    folder = cached(cache, model, files)
    spec = engine_spec(engine, model=model)
    path = pod_model_path(spec, config, cache)
    assert path == f"/models/models/{folder.name}{want}"
    pod = replica_pod(spec, config, H100, model_path=path)
    validate(pod)
    c = container(pod)
    assert path in c["command"] and model not in c["command"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
    assert vol["persistentVolumeClaim"]["readOnly"] is True
    # a local path or a hub id is the engine's to open, as given
    assert pod_model_path(engine_spec(engine, model="/models/local"), config, None) == "/models/local"


def test_model_uri_without_the_agents_cache_is_refused_clearly(creds: Credentials, tmp_path: Path) -> None:
    config = secure_config(creds)
    with pytest.raises(InvalidSpec, match="model_cache_dir"):
        pod_model_path(engine_spec("vllm", model=HF_URI), config, None)
    with pytest.raises(EngineUnavailable, match="not in the node cache"):
        pod_model_path(engine_spec("vllm", model=HF_URI), config, ModelCache(tmp_path))
    (folder := tmp_path / "c").mkdir()
    cache = ModelCache(folder)
    cached(cache, GGUF_URI, ["config.json", "model.safetensors"])
    with pytest.raises(EngineUnavailable, match="gguf"):
        pod_model_path(engine_spec("llama.cpp", model=GGUF_URI), config, cache)


@pytest.mark.parametrize(
    "key", ["api_key", "ssl_certfile", "ssl_key_file", "kv_events_config", "alias", "port", "model_path"]
)
def test_engine_args_cannot_override_what_fleet_sets(creds: Credentials, key: str) -> None:
    with pytest.raises(InvalidSpec, match=key):
        replica_pod(engine_spec("vllm", {key: "x"}), secure_config(creds), H100)


def test_lora_slots_per_engine(creds: Credentials) -> None:
    config = secure_config(creds)
    vllm = container(replica_pod(engine_spec("vllm", max_adapters=4), config, H100))
    assert flag(vllm["command"], "--max-loras") == "4" and "--enable-lora" in vllm["command"]
    assert env_of(vllm)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    sglang = container(replica_pod(engine_spec("sglang", max_adapters=4), config, H100))
    assert flag(sglang["command"], "--max-loras-per-batch") == "4"
    llama = container(replica_pod(engine_spec("llama.cpp", max_adapters=4), config, H100))
    assert "--lora" not in " ".join(llama["command"])  # no hot-loading: the capability table says so


def test_foreign_argv_is_the_process_runtimes_command_too() -> None:
    spec = engine_spec("vllm", {"tensor_parallel_size": 2})
    argv = foreign_argv(spec, model_path="/m", port=9000, host="127.0.0.1")
    assert argv[:3] == ["vllm", "serve", "/m"] and flag(argv, "--tensor-parallel-size") == "2"
    assert "--api-key" not in argv


def test_the_kv_event_port_is_not_the_serving_port() -> None:
    with pytest.raises(ValueError, match="must differ"):
        KubernetesConfig(port=5557)
    with pytest.raises(ValueError, match="must differ"):
        KubernetesConfig(kv_replay_port=5557)
    assert KubernetesConfig(port=5557, kv_events_port=5600).kv_events_port == 5600


def test_without_security_plain_http_and_no_key(tmp_path: Path) -> None:
    config = ClusterConfig(cluster="c", pools=POOLS, kubernetes=KubernetesConfig(namespace=NAMESPACE))
    c = container(replica_pod(engine_spec("sglang"), config, H100))
    assert "--api-key" not in c["command"] and "--ssl-certfile" not in c["command"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}


async def test_runtime_creates_the_engine_pod_with_the_cached_path(
    api: FakeApiServer, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "models"
    config = config_for(api, tmp_path).model_copy(update={"model_cache_dir": cache_dir})
    folder = cached(ModelCache(cache_dir), HF_URI, ["config.json", "model.safetensors"])
    rt = KubernetesRuntime(config)
    try:
        spec = engine_spec("vllm", {"tensor_parallel_size": 2}, model=HF_URI).model_copy(
            update={"pool": "h100-spot"}
        )
        handle = await rt.start(spec)
        stored = api.pod(handle.pod.split("/")[1], namespace=NAMESPACE)
        c = container(stored)
        assert c["command"][:3] == ["vllm", "serve", f"/models/models/{folder.name}"]
        assert c["resources"]["limits"][GPU] == "2"
        assert handle.argv == c["command"]
        bare = KubernetesRuntime(config_for(api, tmp_path))
        with pytest.raises(InvalidSpec, match="model_cache_dir"):
            await bare.start(spec)
        assert len(api.pods(NAMESPACE)) == 1  # refused before any API call
        await bare.close()
    finally:
        await rt.close()


async def test_stop_waits_until_a_foreign_engine_is_idle(api: FakeApiServer, tmp_path: Path) -> None:
    """vLLM cuts in-flight requests on SIGTERM: the pod is deleted only once its /metrics
    (here a stand-in answering as vLLM does) shows nothing running or waiting."""
    import asyncio

    import httpx

    from agent.engine_kv_subscriber import ENDPOINTS
    from tests.agent.kube.conftest import run_ready
    from tests.polling import eventually

    busy = {"left": 3}
    seen: list[str] = []

    def metrics(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        running = 2 if busy["left"] > 0 else 0
        busy["left"] -= 1
        return httpx.Response(200, text=f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n")

    rt = KubernetesRuntime(config_for(api, tmp_path, kv_events="plaintext"))
    rt.http_transport = httpx.MockTransport(metrics)
    try:
        spec = engine_spec("vllm").model_copy(update={"pool": "h100-spot"})
        handle = await rt.start(spec)
        name = handle.pod.split("/")[1]
        run_ready(api, name)
        await eventually(lambda: rt.poll(handle), what="polled")
        assert handle.url == "http://10.0.0.7:8000"
        # the agent subscribes to the pod's KV events and asks its replay socket for gaps
        (endpoint, _) = ENDPOINTS.get(handle.replica_id) or (None, None)
        assert endpoint is not None
        assert (endpoint.publish, endpoint.replay) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
        stop = asyncio.create_task(rt.stop(handle, drain_timeout_s=10.0))
        await eventually(
            lambda: api.pod(name, NAMESPACE)["metadata"].get("deletionTimestamp"), what="deleted"
        )
        assert len(seen) == 4 and seen[0] == "http://10.0.0.7:8000/metrics"  # three busy looks, one idle
        api.terminate(name, 0, "Completed", namespace=NAMESPACE)
        api.finish_termination(name, namespace=NAMESPACE)
        await asyncio.wait_for(stop, 10)
        assert ENDPOINTS.get(handle.replica_id) is None  # released with the replica
        # our engine drains itself on SIGTERM: deleted without a look at its metrics
        seen.clear()
        fleet = await rt.start(
            engine_spec("fleet").model_copy(update={"pool": "h100-spot", "replica_id": "chat-v1-def456"})
        )
        run_ready(api, fleet.pod.split("/")[1])
        await eventually(lambda: rt.poll(fleet), what="polled")
        stop = asyncio.create_task(rt.stop(fleet, drain_timeout_s=10.0))
        await eventually(
            lambda: api.pod(fleet.pod.split("/")[1], NAMESPACE)["metadata"].get("deletionTimestamp"),
            what="deleted",
        )
        assert seen == []
        stop.cancel()
    finally:
        await rt.close()
