"""Launch commands against each engine's documented CLI (vLLM `vllm serve`, SGLang
`python -m sglang.launch_server`, llama.cpp `llama-server`); only the SGLang key shim is run
(against a stand-in `sglang.launch_server`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleet_base import engines
from fleet_base.engines import (
    CAPABILITIES,
    ENGINE_KINDS,
    TlsFiles,
    launch_command,
    launch_env,
    redact_argv,
    redact_text,
)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("kind", "head", "model_flag", "name_flag", "metrics_flag"),
    [
        ("vllm", ["vllm", "serve", "/m/llama"], None, "--served-model-name", None),
        (
            "sglang",
            ["python", "-m", "sglang.launch_server"],
            "--model-path",
            "--served-model-name",
            "--enable-metrics",
        ),
        ("llama.cpp", ["llama-server"], "-m", "--alias", "--metrics"),
    ],
)
def test_launch_command_carries_the_flags_fleet_needs(kind, head, model_flag, name_flag, metrics_flag):
    argv = launch_command(kind, "/m/llama", 8123, "sk-replica", "llama-70b", ["--max-model-len", "4096"])
    assert argv[: len(head)] == head
    if model_flag:
        assert flag(argv, model_flag) == "/m/llama"
    assert flag(argv, "--port") == "8123"
    assert flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--api-key") == "sk-replica"
    assert flag(argv, name_flag) == "llama-70b"
    if metrics_flag:
        assert metrics_flag in argv
    assert argv[-2:] == ["--max-model-len", "4096"]  # pass-through last: the user's flag wins


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llama.cpp"])
def test_no_api_key_means_no_flag(kind):
    assert "--api-key" not in launch_command(kind, "/m", 1, None, "x")


def test_vllm_kv_events_tp_and_tls():
    tls = TlsFiles(certfile="/t/c.pem", keyfile="/t/k.pem", ca_certs="/t/ca.pem")
    argv = launch_command(
        "vllm", "/m", 9000, "k", "m", tensor_parallel=8, kv_events_endpoint="tcp://*:5557", tls=tls
    )
    assert flag(argv, "--tensor-parallel-size") == "8"
    assert json.loads(flag(argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "kv-events",
    }
    assert (flag(argv, "--ssl-certfile"), flag(argv, "--ssl-keyfile"), flag(argv, "--ssl-ca-certs")) == (
        "/t/c.pem",
        "/t/k.pem",
        "/t/ca.pem",
    )


def test_sglang_kv_events_and_tp():
    argv = launch_command(
        "sglang", "/m", 30000, "k", "m", tensor_parallel=4, kv_events_endpoint="tcp://*:5558"
    )
    assert flag(argv, "--tp-size") == "4"
    config = json.loads(flag(argv, "--kv-events-config"))
    assert config["publisher"] == "zmq" and config["endpoint"] == "tcp://*:5558"
    assert "enable_kv_cache_events" not in config  # not a field of SGLang's config


def test_llama_cpp_tls_flags_are_its_own():
    argv = launch_command("llama.cpp", "/m.gguf", 8080, "k", "m", tls=TlsFiles(certfile="c", keyfile="k"))
    assert (flag(argv, "--ssl-cert-file"), flag(argv, "--ssl-key-file")) == ("c", "k")


@pytest.mark.parametrize(
    ("kind", "kwargs", "why"),
    [
        ("llama.cpp", {"kv_events_endpoint": "tcp://*:1"}, "KV events"),
        ("llama.cpp", {"tensor_parallel": 2}, "tensor parallelism"),
        ("vllm", {"tensor_parallel": 0}, "at least 1"),
        ("fleet", {}, "no foreign launch"),
    ],
)
def test_what_an_engine_cannot_do_is_refused(kind, kwargs, why):
    with pytest.raises(ValueError, match=why):
        launch_command(kind, "/m", 1, None, "m", **kwargs)


def test_capability_table_covers_every_engine():
    assert set(CAPABILITIES) == set(ENGINE_KINDS) == {"fleet", "vllm", "sglang", "llama.cpp"}
    assert CAPABILITIES["vllm"].kv_events == CAPABILITIES["sglang"].kv_events == "zmq"
    assert CAPABILITIES["llama.cpp"].kv_events is None and not CAPABILITIES["llama.cpp"].lora_load
    assert {c.metrics_prefix for c in CAPABILITIES.values()} == {
        "fleet_engine_",
        "vllm:",
        "sglang:",
        "llamacpp:",
    }


@pytest.mark.parametrize(
    ("kind", "var"),
    [("vllm", "VLLM_API_KEY"), ("llama.cpp", "LLAMA_API_KEY"), ("sglang", "FLEET_SGLANG_API_KEY")],
)
def test_api_key_can_stay_out_of_argv(kind, var):
    argv = launch_command(kind, "/m", 1, "sk-secret", "m", api_key_in_env=True)
    assert not any("sk-secret" in a for a in argv) and "--api-key" not in argv
    assert launch_env(kind, "sk-secret") == {var: "sk-secret"}


FAKE_SGLANG = """
import json, os, sys
if __name__ == "__main__":
    with open(os.environ["FAKE_SGLANG_OUT"], "w") as f:
        json.dump({"argv": sys.argv, "key_env": "FLEET_SGLANG_API_KEY" in os.environ,
                   "cmdline": open("/proc/self/cmdline").read()}, f)
"""


def test_sglang_gets_its_key_in_process_through_the_shim(tmp_path):
    """SGLang reads no key variable: the shim hands it to sglang.launch_server's parser as
    `-m` would run it, while the process's visible command line holds no key."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    out = tmp_path / "out.json"
    argv = launch_command("sglang", "/m", 8123, "sk-secret", "m", python=sys.executable, api_key_in_env=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FAKE_SGLANG_OUT": str(out)}
    subprocess.run(argv, env={**env, **launch_env("sglang", "sk-secret")}, check=True, timeout=30)
    seen = json.loads(out.read_text())
    assert seen["argv"][0] == str(pkg / "launch_server.py")  # run as `python -m` runs it
    assert seen["argv"][1:] == [*argv[3:], "--api-key", "sk-secret"]
    assert "sk-secret" not in seen["cmdline"] and not seen["key_env"]  # not passed on to workers
    subprocess.run(argv, env=env, check=True, timeout=30)  # security off: no key, no flag
    assert "--api-key" not in json.loads(out.read_text())["argv"]


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["x", "--api-key", "sk", "--port", "1"], ["x", "--api-key", "***", "--port", "1"]),
        (["x", "--api-key=sk", "--api-keyx", "v"], ["x", "--api-key=***", "--api-keyx", "v"]),
        (["x", "--ssl-keyfile", "/k.pem", "--api-key"], ["x", "--ssl-keyfile", "/k.pem", "--api-key"]),
        (["x", "--kv-events-config", '{"endpoint":"tcp://127.0.0.1:5"}'], None),
    ],
)
def test_secret_flag_values_are_masked_in_a_shown_command_line(argv, shown):
    assert redact_argv(argv) == (argv if shown is None else shown)


def test_secret_values_are_masked_in_engine_output():
    text = "server_args=ServerArgs(api_key='sk-1', port=1)"
    assert redact_text(text, ["sk-1", None, ""]) == "server_args=ServerArgs(api_key='***', port=1)"


@pytest.mark.parametrize(
    ("kind", "args", "gpus"),
    [
        ("vllm", {}, 1),
        ("vllm", {"tensor_parallel_size": 4}, 4),
        ("vllm", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, 8),
        ("vllm", {"tensor_parallel_size": "2", "max_num_seqs": 64}, 2),
        ("sglang", {"tp_size": 8}, 8),
        ("sglang", {"tensor_parallel_size": 2, "pp_size": 2}, 4),
        ("llama.cpp", {"tensor_parallel_size": 4}, 1),  # no tensor parallelism: the flag is its own
        ("fleet", {"tensor_parallel_size": 4}, 1),
    ],
)  # fmt: skip
def test_parallel_gpus_is_the_product_of_the_parallel_sizes(kind, args, gpus):
    assert engines.parallel_gpus(kind, args) == gpus


@pytest.mark.parametrize("bad", [0, -1, "two", True, 1.5])
def test_parallel_gpus_refuses_a_size_that_is_no_count(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engines.parallel_gpus("vllm", {"tensor_parallel_size": bad})


# ------------------------------------------------------------------ what a deployment serves


@pytest.mark.parametrize(
    "kind, args, serves",
    [
        ("fleet", {}, True),
        ("vllm", {}, False),  # a generative model serves no embeddings
        ("vllm", {"runner": "pooling"}, True),
        ("vllm", {"runner": "generate"}, False),
        ("vllm", {"convert": "embed"}, True),
        ("vllm", {"task": "embed"}, True),
        ("sglang", {}, False),
        ("sglang", {"is_embedding": True}, True),
        ("llama.cpp", {}, False),  # the launcher passes no --embeddings
        ("llama.cpp", {"embeddings": True}, True),
        ("llama.cpp", {"embeddings": False}, False),
    ],
)
def test_serves_embeddings(kind, args, serves):
    assert engines.serves_embeddings(kind, args) is serves


def test_cache_salt_only_where_the_prefix_cache_takes_it():
    assert {k for k in ENGINE_KINDS if CAPABILITIES[k].cache_salt} == {"fleet", "vllm"}
    for kind in ENGINE_KINDS:
        notes = engines.tenant_notes(kind)
        assert bool(notes) is not CAPABILITIES[kind].cache_salt
        assert all(kind in n for n in notes)


def test_llama_cpp_starts_without_its_shared_prompt_cache():
    argv = launch_command("llama.cpp", "/m.gguf", 1, None, "x")
    assert "--no-cache-prompt" in argv
    # a single-tenant deployment turns it back on: the user's flag comes later and wins
    argv = launch_command("llama.cpp", "/m.gguf", 1, None, "x", ["--cache-prompt"])
    assert argv.index("--cache-prompt") > argv.index("--no-cache-prompt")
    for kind in ("vllm", "sglang"):
        assert "--no-cache-prompt" not in launch_command(kind, "/m", 1, None, "x")


@pytest.mark.parametrize(
    "kind, load, unload, local",
    [
        ("fleet", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", False),
        ("vllm", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", True),
        ("sglang", "/load_lora_adapter", "/unload_lora_adapter", True),
    ],
)
def test_lora_api_per_engine(kind, load, unload, local):
    api = CAPABILITIES[kind].lora_api
    assert api is not None and (api.load_path, api.unload_path, api.local_path) == (load, unload, local)


def test_lora_api_exactly_where_adapters_load_at_run_time():
    for kind in ENGINE_KINDS:
        assert (CAPABILITIES[kind].lora_api is not None) is CAPABILITIES[kind].lora_load
