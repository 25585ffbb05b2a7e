"""Prompt tokens counted with the deployment's own tokenizer (resolved from desired.json
like the engine resolves a model), the estimate when there is none."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.gateway.inputs import parse_request
from agent.gateway.tokens import DesiredIndex, TokenCounters, tokenizer_path
from engine.tokenizer import Tokenizer
from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState, ReplicaSpec
from tests.agent.conftest import make_tiny_model_dir


def write_desired(state: Path, model: str, engine_args: dict | None = None) -> None:
    spec = ReplicaSpec(
        replica_id="r1", deployment="tiny", version=1, model=model, engine_args=engine_args or {}
    )
    LocalState(state).save_desired(DesiredState(cluster="c", replicas=[spec]))


def test_paths_resolve_like_the_engine(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    assert tokenizer_path(str(model)) == model
    assert tokenizer_path(str(tmp_path / "missing")) is None
    assert tokenizer_path("sim") is None
    smol = tokenizer_path("smollm2-135m")  # the weights package, if installed, found without importing it
    assert smol is None or smol.name.endswith(".gguf")


def test_counts_with_the_tokenizer_and_falls_back_to_the_estimate(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    state = tmp_path / "state"
    counters = TokenCounters(DesiredIndex(state))
    prompt = "the quick brown fox jumps over the lazy dog, again and again"
    info = parse_request(
        b'{"model": "tiny", "prompt": "%s", "max_tokens": 4}' % prompt.encode(), "completions"
    )
    same, counter = counters.recount(info)  # no desired.json yet
    assert counter == "estimate" and same.prompt_tokens == (len(prompt) + 3) // 4
    write_desired(state, str(model), {"max_num_seqs": 3})
    counted, counter = asyncio.run(counters.recount_async(info))
    assert counter == "tokenizer"
    assert counted.prompt_tokens == len(Tokenizer.from_path(model).encode(prompt))
    assert counted.cost_tokens == counted.prompt_tokens + 4
    assert counters.desired.engine_arg("tiny", "max_num_seqs") == 3
    ids = parse_request(b'{"model": "tiny", "prompt": [1, 2, 3]}', "completions")
    assert counters.recount(ids)[0].prompt_tokens == 3
    write_desired(state, str(tmp_path / "gone"))  # a model whose files are not here
    counters2 = TokenCounters(DesiredIndex(state))
    assert counters2.recount(info)[1] == "estimate"
