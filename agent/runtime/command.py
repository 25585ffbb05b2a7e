"""The command line of one replica, the one home for every runtime (local process,
simulated replica, Kubernetes container): argv as a list (never a shell), the spec's
`engine_args` as flags after checking keys and values against safe patterns, then
`config.replica.extra_args` (the host's own flags win over the spec's, argparse taking
the last), then the drain timeout unless the host set one."""

from __future__ import annotations

import math
import re
import sys
from typing import Any

from agent.runtime.base import InvalidSpec
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import (
    ENGINE_ARG_KEY,
    FOREIGN_RESERVED_ARGS,
    RESERVED_ARGS,
    TlsFiles,
    is_planning_arg,
    launch_command,
    lora_launch,
)
from fleet_base.protocol import ReplicaSpec

ENGINE_MODULE = "engine.server"

_NUMBER = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?$")
# The keys and the flags the runtime sets itself (a spec may not override them): one table,
# fleet_base.engines', which the control plane also refuses at deploy.
_KEY = ENGINE_ARG_KEY
RESERVED_KEYS = RESERVED_ARGS
FOREIGN_RESERVED_KEYS = FOREIGN_RESERVED_ARGS


def check_text(what: str, value: str) -> str:
    """`value` as one argv item: bounded, no control characters, never read as a flag."""
    if not value or len(value) > 4096:
        raise InvalidSpec(f"{what}: must be 1..4096 characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidSpec(f"{what}: control characters are not allowed")
    if value.startswith("-") and not _NUMBER.match(value):
        raise InvalidSpec(f"{what}: {value!r} would read as a flag")
    return value


def engine_flags(
    engine_args: dict[str, Any], reserved: frozenset[str] = RESERVED_KEYS, *, planning: bool = False
) -> list[str]:
    """{"max_num_seqs": 8, "enforce_x": True, "seed": None} -> ["--max-num-seqs", "8", "--enforce-x"].

    True gives the flag alone; False and None omit it; numbers and strings follow the
    flag; anything else (lists, dicts) is refused with InvalidSpec. The planner's keys
    (`fleet_base.engines.is_planning_arg`) become flags only with `planning` (the simulated
    replica reads them; a real engine would refuse them as unknown)."""
    argv: list[str] = []
    for key, value in engine_args.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise InvalidSpec(f"engine_args: key {key!r} must match {_KEY.pattern}")
        if key in reserved:
            raise InvalidSpec(f"engine_args: {key!r} is set by the agent")
        if is_planning_arg(key) and not planning:
            continue
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, int | float):
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidSpec(f"engine_args: {key} must be finite")
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
        elif isinstance(value, str):
            argv += [flag, check_text(f"engine_args.{key}", value)]
        else:
            raise InvalidSpec(
                f"engine_args: {key} must be a string, number or boolean, not {type(value).__name__}"
            )
    return argv


def lora_flags(spec: ReplicaSpec) -> list[str]:
    """LoRA slots for the adapters the agent and gateway load (none when LoRA is off)."""
    return ["--enable-lora", "--max-loras", str(spec.max_adapters)] if spec.max_adapters > 0 else []


def replica_argv(
    spec: ReplicaSpec,
    config: ClusterConfig,
    *,
    port: int,
    host: str | None = None,
    python: str = sys.executable,
    module: str = ENGINE_MODULE,
    lora: bool = True,
) -> list[str]:
    """The full command line of one replica, listening on `host` (default
    `config.replica.host`) and `port`; `lora`: with its LoRA slots."""
    argv = [
        python,
        "-m",
        module,
        "--model",
        check_text("model", spec.model),
        "--served-model-name",
        check_text("deployment", spec.deployment),
        "--host",
        host if host is not None else config.replica.host,
        "--port",
        str(port),
    ]
    argv += engine_flags(spec.engine_args, planning=module != ENGINE_MODULE)
    argv += lora_flags(spec) if lora else []
    argv += list(config.replica.extra_args)
    if "--drain-timeout" not in argv:
        argv += ["--drain-timeout", repr(float(config.replica.drain_timeout_s))]
    return argv


def foreign_argv(
    spec: ReplicaSpec,
    *,
    model_path: str,
    port: int,
    host: str,
    api_key: str | None = None,
    tls: TlsFiles | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    python: str = "python",
) -> list[str]:
    """The command line of a replica whose `spec.engine` is vLLM, SGLang or llama.cpp: the
    engine's own server (`fleet_base.engines.launch_command`) serving `model_path` (a local
    path: the verified cache entry, not the URI) under the deployment's name, its LoRA
    slots, then the spec's `engine_args`. The API key never goes in argv: the launcher puts
    it in the environment (`launch_env`; SGLang reads it through `SGLANG_SHIM`), so `api_key`
    is only ever a placeholder; `config.replica.extra_args` are flags of Fleet's engine and
    are not given."""
    extra = lora_launch(spec.engine, spec.max_adapters)[0]
    extra += engine_flags(spec.engine_args, FOREIGN_RESERVED_KEYS)
    try:
        return launch_command(
            spec.engine,
            check_text("model", model_path),
            port,
            api_key,
            check_text("deployment", spec.deployment),
            extra,
            host=host,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_replay_endpoint=kv_events_replay_endpoint,
            tls=tls,
            python=python,
            api_key_in_env=True,
        )
    except ValueError as err:
        raise InvalidSpec(f"engine {spec.engine}: {err}") from err
