"""llama.cpp's `llama-server`, built from the vendored sources of the `llama-cpp-python` sdist
and cached, so `bench/vs_llama_cpp.py` can measure our server against it on the same GGUF.

Portable flags (GGML_NATIVE=OFF) with every x86 extension this CPU reports switched on
explicitly (AVX2, FMA, F16C, AVX-512 and its BF16/VNNI/VBMI parts, AMX): the binary is as fast
as a native build here, the flags are written down, and a CPU lacking one of them gets its own
build (the flags are part of the cache key) rather than a binary that dies on SIGILL.

Layout under the cache root (`FLEET_LLAMA_CPP_CACHE`, default `~/.cache/fleet/llama.cpp`):
`sdist/` the downloaded sdist, `src/<version>/` its unpacked `vendor/llama.cpp`,
`build/<key>/` the CMake tree and its log, `bin/<key>/llama-server` + `build.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel

from bench.common import console
from fleet_base.engine_binaries import LLAMA_CPP_CACHE_ENV, LLAMA_SERVER, llama_cpp_cache_root

DEFAULT_VERSION = "0.3.36"
CACHE_ENV = LLAMA_CPP_CACHE_ENV
TARGET = LLAMA_SERVER
VENDORED = "vendor/llama.cpp"

# /proc/cpuinfo flag -> the ggml CMake option that compiles it in.
ISA_OPTIONS: dict[str, str] = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "amx_tile": "GGML_AMX_TILE",
    "amx_int8": "GGML_AMX_INT8",
    "amx_bf16": "GGML_AMX_BF16",
}

# Everything but the server off: no curl, no web UI (it would be fetched from a model hub at
# build time), no tests or examples; one binary that can be copied into the cache alone. OpenSSL
# (for the server's HTTPS, which Fleet's replicas serve) where its headers are installed.
BASE_OPTIONS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "OFF",
    "GGML_CPU_ALL_VARIANTS": "OFF",
    "GGML_BACKEND_DL": "OFF",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "ON" if Path("/usr/include/openssl/ssl.h").is_file() else "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
}


class BuildError(RuntimeError):
    """The download, configure or build failed; the message ends with the log's tail."""


class BuiltServer(BaseModel):
    binary: Path
    version: str
    key: str
    options: dict[str, str]
    cached: bool  # found in the cache: nothing was downloaded or compiled


def cache_root() -> Path:
    return llama_cpp_cache_root()


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def isa_options(flags: Iterable[str]) -> dict[str, str]:
    """Each ggml ISA option ON where the CPU has the extension, OFF where it does not."""
    have = set(flags)
    return {opt: "ON" if flag in have else "OFF" for flag, opt in ISA_OPTIONS.items()}


def requested_options(flags: Iterable[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The CMake cache variables asked for: base, then ISA, then the caller's overrides."""
    return {**BASE_OPTIONS, **isa_options(flags), **(extra or {})}


def cache_key(version: str, options: Mapping[str, str]) -> str:
    """Stable across runs and option order; changes with the version or any option."""
    blob = json.dumps({"version": version, "options": dict(sorted(options.items()))}, sort_keys=True)
    return f"{version}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


_OPTION_RE = re.compile(r"^\s*(?:option|set)\s*\(\s*([A-Z][A-Z0-9_]*)\b", re.MULTILINE)


def declared_options(cmake_texts: Iterable[str]) -> set[str]:
    """Names the CMake files declare with option() or set(... CACHE ...)."""
    return {m.group(1) for text in cmake_texts for m in _OPTION_RE.finditer(text)}


def supported_options(options: Mapping[str, str], declared: set[str]) -> dict[str, str]:
    """Drops project options this llama.cpp version does not declare (CMake's own CMAKE_* and
    BUILD_SHARED_LIBS always pass), so an older or newer vendored tree configures cleanly."""
    keep = {"CMAKE_BUILD_TYPE", "BUILD_SHARED_LIBS"}
    return {k: v for k, v in options.items() if k in keep or k in declared}


def cmake_configure_command(src: Path, build: Path, options: Mapping[str, str], ninja: bool) -> list[str]:
    cmd = ["cmake", "-S", str(src), "-B", str(build)]
    if ninja:
        cmd += ["-G", "Ninja"]
    return cmd + [f"-D{k}={v}" for k, v in sorted(options.items())]


def build_command(build: Path, jobs: int, ninja: bool) -> list[str]:
    """Ninja directly where it is the generator: `cmake --build` holds back its progress lines
    when its output is a pipe, and the bar follows them."""
    if ninja:
        return ["ninja", "-C", str(build), "-j", str(jobs), TARGET]
    return ["cmake", "--build", str(build), "--target", TARGET, "-j", str(jobs)]


def pip_download_command(version: str, dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
        f"llama-cpp-python=={version}", "-d", str(dest),
    ]  # fmt: skip


_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PCT = re.compile(r"^\[\s*(\d+)%\]")


def build_fraction(line: str) -> float | None:
    """Progress a build output line reports: ninja's [done/total] or make's [ pct%]."""
    if m := _NINJA_STEP.match(line):
        total = int(m.group(2))
        return int(m.group(1)) / total if total else None
    if m := _MAKE_PCT.match(line):
        return int(m.group(1)) / 100
    return None


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------- steps


def _run_logged(cmd: list[str], log_path: Path, what: str, show_progress: bool = False) -> None:
    """Runs `cmd`, appending its output to `log_path`; a rich bar follows build progress lines."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    tail: deque[str] = deque(maxlen=40)
    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [TextColumn("{task.percentage:>3.0f}%")] if show_progress else [SpinnerColumn()]
    with (
        log_path.open("a", encoding="utf-8") as log,
        Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as bar,
    ):
        task = bar.add_task(what, total=1.0 if show_progress else None)
        log.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip())
            frac = build_fraction(line) if show_progress else None
            if frac is not None:
                bar.update(task, completed=frac)
        code = proc.wait()
        if code == 0 and show_progress:
            bar.update(task, completed=1.0)
    if code != 0:
        raise BuildError(f"{what} failed (exit {code}); log {log_path}; tail:\n" + "\n".join(tail))


def download_sdist(version: str, root: Path) -> Path:
    dest = root / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    console.print(f"downloading the llama-cpp-python {version} sdist into {dest} ...")
    # pip prints its own (rich) download bar; it goes straight to the terminal.
    code = subprocess.call(pip_download_command(version, dest))
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if code != 0 or not found:
        raise BuildError(f"pip download of llama-cpp-python=={version} failed (exit {code})")
    return next((p for p in found if version in p.name), found[0])


def unpack_vendored(sdist: Path, version: str, root: Path) -> Path:
    """Extracts only the sdist's vendor/llama.cpp (data filter: no links out, no odd modes)."""
    src = root / "src" / version
    marker = src / ".complete"
    top = src / "llama.cpp"
    if marker.exists():
        return top
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    with console.status(f"unpacking {sdist.name} ({VENDORED}) ..."), tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if len(parts) == 2 and parts[1].startswith(VENDORED + "/"):
                m.name = "llama.cpp/" + parts[1][len(VENDORED) + 1 :]
                members.append(m)
        if not members:
            raise BuildError(f"{sdist} has no {VENDORED}/")
        tar.extractall(src, members=members, filter="data")
    marker.touch()
    return top


def read_declared_options(src: Path) -> set[str]:
    files = [src / "CMakeLists.txt", src / "ggml" / "CMakeLists.txt"]
    files += list((src / "tools" / "server").glob("CMakeLists.txt"))
    return declared_options(p.read_text(encoding="utf-8", errors="replace") for p in files if p.is_file())


def ensure_llama_server(
    version: str = DEFAULT_VERSION,
    extra_options: Mapping[str, str] | None = None,
    jobs: int | None = None,
    root: Path | None = None,
) -> BuiltServer:
    """The cached binary for (version, options), building it first when absent."""
    root = root or cache_root()
    options = requested_options(cpu_flags(), extra_options)
    key = cache_key(version, options)
    bin_dir = root / "bin" / key
    binary = bin_dir / TARGET
    if binary.is_file() and os.access(binary, os.X_OK):
        meta = json.loads((bin_dir / "build.json").read_text(encoding="utf-8"))
        return BuiltServer(binary=binary, version=version, key=key, options=meta["options"], cached=True)

    src = unpack_vendored(download_sdist(version, root), version, root)
    used = supported_options(options, read_declared_options(src))
    dropped = sorted(set(options) - set(used))
    build = root / "build" / key
    build.mkdir(parents=True, exist_ok=True)
    log = build / "build.log"
    on = [k for k, v in used.items() if k in ISA_OPTIONS.values() and v == "ON"]
    console.print(f"building {TARGET} (llama-cpp-python {version}) with {', '.join(on) or 'no ISA extras'}")
    if dropped:
        console.print(f"[dim]not declared by this llama.cpp, left out: {', '.join(dropped)}[/dim]")
    ninja = shutil.which("ninja") is not None
    if not (build / "CMakeCache.txt").exists():
        _run_logged(cmake_configure_command(src, build, used, ninja), log, "cmake configure")
    _run_logged(build_command(build, jobs or available_cores(), ninja), log, f"build {TARGET}", True)
    produced = next((p for p in (build / "bin" / TARGET, build / TARGET) if p.is_file()), None)
    if produced is None:
        raise BuildError(f"the build finished but no {TARGET} binary is in {build}; log {log}")
    bin_dir.mkdir(parents=True, exist_ok=True)
    tmp = bin_dir / f".{TARGET}.tmp"
    shutil.copy2(produced, tmp)
    (bin_dir / "build.json").write_text(
        json.dumps({"version": version, "options": used, "dropped": dropped}, indent=2), encoding="utf-8"
    )
    tmp.replace(binary)  # last: a binary present means a complete build
    return BuiltServer(binary=binary, version=version, key=key, options=used, cached=False)


def main() -> int:
    """`python -m bench.llama_cpp_build`: build (or find) the cached llama-server and print its
    path, which the process runtime then finds (fleet_base.engine_binaries)."""
    try:
        built = ensure_llama_server()
    except BuildError as err:
        console.print(f"[red]{err}[/red]")
        return 1
    console.print(f"{'cached' if built.cached else 'built'}: {built.binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
