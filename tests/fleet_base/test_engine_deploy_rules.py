"""fleet_base.engines' deploy-time rules: the GPUs one replica's parallel sizes take, what
counts as a GGUF, and each capability a deployment may ask for and an engine may lack."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_base.engines import ENGINE_KINDS, deployment_problems, is_gguf, parallel_args, parallel_gpus

GGUF = "hf://bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf"


@pytest.mark.parametrize(
    "kind, args, gpus, named",
    [
        ("vllm", {"tensor_parallel_size": 4}, 4, True),
        ("vllm", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, 8, True),
        ("vllm", {"pipeline_parallel_size": 2}, 2, True),
        ("vllm", {"tensor_parallel_size": "2"}, 2, True),  # YAML may give a string
        ("vllm", {"tensor_parallel_size": 1}, 1, True),
        ("vllm", {"max_model_len": 4096}, 1, False),  # no parallel size: gpu_count stands
        ("vllm", {"tp_size": 4}, 1, False),  # sglang's name means nothing to vllm
        ("sglang", {"tp_size": 4}, 4, True),
        ("sglang", {"tp": 2}, 2, True),
        ("sglang", {"tensor_parallel_size": 8}, 8, True),
        ("sglang", {"tp_size": 2, "pp_size": 2}, 4, True),
        ("llama.cpp", {"n_gpu_layers": 99}, 1, False),
        ("llama.cpp", {"tensor_parallel_size": 4}, 1, False),  # refused by deployment_problems
        ("fleet", {"max_num_seqs": 8}, 1, False),
    ],
)
def test_parallel_gpus(kind, args, gpus, named):
    assert parallel_gpus(kind, args) == gpus
    assert bool(parallel_args(kind, args)) is named


@pytest.mark.parametrize(
    "kind, args",
    [
        ("vllm", {"tensor_parallel_size": 0}),
        ("vllm", {"tensor_parallel_size": 2.5}),
        ("vllm", {"tensor_parallel_size": True}),
        ("vllm", {"tensor_parallel_size": "four"}),
        ("sglang", {"tp_size": 2, "tp": 2}),  # one size under two names
    ],
)
def test_a_bad_parallel_size_is_a_value_error(kind, args):
    with pytest.raises(ValueError):
        parallel_gpus(kind, args)


@given(tp=st.integers(1, 16), pp=st.integers(1, 8))
def test_replica_gpus_are_tensor_times_pipeline(tp, pp):
    assert parallel_gpus("vllm", {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}) == tp * pp
    assert parallel_gpus("sglang", {"tp_size": tp, "pp_size": pp}) == tp * pp


@pytest.mark.parametrize(
    "model, gguf",
    [
        ("/models/SmolLM2-135M-Instruct-Q8_0.gguf", True),
        ("models/x.GGUF", True),
        (GGUF, True),
        ("hf://org/repo@0123456789abcdef0123456789abcdef01234567/m.gguf", True),
        ("https://example.com/m.gguf#sha256=" + "a" * 64, True),
        ("s3://bucket/m.gguf", True),
        ("smollm2-135m", False),  # an alias
        ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", False),  # safetensors repo
        ("/models/llama/", False),
        ("/models/m.gguf.part", False),
    ],
)
def test_is_gguf(model, gguf):
    assert is_gguf(model) is gguf


def fields(kind, model="m", args=None, adapters=0):
    return [p.field for p in deployment_problems(kind, model, args or {}, adapters=adapters)]


@pytest.mark.parametrize(
    "kind, model, args, adapters, expected",
    [
        ("fleet", "smollm2-135m", {"max_num_seqs": 8, "profile_a100": "x"}, 3, []),
        ("fleet", "m", {"profile_A100": "x"}, 0, ["engine_args"]),  # the API stores it lower case
        ("vllm", "hf://org/m", {"tensor_parallel_size": 4}, 2, []),
        ("sglang", "hf://org/m", {"tp_size": 8}, 0, []),
        ("llama.cpp", GGUF, {"n_gpu_layers": 99, "ctx_size": 4096}, 0, []),
        # capabilities
        ("llama.cpp", GGUF, {}, 1, ["adapters"]),
        ("llama.cpp", GGUF, {"tensor_parallel_size": 2}, 0, ["engine"]),
        ("fleet", "m", {"tensor_parallel_size": 2}, 0, ["engine"]),
        ("fleet", "m", {"tensor_parallel_size": 1}, 0, []),  # one GPU asks nothing
        ("llama.cpp", "smollm2-135m", {}, 0, ["model"]),
        ("llama.cpp", "hf://HuggingFaceTB/SmolLM2-135M-Instruct", {}, 0, ["model"]),
        # foreign flags: the engine's own names, never what the launcher sets
        ("vllm", "m", {"Tensor_Parallel_Size": 2}, 0, ["engine_args"]),
        ("vllm", "m", {"port": 9000}, 0, ["engine_args"]),
        ("llama.cpp", GGUF, {"alias": "other"}, 0, ["engine_args"]),
        ("sglang", "m", {"model_path": "/x"}, 0, ["engine_args"]),
        ("vllm", "m", {"ssl_keyfile": "/k"}, 0, ["engine_args"]),
        ("fleet", "m", {"port": 1}, 0, ["engine_args"]),
        ("vllm", "m", {"tensor_parallel_size": 0}, 0, ["engine_args"]),
        ("vllm", "m", {"tensor_parallel_size": 16, "pipeline_parallel_size": 8}, 0, ["engine_args"]),
        # SGLang loads adapters later only within the rank and modules reserved at launch
        ("sglang", "m", {}, 2, ["engine_args"]),
        ("sglang", "m", {"max_lora_rank": 64}, 2, ["engine_args"]),
        ("sglang", "m", {"max_lora_rank": 64, "lora_target_modules": "all"}, 2, []),
        ("sglang", "m", {}, 0, []),
    ],
)
def test_deployment_problems(kind, model, args, adapters, expected):
    assert fields(kind, model, args, adapters) == expected


def test_every_problem_names_the_engine_or_the_fix():
    for kind in ENGINE_KINDS:
        for problem in deployment_problems(kind, "alias", {"tensor_parallel_size": 128}, adapters=2):
            assert problem.reason and (kind in problem.reason or "GPUs" in problem.reason)
    (problem,) = deployment_problems("llama.cpp", "smollm2-135m", {}, adapters=0)
    assert ".gguf" in problem.reason and "smollm2-135m" in problem.reason
