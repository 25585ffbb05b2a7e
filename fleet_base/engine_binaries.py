"""Where the executable of a foreign engine's server comes from on this host.

One lookup shared by the agent's process runtime and the benches: an explicit path in the
environment first (`FLEET_LLAMA_SERVER`, `FLEET_VLLM`, `FLEET_SGLANG_PYTHON`), then the
engine's own command on PATH, then (llama.cpp only) the newest `llama-server` that
bench/llama_cpp_build.py cached under `FLEET_LLAMA_CPP_CACHE` (default
~/.cache/fleet/llama.cpp) in `bin/<key>/llama-server`. Also whether a llama.cpp build serves
TLS at all (a build without OpenSSL refuses `--ssl-*-file` at start-up).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from fleet_base.engines import EngineKind

LLAMA_SERVER = "llama-server"
LLAMA_CPP_CACHE_ENV = "FLEET_LLAMA_CPP_CACHE"
# The variable naming an engine's executable (for sglang: the Python that has the package).
EXECUTABLE_ENV: dict[EngineKind, str] = {
    "llama.cpp": "FLEET_LLAMA_SERVER",
    "vllm": "FLEET_VLLM",
    "sglang": "FLEET_SGLANG_PYTHON",
}
_COMMAND: dict[EngineKind, str] = {"llama.cpp": LLAMA_SERVER, "vllm": "vllm"}
# Compiled into llama-server only with CPPHTTPLIB_OPENSSL_SUPPORT (tools/server/server-http.cpp).
_SSL_MARKER = b"running with SSL"


class EngineNotFound(LookupError):
    """No executable for the engine on this host; the message says where it was looked for."""


def llama_cpp_cache_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    value = env.get(LLAMA_CPP_CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "fleet" / "llama.cpp"


def cached_llama_server(root: Path | None = None) -> Path | None:
    """The most recently built `llama-server` in the build cache (None: none built)."""
    root = root if root is not None else llama_cpp_cache_root()
    found = [p for p in (root / "bin").glob(f"*/{LLAMA_SERVER}") if p.is_file() and os.access(p, os.X_OK)]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def find_executable(kind: EngineKind, env: Mapping[str, str] | None = None) -> str:
    """The executable that starts `kind`'s server here; raises EngineNotFound."""
    env = os.environ if env is None else env
    name = EXECUTABLE_ENV.get(kind)
    if name is None:
        raise EngineNotFound(f"{kind} has no foreign executable")
    explicit = env.get(name, "").strip()
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        raise EngineNotFound(f"{name}={explicit} is not an executable file")
    if kind == "sglang":
        if importlib.util.find_spec("sglang") is not None:
            return sys.executable
        raise EngineNotFound(f"sglang is not installed for {sys.executable}; set {name}")
    on_path = shutil.which(_COMMAND[kind], path=env.get("PATH"))
    if on_path:
        return on_path
    if kind == "llama.cpp":
        cached = cached_llama_server(llama_cpp_cache_root(env))
        if cached is not None:
            return str(cached)
        raise EngineNotFound(
            f"no {LLAMA_SERVER}: set {name}, put it on PATH, or build it "
            f"(python -m bench.llama_cpp_build builds it into {llama_cpp_cache_root(env)}/bin)"
        )
    raise EngineNotFound(f"no {_COMMAND[kind]} on PATH; set {name}")


@functools.lru_cache(maxsize=16)
def _binary_has(path: str, size: int, mtime: float, marker: bytes) -> bool:
    chunk, tail = 1 << 20, b""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if marker in tail + block:
                return True
            tail = block[-len(marker) :]
    return False


def serves_tls(kind: EngineKind, executable: str) -> bool:
    """Whether this build of the engine can serve HTTPS. vLLM and SGLang always can
    (uvicorn); llama-server only when it was built with OpenSSL."""
    if kind != "llama.cpp":
        return True
    try:
        st = os.stat(executable)
        return _binary_has(executable, st.st_size, st.st_mtime, _SSL_MARKER)
    except OSError:
        return False
