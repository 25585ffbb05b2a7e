"""What each inference engine Fleet can drive offers, and how to start its server.

One table (`CAPABILITIES`) that routing, stream migration, LoRA routing, batch workers, the
autoscaler and health probes read, so a feature an engine lacks is refused or skipped in one
place rather than discovered as a failed request. `launch_command` is the pure argv a launcher
runs (process runtime) or puts in a container spec (Kubernetes runtime). See docs/engines.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple, get_args

from pydantic import BaseModel, ConfigDict

EngineKind = Literal["fleet", "vllm", "sglang", "llama.cpp"]
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)

KvEventsTransport = Literal["http", "zmq"]


class LoraApi(BaseModel):
    """An engine's runtime adapter API: POST `load_path` with {"lora_name", "lora_path"} and
    `unload_path` with {"lora_name"} (the body vLLM, SGLang and our engine all take).
    `local_path`: `lora_path` must be a directory on the server's host, so the agent pulls
    the adapter into the node model cache and sends that; our engine reads Fleet's model
    URIs (hf://, s3://, ...) itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    load_path: str
    unload_path: str
    local_path: bool


class EngineCapabilities(BaseModel):
    """What one engine offers a Fleet deployment, from its own documentation.

    `lora_load`: adapters can be loaded and unloaded while the server runs (without it, only
    adapters named at launch can be served). `continuation_from_token_ids`: a request can
    resume from the prompt plus already generated token ids (what stream migration needs).
    `prompt_token_ids`: a completion prompt may be token ids rather than text.
    `metrics_prefix`: the name prefix of the engine's Prometheus series, read by
    agent/replica_metrics.py. `metrics_flag`: what the server needs to expose /metrics at all.
    `drains_on_sigterm`: SIGTERM lets in-flight requests finish (else the launcher waits for
    the replica to be idle before it signals). `fleet_continuation`: the replica speaks
    Fleet's stream-continuation form (token ids on streamed chunks, a resume field;
    fleet_base/openai_contract/continuation.py), which the gateway's stream migration needs.
    `embeddings`: /v1/embeddings is served whatever model runs (else only by a deployment
    `serves_embeddings` says is an embedding one). `cache_salt`: the request field
    `cache_salt` is mixed into the prefix cache's block hashes (and a published block's),
    which is what keeps one API key's cached prompts from another's
    (agent/gateway/tenancy.py); without it the field is not sent, prefix keys are unsalted
    and the engine's own cache is shared between tenants (`tenant_notes`). `lora_api`: how
    adapters are loaded while the server runs (None: they cannot be).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_events: KvEventsTransport | None
    lora_load: bool
    continuation_from_token_ids: bool
    prompt_token_ids: bool
    embeddings: bool
    structured_outputs: bool
    tls: bool
    tensor_parallel: bool
    metrics_prefix: str
    metrics_flag: str | None
    health_path: str
    default_port: int
    drains_on_sigterm: bool = False
    fleet_continuation: bool = False
    batch_invariant: bool = False
    cache_salt: bool = False
    lora_api: LoraApi | None = None


CAPABILITIES: dict[EngineKind, EngineCapabilities] = {
    # Fleet's own engine: docs/engine.md, docs/metrics.md, docs/lora.md, docs/stream-migration.md.
    # Prefix-cache events go to the agent's relay over HTTP (agent/kv_relay.py).
    "fleet": EngineCapabilities(
        kv_events="http",
        lora_load=True,
        continuation_from_token_ids=True,
        prompt_token_ids=True,
        embeddings=True,
        structured_outputs=True,
        tls=True,
        tensor_parallel=False,
        metrics_prefix="fleet_engine_",
        metrics_flag=None,
        health_path="/health",
        default_port=8000,
        drains_on_sigterm=True,
        fleet_continuation=True,
        batch_invariant=True,
        cache_salt=True,
        lora_api=LoraApi(
            load_path="/v1/load_lora_adapter", unload_path="/v1/unload_lora_adapter", local_path=False
        ),
    ),
    # https://docs.vllm.ai/en/stable/cli/serve/ (flags), .../usage/metrics/ (vllm:* series),
    # .../features/lora/ (/v1/load_lora_adapter with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True),
    # .../examples/online_serving/kv_events_subscriber/ (ZMQ msgpack KV events),
    # .../features/structured_outputs/; /v1/completions accepts a list of token ids as prompt.
    # `cache_salt` on chat and completion requests salts the first block's hash, and its
    # BlockStored events carry the salt in `extra_keys` (vllm/distributed/kv_events.py).
    # LoRA: `lora_path` is a local directory. Embeddings: a pooling model only (`runner`).
    "vllm": EngineCapabilities(
        kv_events="zmq",
        lora_load=True,
        continuation_from_token_ids=True,
        prompt_token_ids=True,
        embeddings=False,
        structured_outputs=True,
        tls=True,
        tensor_parallel=True,
        metrics_prefix="vllm:",
        metrics_flag=None,
        health_path="/health",
        default_port=8000,
        cache_salt=True,
        lora_api=LoraApi(
            load_path="/v1/load_lora_adapter", unload_path="/v1/unload_lora_adapter", local_path=True
        ),
    ),
    # https://docs.sglang.io/references/production_metrics (sglang:* with --enable-metrics),
    # https://docs.sglang.io/advanced_features/server_arguments (flags, --kv-events-config),
    # .../advanced_features/lora (/load_lora_adapter, /unload_lora_adapter); the native
    # /generate endpoint takes `input_ids`; /health answers once the scheduler is up.
    # The radix cache is keyed by tokens alone (no cache salt; its KV events carry none).
    # Embeddings: only with --is-embedding (an embedding-only server).
    "sglang": EngineCapabilities(
        kv_events="zmq",
        lora_load=True,
        continuation_from_token_ids=True,
        prompt_token_ids=True,
        embeddings=False,
        structured_outputs=True,
        tls=True,
        tensor_parallel=True,
        metrics_prefix="sglang:",
        metrics_flag="--enable-metrics",
        health_path="/health",
        default_port=30000,
        lora_api=LoraApi(load_path="/load_lora_adapter", unload_path="/unload_lora_adapter", local_path=True),
    ),
    # https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md: /health (503
    # while loading), /metrics with llamacpp:* only with --metrics, /slots; /completion takes
    # a prompt of token ids (or mixed), which is what continuation needs. No KV-cache events.
    # POST /lora-adapters only rescales adapters given at launch with --lora: no hot load.
    # TLS only in builds with LLAMA_SERVER_SSL (--ssl-key-file/--ssl-cert-file); no tensor
    # parallelism (layers split across devices instead). Its slots' prompt cache knows no
    # salt: the launcher turns it off (--no-cache-prompt). /v1/embeddings only with
    # --embeddings, which makes the server embedding-only.
    "llama.cpp": EngineCapabilities(
        kv_events=None,
        lora_load=False,
        continuation_from_token_ids=True,
        prompt_token_ids=True,
        embeddings=False,
        structured_outputs=True,
        tls=True,
        tensor_parallel=False,
        metrics_prefix="llamacpp:",
        metrics_flag="--metrics",
        health_path="/health",
        default_port=8080,
    ),
}


class TlsFiles(BaseModel):
    """The replica's server certificate and key (and the CA clients present, if any)."""

    model_config = ConfigDict(frozen=True)

    certfile: str
    keyfile: str
    ca_certs: str | None = None


def kv_events_config(
    kind: EngineKind, endpoint: str, topic: str = "kv-events", replay_endpoint: str | None = None
) -> str:
    """The `--kv-events-config` JSON that makes vLLM or SGLang publish KV events on `endpoint`
    (a ZMQ address the engine binds when it has a wildcard, "tcp://*:5557", and connects to
    otherwise: the agent's loopback socket, agent.engine_kv_subscriber) and serve replays of
    missed batches on `replay_endpoint` (always bound). vLLM also needs its
    `enable_kv_cache_events` switch; SGLang's config has no such field."""
    config: dict[str, object] = {"publisher": "zmq", "endpoint": endpoint, "topic": topic}
    if replay_endpoint is not None:
        config["replay_endpoint"] = replay_endpoint
    if kind == "vllm":
        config = {"enable_kv_cache_events": True, **config}
    return json.dumps(config, separators=(",", ":"))


# The engine arguments (`-e` keys) whose product is the number of GPUs one server uses: a
# replica must be given that many devices. Only engines with `tensor_parallel` are listed.
# SGLang's `tp` is how its docs write --tp-size (argparse takes the prefix).
PARALLEL_ARGS: dict[EngineKind, tuple[tuple[str, ...], ...]] = {
    "vllm": (("tensor_parallel_size",), ("pipeline_parallel_size",)),
    "sglang": (("tp_size", "tp", "tensor_parallel_size"), ("pp_size", "pipeline_parallel_size")),
}


def parallel_args(kind: EngineKind, engine_args: Mapping[str, object]) -> list[str]:
    """The parallel-size arguments `engine_args` give `kind` (none: its GPU count is the
    deployment's own)."""
    return [n for names in PARALLEL_ARGS.get(kind, ()) for n in names if engine_args.get(n) is not None]


def parallel_gpus(kind: EngineKind, engine_args: Mapping[str, object]) -> int:
    """The devices one `kind` server spans for these engine arguments (1 without parallelism):
    vLLM's tensor x pipeline parallel sizes, SGLang's tp x pp sizes. ValueError for a size
    that is not a positive integer, or one size given under two names."""
    gpus = 1
    for names in PARALLEL_ARGS.get(kind, ()):
        given = [name for name in names if engine_args.get(name) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} name the same size: give one")
        for name in given:
            value = engine_args[name]
            if isinstance(value, bool) or not str(value).isdigit() or int(str(value)) < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
            gpus *= int(str(value))
    return gpus


# The environment variable each engine's process reads its API key from: a key in argv is
# visible to every local user in /proc/<pid>/cmdline. vLLM and llama.cpp read theirs; SGLang
# reads none, so `SGLANG_SHIM` reads this one and hands the key to SGLang's own argument parser
# inside the process (`sys.argv` is not /proc/<pid>/cmdline).
API_KEY_ENV: dict[EngineKind, str] = {
    "vllm": "VLLM_API_KEY",
    "llama.cpp": "LLAMA_API_KEY",
    "sglang": "FLEET_SGLANG_API_KEY",
}

# `python -c SGLANG_SHIM <sglang.launch_server's flags>`: runs `python -m sglang.launch_server`
# with `--api-key` from FLEET_SGLANG_API_KEY added in-process. Plain Python (runpy), so it needs
# nothing of Fleet in the engine's image or environment; `alter_sys` makes the module
# `__main__` with its own spec exactly as `-m` does, which SGLang's spawned workers rely on.
SGLANG_SHIM = (
    "import os,runpy,sys;"
    "k=os.environ.pop('FLEET_SGLANG_API_KEY','');"
    "sys.argv+=['--api-key',k] if k else [];"
    "runpy.run_module('sglang.launch_server',run_name='__main__',alter_sys=True)"
)

# Flags whose value is a secret (not a path to one): masked wherever a command line is
# written down (logs, stored state).
SECRET_FLAGS = frozenset({"--api-key"})
REDACTED = "***"


def redact_text(text: str, secrets: Sequence[str | None]) -> str:
    """`text` (an engine's log: SGLang prints its parsed arguments, the key among them) with
    each of `secrets` masked, before it leaves the host in an error or event."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of every `SECRET_FLAGS` flag masked (`--api-key X` and
    `--api-key=X`); everything else, the port and `--kv-events-config` included, as is."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(REDACTED)
            mask_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            out.append(f"{flag}={REDACTED}" if eq else arg)
            mask_next = not eq
        else:
            out.append(arg)
    return out


def launch_env(kind: EngineKind, api_key: str | None) -> dict[str, str]:
    """The environment to add to `launch_command(..., api_key_in_env=True)`'s process."""
    name = API_KEY_ENV.get(kind)
    return {name: api_key} if api_key and name else {}


def lora_launch(kind: EngineKind, max_loras: int) -> tuple[list[str], dict[str, str]]:
    """(flags, environment) that give a `kind` server `max_loras` adapter slots loadable while
    it runs; nothing for 0 or for an engine without `lora_load` (llama.cpp only rescales
    adapters named at launch). vLLM refuses /v1/load_lora_adapter unless its environment
    allows runtime updates."""
    if max_loras <= 0 or not CAPABILITIES[kind].lora_load:
        return [], {}
    if kind == "vllm":
        return ["--enable-lora", "--max-loras", str(max_loras)], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if kind == "sglang":
        return ["--enable-lora", "--max-loras-per-batch", str(max_loras)], {}
    return [], {}


# llama-server serves each connection, while it is kept alive, on one thread of a fixed pool
# (default max(slots + 4, cores - 1)); a connection beyond it is not accepted (with TLS: no
# handshake) until one frees, and the gateway's connect timeout fails it. The gateway's and
# the agent's connections to one replica outnumber that default under load (seen live with 8
# concurrent requests on 4 slots), so Fleet sizes the pool; `-e threads_http=N` overrides it.
LLAMA_HTTP_THREADS = 64

# llama-server reuses a slot's cached prompt prefix (and its RAM prompt cache) for any request,
# whichever API key sent it, and knows no cache salt: a tenant could time another's prompt.
# Off by default; a single-tenant deployment may turn it back on with `-e cache_prompt=true`
# (the later flag wins), at the cost of that isolation (docs/security.md).
NO_SHARED_PROMPT_CACHE = ("--no-cache-prompt",)


def launch_command(
    kind: EngineKind,
    model_path: str,
    port: int,
    api_key: str | None,
    served_name: str,
    extra_args: Sequence[str] = (),
    *,
    host: str = "0.0.0.0",
    tensor_parallel: int = 1,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    tls: TlsFiles | None = None,
    python: str = "python",
    api_key_in_env: bool = False,
) -> list[str]:
    """The argv that starts `kind`'s OpenAI-compatible server on `port` with the flags Fleet
    relies on: its API key, the deployment's model name, metrics, KV events (where the engine
    publishes them) and TLS. `extra_args` (the user's `-e` pass-through) come last, so a user
    flag the engine parses last-wins overrides ours.

    With `api_key_in_env`, no engine gets an `--api-key` flag: its process reads the key
    from `launch_env` (SGLang through `SGLANG_SHIM`). The `fleet` engine's own launcher
    lives in agent/runtime; this covers foreign engines."""
    caps = CAPABILITIES[kind]
    if api_key_in_env and kind in API_KEY_ENV:
        api_key = None
    if tls is not None and not caps.tls:
        raise ValueError(f"{kind} does not serve TLS")
    if kv_events_endpoint is not None and caps.kv_events != "zmq":
        raise ValueError(f"{kind} does not publish KV events over ZMQ")
    if tensor_parallel < 1:
        raise ValueError("tensor_parallel must be at least 1")
    if tensor_parallel > 1 and not caps.tensor_parallel:
        raise ValueError(f"{kind} has no tensor parallelism")
    if kind == "vllm":
        argv = ["vllm", "serve", model_path, "--host", host, "--port", str(port)]
        argv += ["--served-model-name", served_name]
        argv += _tp_flags("--tensor-parallel-size", tensor_parallel) + _key_flags(api_key)
    elif kind == "sglang":
        start = ["-c", SGLANG_SHIM] if api_key_in_env else ["-m", "sglang.launch_server"]
        argv = [python, *start, "--model-path", model_path]
        argv += ["--host", host, "--port", str(port), "--served-model-name", served_name]
        argv += _tp_flags("--tp-size", tensor_parallel) + _key_flags(api_key)
        argv.append("--enable-metrics")
    elif kind == "llama.cpp":
        argv = ["llama-server", "-m", model_path, "--host", host, "--port", str(port)]
        argv += ["--alias", served_name, "--metrics", "--slots", *_key_flags(api_key)]
        argv += ["--threads-http", str(LLAMA_HTTP_THREADS), *NO_SHARED_PROMPT_CACHE]
    else:
        raise ValueError(f"no foreign launch command for engine {kind!r}")
    if kv_events_endpoint:
        config = kv_events_config(kind, kv_events_endpoint, replay_endpoint=kv_events_replay_endpoint)
        argv += ["--kv-events-config", config]
    if tls:
        argv += _tls_flags(kind, tls)
    return argv + list(extra_args)


def _tp_flags(name: str, size: int) -> list[str]:
    return [name, str(size)] if size > 1 else []


def _key_flags(api_key: str | None) -> list[str]:
    return ["--api-key", api_key] if api_key else []


def _tls_flags(kind: EngineKind, tls: TlsFiles) -> list[str]:
    if kind == "llama.cpp":
        return ["--ssl-cert-file", tls.certfile, "--ssl-key-file", tls.keyfile]
    out = ["--ssl-certfile", tls.certfile, "--ssl-keyfile", tls.keyfile]
    if kind == "vllm" and tls.ca_certs:
        out += ["--ssl-ca-certs", tls.ca_certs]
    return out


# ------------------------------------------------------------------ what a deployment serves

# The engine arguments that make a deployment of an engine without `embeddings` an embedding
# one: vLLM's pooling runner (`runner=pooling`, or `convert=embed`; `task=embed` before
# v0.11), SGLang's --is-embedding, llama-server's --embeddings. Each such server then serves
# embeddings only.
EMBEDDING_ARGS: dict[EngineKind, dict[str, frozenset[object]]] = {
    "vllm": {
        "runner": frozenset({"pooling"}),
        "convert": frozenset({"embed"}),
        "task": frozenset({"embed", "embedding"}),
    },
    "sglang": {"is_embedding": frozenset({True, "true"})},
    "llama.cpp": {"embeddings": frozenset({True, "true"}), "embedding": frozenset({True, "true"})},
}


def serves_embeddings(kind: EngineKind, engine_args: Mapping[str, object]) -> bool:
    """Whether a `kind` deployment with these engine arguments answers /v1/embeddings."""
    if CAPABILITIES[kind].embeddings:
        return True
    for key, values in EMBEDDING_ARGS.get(kind, {}).items():
        value = engine_args.get(key)
        if isinstance(value, str):
            value = value.strip().lower()
        if value in values:
            return True
    return False


def tenant_notes(kind: EngineKind) -> list[str]:
    """What a deployment on `kind` gives up of tenant isolation, said at deploy: [] for an
    engine whose prefix cache takes the gateway's per-key `cache_salt`."""
    if CAPABILITIES[kind].cache_salt:
        return []
    if kind == "llama.cpp":
        return [
            "llama.cpp has no per-tenant cache salt: its prompt cache is off (--no-cache-prompt), "
            "so every request prefills its whole prompt; `-e cache_prompt=true` turns it back on "
            "for a single-tenant deployment only (one API key could then time another's prompts)"
        ]
    return [
        f"{kind} has no per-tenant cache salt: its prefix cache is shared by every API key, so one "
        "tenant can tell (cached_tokens, time to first token) whether another sent a prompt; "
        "serve a single tenant per deployment"
    ]


# ------------------------------------------------------------------ what a deployment may ask

# `-e` keys that describe the deployment to Fleet's planner and simulator rather than flags of
# a server: the performance profile (`profile`, `profile_<GPU>`) and an assumed cold start.
# The simulated replica reads them; a real engine (ours or a foreign one) never sees them, so
# `-e profile_a100=...` on a vLLM deployment is not an unknown flag that stops vLLM.
PLANNING_ARGS = frozenset({"profile", "cold_start"})


def is_planning_arg(key: str) -> bool:
    return key in PLANNING_ARGS or key.startswith("profile_")


_ANY_PARALLEL = frozenset(k for groups in PARALLEL_ARGS.values() for group in groups for k in group)
MAX_REPLICA_GPUS = 64  # Resources.gpu_count's bound

# `-e` keys a launcher sets itself, so a deployment may not: where the server listens, the
# model it loads, the name clients ask for, its LoRA slots. A foreign engine's launcher also
# sets its key, TLS files, KV-event publisher and aliases of those flags (`launch_command`): a
# user's `-e api_key=` would otherwise win, being the last flag. The control plane refuses them
# at deploy (`deployment_problems`); agent/runtime/command.py's argv builder refuses them again.
RESERVED_ARGS = frozenset(
    {"model", "served_model_name", "host", "port", "enable_lora", "max_loras", "lora_modules"}
)
FOREIGN_RESERVED_ARGS = RESERVED_ARGS | frozenset(
    {
        "model_path",
        "m",
        "alias",
        "api_key",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_ca_certs",
        "ssl_cert_file",
        "ssl_key_file",
        "kv_events_config",
        "max_loras_per_batch",
    }
)
# An `-e` key as argv builders take it: the flag's long name, lower case, '_' for '-'.
ENGINE_ARG_KEY = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def is_gguf(model: str) -> bool:
    """A GGUF file: a local path or model URI whose file name ends `.gguf` (an https://
    URI's `#sha256=` fragment and any query left aside). An alias or a directory is not."""
    path = model.strip().split("#", 1)[0].split("?", 1)[0]
    return path.lower().endswith(".gguf")


# What SGLang needs at launch to load adapters later (--lora-paths would tell it otherwise).
SGLANG_LORA_ARGS = ("max_lora_rank", "lora_target_modules")


class EngineProblem(NamedTuple):
    """One reason a deployment cannot run on its engine, and the field to change."""

    field: str
    reason: str


def deployment_problems(
    kind: EngineKind, model: str, engine_args: Mapping[str, object], *, adapters: int = 0
) -> list[EngineProblem]:
    """Why a deployment version cannot run on `kind`, from its capabilities: each reason a
    sentence naming the fix; [] when it can. The one place deploy-time engine rules live
    (the control plane answers them as a 422). LoRA on an engine without hot load is refused
    outright rather than served as launch-time adapters: Fleet's adapter routing loads and
    evicts adapters per replica, which such an engine cannot follow."""
    caps = CAPABILITIES[kind]
    problems: list[EngineProblem] = []
    reserved = RESERVED_ARGS if kind == "fleet" else FOREIGN_RESERVED_ARGS
    for key in engine_args:
        if not ENGINE_ARG_KEY.match(key):
            problems.append(
                EngineProblem(
                    "engine_args",
                    f"{key!r}: {kind}'s flags are given in lower case with '_' "
                    "(e.g. tensor_parallel_size for --tensor-parallel-size)",
                )
            )
        elif key in reserved:
            problems.append(EngineProblem("engine_args", f"{key!r} is set by Fleet's launcher; leave it out"))
    try:
        gpus = parallel_gpus(kind, engine_args)
    except ValueError as err:
        problems.append(EngineProblem("engine_args", str(err)))
        gpus = 1
    if gpus > MAX_REPLICA_GPUS:
        problems.append(
            EngineProblem(
                "engine_args", f"{gpus} GPUs per replica exceeds the {MAX_REPLICA_GPUS} one replica may hold"
            )
        )
    if not caps.tensor_parallel:
        split = sorted(
            k
            for k in _ANY_PARALLEL & set(engine_args)
            if not isinstance(engine_args[k], bool) and str(engine_args[k]).strip() not in ("1", "")
        )
        if split:
            problems.append(
                EngineProblem(
                    "engine",
                    f"{kind} has no tensor or pipeline parallelism ({', '.join(split)}): "
                    "deploy with vllm or sglang to split a model over GPUs",
                )
            )
    if adapters and not caps.lora_load:
        problems.append(
            EngineProblem(
                "adapters",
                f"{kind} cannot load LoRA adapters while it runs, which Fleet's adapter routing needs: "
                "remove the deployment's adapters, or deploy with fleet, vllm or sglang",
            )
        )
    if adapters and kind == "sglang":
        missing = [k for k in SGLANG_LORA_ARGS if engine_args.get(k) in (None, False, "")]
        if missing:
            problems.append(
                EngineProblem(
                    "engine_args",
                    "sglang sizes its LoRA buffers at launch from the adapters it starts with, and "
                    f"Fleet starts it with none: give {' and '.join(f'-e {k}=...' for k in missing)} "
                    "(the largest rank of the adapters; the modules they target, or all)",
                )
            )
    if kind == "llama.cpp" and not is_gguf(model):
        problems.append(
            EngineProblem(
                "model",
                f"llama.cpp serves GGUF files: {model!r} is not one (give a local path or model URI "
                "ending .gguf, e.g. hf://org/repo/model-Q4_K_M.gguf)",
            )
        )
    return problems
