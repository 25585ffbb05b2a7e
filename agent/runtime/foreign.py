"""How the process runtime starts a replica of a foreign engine (vLLM, SGLang, llama.cpp)
on this host: which executable (`fleet_base.engine_binaries`), which local model path (the
node cache's verified files for a remote model), which address, key and TLS.

The replica is reached by this host's gateway only, so it listens on loopback. It requires
the cluster's replica token (the bearer the gateway and agent already send our replicas),
handed over in the engine's own environment variable. With the cluster's security on it
serves HTTPS with the replica certificate where the build can; a build that cannot (our
llama-server build has no OpenSSL) serves plain HTTP on loopback and the replica's `note`
and log say so."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.engine_kv_subscriber import KvEventsEndpoint
from agent.runtime.command import foreign_argv
from fleet_base.engine_binaries import EngineNotFound, find_executable, serves_tls
from fleet_base.engines import TlsFiles, launch_env, lora_launch
from fleet_base.models import ModelCache, ModelStoreError, is_remote
from fleet_base.protocol import ReplicaSpec
from fleet_base.security.tls import Credentials

LOOPBACK = "127.0.0.1"
# The model file an engine that reads one file (llama.cpp) is given out of a cached directory.
_SINGLE_FILE_SUFFIX = {"llama.cpp": ".gguf"}


class EngineUnavailable(RuntimeError):
    """The engine cannot be started here now (no executable, model not in the cache); a
    retry after the operator fixed it may work, so it is no InvalidSpec."""


@dataclass(frozen=True)
class Launch:
    """How one replica is started: its command line, environment added to the agent's,
    where it listens and whether it serves HTTPS; `note`: what an operator should know."""

    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    host: str = LOOPBACK
    https: bool = False
    note: str = ""


def local_model_path(spec: ReplicaSpec, cache_dir: Path | str | None) -> str:
    """What the engine is given as its model: a local path as it is; a remote model as its
    directory in the node cache (pulled and verified before the replica starts), or the one
    file of the engine's format in it."""
    if not is_remote(spec.model):
        return str(Path(spec.model).expanduser())
    cache = ModelCache(cache_dir)
    try:
        entry = cache.lookup(spec.model)
    except ModelStoreError as err:
        raise EngineUnavailable(f"model {spec.model}: {err}") from err
    if entry is None:
        raise EngineUnavailable(f"model {spec.model} is not in the node cache {cache.root}")
    folder = cache.model_dir(entry)
    suffix = _SINGLE_FILE_SUFFIX.get(spec.engine)
    if suffix is None:
        return str(folder)
    files = sorted(f.name for f in entry.files if f.name.endswith(suffix))
    if not files:
        raise EngineUnavailable(f"model {spec.model} has no {suffix} file for {spec.engine}")
    return str(folder / files[0])  # split GGUFs: the engine finds the later parts itself


def foreign_launch(
    spec: ReplicaSpec,
    port: int,
    security: Credentials,
    cache_dir: Path | str | None,
    kv_events: KvEventsEndpoint | None = None,
) -> Launch:
    try:
        executable = find_executable(spec.engine)
    except EngineNotFound as err:
        raise EngineUnavailable(str(err)) from err
    token = security.replica_token if security.enabled else None
    tls = None
    note = ""
    if security.enabled and security.replica_cert is not None and security.replica_key is not None:
        if serves_tls(spec.engine, executable):
            tls = TlsFiles(certfile=str(security.replica_cert), keyfile=str(security.replica_key))
        else:
            note = (
                f"{spec.engine} build {executable} has no TLS support: serving plain HTTP on "
                f"loopback {LOOPBACK}:{port} only (the replica token is still required)"
            )
    argv = foreign_argv(
        spec,
        model_path=local_model_path(spec, cache_dir),
        port=port,
        host=LOOPBACK,
        api_key=token,
        tls=tls,
        kv_events_endpoint=kv_events.publish if kv_events else None,
        kv_events_replay_endpoint=kv_events.replay if kv_events else None,
        python=executable,
    )
    argv[0] = executable  # llama-server / vllm by path (sglang's is the Python given)
    env = {**launch_env(spec.engine, token), **lora_launch(spec.engine, spec.max_adapters)[1]}
    return Launch(argv, port, env=env, https=tls is not None, note=note)
