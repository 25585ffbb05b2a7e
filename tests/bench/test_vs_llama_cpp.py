"""The llama.cpp comparison's pure parts: build flags from the CPU, the cache key, the
commands, unpacking, the cache hit, and the per-level accounting. Nothing is built here."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from bench import llama_cpp_build as lb
from bench import llama_server as ls
from bench import vs_llama_cpp as vs
from bench.engine_throughput import Workload

ZEN2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx f16c fma bmi2 avx2 sha_ni\n\nprocessor\t: 1\nflags\t\t: fpu\n"
SPR = "flags\t: avx avx2 fma f16c bmi2 avx512f avx512_vnni avx512_bf16 avx512vbmi avx_vnni amx_tile\n"


def test_isa_options_follow_the_cpu() -> None:
    zen2 = lb.isa_options(lb.cpu_flags(ZEN2))
    assert zen2["GGML_AVX2"] == zen2["GGML_FMA"] == zen2["GGML_F16C"] == "ON"
    # A CPU without AVX-512 must not get a binary that dies on its first AVX-512 instruction.
    assert zen2["GGML_AVX512"] == zen2["GGML_AVX512_BF16"] == zen2["GGML_AVX512_VNNI"] == "OFF"
    spr = lb.isa_options(lb.cpu_flags(SPR))
    assert spr["GGML_AVX512"] == spr["GGML_AVX512_BF16"] == spr["GGML_AVX512_VNNI"] == "ON"
    assert spr["GGML_AMX_TILE"] == "ON" and spr["GGML_AMX_INT8"] == "OFF"
    assert lb.cpu_flags("no flags here") == set()


def test_requested_options_are_portable_release_without_curl() -> None:
    opts = lb.requested_options(lb.cpu_flags(ZEN2), {"GGML_AVX2": "OFF", "LLAMA_FOO": "1"})
    assert opts["GGML_NATIVE"] == "OFF" and opts["CMAKE_BUILD_TYPE"] == "Release"
    assert opts["LLAMA_CURL"] == "OFF" and opts["BUILD_SHARED_LIBS"] == "OFF"
    assert opts["GGML_AVX2"] == "OFF" and opts["LLAMA_FOO"] == "1"  # overrides win


def test_cache_key_is_stable_and_sensitive() -> None:
    a = lb.requested_options(lb.cpu_flags(ZEN2))
    key = lb.cache_key("0.3.36", a)
    assert key == lb.cache_key("0.3.36", dict(reversed(list(a.items()))))
    assert key.startswith("0.3.36-")
    assert key != lb.cache_key("0.3.35", a)
    assert key != lb.cache_key("0.3.36", lb.requested_options(lb.cpu_flags(SPR)))
    assert key != lb.cache_key("0.3.36", {**a, "GGML_AVX2": "OFF"})


def test_options_this_llama_cpp_does_not_declare_are_dropped() -> None:
    cmake = (
        'option(GGML_AVX2 "avx2" ON)\n  option( GGML_NATIVE "native" ON)\nset(LLAMA_CURL OFF CACHE BOOL "")\n'
    )
    declared = lb.declared_options([cmake])
    assert {"GGML_AVX2", "GGML_NATIVE", "LLAMA_CURL"} <= declared
    kept = lb.supported_options(
        {"GGML_AVX2": "ON", "GGML_AVX512_BF16": "ON", "CMAKE_BUILD_TYPE": "Release"}, declared
    )
    assert kept == {"GGML_AVX2": "ON", "CMAKE_BUILD_TYPE": "Release"}


def test_commands() -> None:
    cfg = lb.cmake_configure_command(Path("/s"), Path("/b"), {"GGML_NATIVE": "OFF", "A": "1"}, ninja=True)
    assert cfg[:7] == ["cmake", "-S", "/s", "-B", "/b", "-G", "Ninja"] and cfg[7:] == [
        "-DA=1",
        "-DGGML_NATIVE=OFF",
    ]
    assert lb.build_command(Path("/b"), 2, ninja=True) == ["ninja", "-C", "/b", "-j", "2", "llama-server"]
    assert lb.build_command(Path("/b"), 2, ninja=False) == [
        "cmake",
        "--build",
        "/b",
        "--target",
        "llama-server",
        "-j",
        "2",
    ]
    pip = lb.pip_download_command("0.3.36", Path("/d"))
    assert pip[1:] == [
        "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", "llama-cpp-python==0.3.36", "-d", "/d",
    ]  # fmt: skip
    assert lb.build_fraction("[3/12] Building CXX object x.o") == 0.25
    assert lb.build_fraction("[ 40%] Built target ggml") == 0.4
    assert lb.build_fraction("-- Configuring done") is None


def _sdist(path: Path, version: str) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {
            f"llama_cpp_python-{version}/vendor/llama.cpp/CMakeLists.txt": b'option(LLAMA_CURL "" ON)\n',
            f"llama_cpp_python-{version}/vendor/llama.cpp/ggml/CMakeLists.txt": b'option(GGML_AVX2 "" ON)\n',
            f"llama_cpp_python-{version}/llama_cpp/llama.py": b"# not vendored\n",
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_unpack_takes_only_the_vendored_tree(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    _sdist(sdist, "9.9.9")
    src = lb.unpack_vendored(sdist, "9.9.9", tmp_path)
    assert (src / "ggml" / "CMakeLists.txt").is_file()
    assert not list(tmp_path.rglob("llama.py"))
    assert lb.read_declared_options(src) >= {"LLAMA_CURL", "GGML_AVX2"}
    assert lb.unpack_vendored(sdist, "9.9.9", tmp_path) == src  # second call: already there


def test_a_cached_binary_needs_no_download_or_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = lb.cache_key("9.9.9", lb.requested_options(lb.cpu_flags()))
    bin_dir = tmp_path / "bin" / key
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").write_text("#!/bin/sh\n")
    os.chmod(bin_dir / "llama-server", 0o755)
    (bin_dir / "build.json").write_text(json.dumps({"options": {"GGML_AVX2": "ON"}}))

    def no_download(*a: object) -> Path:
        raise AssertionError("a cache hit must not download")

    monkeypatch.setattr(lb, "download_sdist", no_download)
    got = lb.ensure_llama_server("9.9.9", root=tmp_path)
    assert got.cached and got.binary == bin_dir / "llama-server" and got.key == key


def test_llama_server_command_and_slot_context() -> None:
    wl = Workload(prompts=[[1] * 300, [2] * 40], output_lens=[16, 200])
    assert ls.slot_context(wl) == 512  # 300 + 200, rounded up to 256
    cmd = ls.llama_server_command(Path("/bin/ls"), Path("/m.gguf"), 5555, 2, 64, 512)
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "5555"
    assert flags["--threads"] == "2" and flags["--parallel"] == "64" and flags["--ctx-size"] == str(64 * 512)
    assert "--cont-batching" in cmd and flags["--cache-ram"] == "0"


def test_level_accounting_counts_useful_and_short() -> None:
    res = [
        vs.RequestResult(requested=10, prompt_tokens=5, completion_tokens=10, seconds=1.0),
        vs.RequestResult(requested=10, prompt_tokens=5, completion_tokens=7, seconds=1.0),
        vs.RequestResult(requested=4, prompt_tokens=5, completion_tokens=9, seconds=1.0),
        None,
    ]
    lv = vs.level_result("ours", "batched", 64, res, 2.0, 0.5)
    assert (lv.useful_tokens, lv.short_requests, lv.errors, lv.num_requests) == (21, 1, 1, 4)
    assert lv.tokens_per_s == 10.5
    theirs = lv.model_copy(update={"server": "llama-server", "useful_tokens": 7})
    assert vs.ratios([lv, theirs]) == {"batched": 3.0}


def test_args() -> None:
    a = vs.parse_args([])
    assert (a.num_prompts, a.single_requests, a.concurrency, a.max_tokens_cap) == (64, 8, 64, None)
    b = vs.parse_args(["--cmake-option", "GGML_AVX512=ON", "--max-tokens-cap", "16"])
    assert b.cmake_option == [("GGML_AVX512", "ON")] and b.max_tokens_cap == 16
    with pytest.raises(SystemExit):
        vs.parse_args(["--cmake-option", "nope"])
