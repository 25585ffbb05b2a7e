"""What a replica pod running vLLM, SGLang or llama.cpp (`ReplicaSpec.engine`) has that
our own engine's pod does not; kube_pod builds the rest of the pod the same way.

- image: `kubernetes.engine_images[engine]` (Fleet's images on the engines' official ones);
- command: `agent.runtime.command.foreign_argv`, the engine's own server on the pod's port,
  serving the verified local path of the model (`pod_model_path`), never the URI;
- identity, as for our engine: with `security`, HTTPS with the replica certificate from the
  replica Secret's volume and the replica token as the engine's API key, by secretKeyRef into
  the variable the engine's process reads (`fleet_base.engines.API_KEY_ENV`; SGLang through
  `SGLANG_SHIM`), so neither the pod object nor the container's command line holds it;
- GPUs: `agent.runtime.gpus.replica_gpu_count` (the engine's parallel size or the spec's
  count, whichever is larger); /dev/shm as a memory emptyDir (tensor-parallel workers share through it);
- KV events, only with `kubernetes.kv_events: plaintext` (ZMQ has no TLS or client identity
  here): vLLM and SGLang publish on `kubernetes.kv_events_port` of every pod address and
  replay missed batches on `kubernetes.kv_replay_port` (`kv_events_endpoints` is where the
  agent subscribes and asks);
- probes on the engine's own health path; a startup bound of `startup_timeout_s`
  (`agent.runtime.base`, shared with the process runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.runtime.base import InvalidSpec
from agent.runtime.command import foreign_argv
from agent.runtime.foreign import local_model_path
from agent.runtime.gpus import replica_gpu_count
from agent.security.replica_auth import SECRET_TOKEN
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import API_KEY_ENV, CAPABILITIES, EngineKind, TlsFiles, lora_launch
from fleet_base.models import ModelCache, is_remote
from fleet_base.protocol import ReplicaSpec

SHM_VOLUME = "dshm"
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"
# Telemetry a self-hosted platform does not send home (vLLM's usage stats).
QUIET_ENV = {"vllm": {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}}


@dataclass
class EngineContainer:
    """The parts of a foreign engine's container and pod that differ from our engine's."""

    image: str
    command: list[str]
    env: list[dict]
    health_path: str
    gpus: int
    ports: list[dict] = field(default_factory=list)  # beyond the serving port
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)


def is_foreign(spec: ReplicaSpec) -> bool:
    return spec.engine != "fleet"


def pod_model_path(spec: ReplicaSpec, config: ClusterConfig, cache: ModelCache | None) -> str:
    """The model as a foreign engine opens it inside the pod: a local path or hub id as
    given; a model URI (hf://, s3://, oci://, https://) as the process runtime's choice in
    the verified cache entry (`agent.runtime.foreign.local_model_path`: the folder, or
    llama.cpp's .gguf in it) under the model volume's mount path. The agent finds the
    entry in `cache`, the same volume mounted into the agent (`model_cache_dir`): the
    engines cannot read our URIs, and the agent pulled and verified the files before this
    start. InvalidSpec when there is no such cache; EngineUnavailable (retried after the
    backoff) when the entry or its file is not there."""
    if not is_remote(spec.model):
        return spec.model
    volume = config.kubernetes.model_volume
    if cache is None or volume.kind == "none":
        raise InvalidSpec(
            f"engine {spec.engine} cannot read the model URI {spec.model!r}: mount the model volume "
            "into the agent too and set model_cache_dir, so the agent pulls and verifies the model "
            "and hands the engine its local path"
        )
    local = Path(local_model_path(spec, cache.root)).relative_to(cache.root)
    return f"{volume.mount_path.rstrip('/')}/{local.as_posix()}"


def engine_container(
    spec: ReplicaSpec, config: ClusterConfig, model_path: str, tls: TlsFiles | None
) -> EngineContainer:
    """The container parts of `spec`'s foreign engine; with `tls` (the replica certificate's
    files in the pod), it serves HTTPS and requires the replica token from
    `kubernetes.replica_secret`."""
    kind = spec.engine
    caps = CAPABILITIES[kind]
    kc = config.kubernetes
    env: list[dict] = []
    if tls is not None:
        ref = {"secretKeyRef": {"name": kc.replica_secret, "key": SECRET_TOKEN}}
        env.append({"name": API_KEY_ENV[kind], "valueFrom": ref})
    zmq = kv_events_on(kind, config)  # the engine binds both on every pod address
    kv_endpoint = f"tcp://*:{kc.kv_events_port}" if zmq else None
    kv_replay = f"tcp://*:{kc.kv_replay_port}" if zmq else None
    command = foreign_argv(
        spec,
        model_path=model_path,
        port=kc.port,
        host="0.0.0.0",
        tls=tls,
        kv_events_endpoint=kv_endpoint,
        kv_events_replay_endpoint=kv_replay,
        python="python3",
    )
    ours = {e["name"] for e in env} | {"HOME"}
    extra = {**QUIET_ENV.get(kind, {}), **lora_launch(kind, spec.max_adapters)[1], **config.replica.env}
    env = [{"name": k, "value": v} for k, v in sorted(extra.items()) if k not in ours] + env
    env.append({"name": "HOME", "value": "/tmp"})
    gpus = replica_gpu_count(spec)
    out = EngineContainer(
        image=kc.engine_images[kind],
        command=command,
        env=env,
        health_path=caps.health_path,
        gpus=gpus,
        volumes=[{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": kc.shm_size}}],
        mounts=[{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    )
    if zmq:
        out.ports += [
            {"name": KV_EVENTS_PORT_NAME, "containerPort": kc.kv_events_port, "protocol": "TCP"},
            {"name": KV_REPLAY_PORT_NAME, "containerPort": kc.kv_replay_port, "protocol": "TCP"},
        ]
    return out


def kv_events_endpoints(spec: ReplicaSpec, pod_ip: str, config: ClusterConfig) -> tuple[str, str] | None:
    """(where the agent subscribes to a replica pod's KV events, where it asks for the
    batches it missed), both ZMQ; None for an engine that publishes none over ZMQ (ours
    posts them to the agent's relay)."""
    if not is_foreign(spec) or not kv_events_on(spec.engine, config) or not pod_ip:
        return None
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    kc = config.kubernetes
    return f"tcp://{host}:{kc.kv_events_port}", f"tcp://{host}:{kc.kv_replay_port}"


def kv_events_on(kind: EngineKind, config: ClusterConfig) -> bool:
    """Whether a pod of this engine publishes KV events: one that has them over ZMQ, where
    the operator opted into plaintext ones (`kubernetes.kv_events`)."""
    return CAPABILITIES[kind].kv_events == "zmq" and config.kubernetes.kv_events == "plaintext"
