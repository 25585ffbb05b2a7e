"""Constrained decoding without a model: SmolLM2's real tokenizer, xgrammar matchers, and the
real sampler over random logits. Whatever the logits, the sampled text must parse and conform."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.grammar import GrammarBackend, GrammarError
from engine.sampler import Sampler, SamplingBatch
from engine.tokenizer import Tokenizer
from fleet_base.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, tokenizer.vocab_size)


def spec(schema: dict) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", json_schema=json.dumps(schema))


def test_compiles_once_per_schema(backend: GrammarBackend) -> None:
    before = backend.cache_misses
    a = backend.compile(spec(SCHEMA))
    b = backend.compile(spec(SCHEMA))
    assert a is b
    assert backend.cache_misses == before + 1 and backend.cache_hits >= 1
    assert backend.compile_seconds.snapshot().count >= 1


def test_unsupported_schema_is_a_value_error_naming_it(backend: GrammarBackend) -> None:
    with pytest.raises(GrammarError, match="JSON schema"):
        backend.compile(spec({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}))


def _walk(
    backend: GrammarBackend, tokenizer: Tokenizer, specs: list[StructuredOutput | None], steps: int
) -> list[str]:
    """Sample every row with the sampler at temperature 1 over random logits, batched."""
    torch.manual_seed(0)
    matchers = [backend.matcher(s) if s is not None else None for s in specs]
    out: list[list[int]] = [[] for _ in specs]
    live = list(range(len(specs)))
    sampler = Sampler()
    stops = set(tokenizer.stop_token_ids)
    for _ in range(steps):
        if not live:
            break
        rows = [matchers[i] for i in live]
        mask = backend.bitmask(rows)
        params = [SamplingParams(temperature=1.0) for _ in live]
        batch = SamplingBatch.build(
            params,
            [[1]] * len(live),
            [out[i] for i in live],
            [None] * len(live),
            [stops] * len(live),
            tokenizer.vocab_size,
            "cpu",
            token_bitmask=mask,
        )
        tokens = sampler(torch.randn(len(live), tokenizer.vocab_size) * 4, batch).token_ids
        still = []
        for i, t in zip(live, tokens):
            m = matchers[i]
            if m is not None:
                assert m.accept_token(t), "the sampler picked a token the grammar forbids"
                if m.is_terminated():
                    continue
            out[i].append(t)
            still.append(i)
        live = still
    return [tokenizer.decode(ids) for ids in out]


def test_random_logits_still_give_conforming_json_batched(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    other = {
        "type": "object",
        "properties": {"v": {"enum": [1, 2, 3]}},
        "required": ["v"],
        "additionalProperties": False,
    }
    specs = [spec(SCHEMA), None, spec(other), StructuredOutput(kind="json_object"), spec(SCHEMA)]
    texts = _walk(backend, tokenizer, specs, steps=60)
    for text, s in zip(texts, specs):
        if s is None:
            continue
        if s.kind == "json_object":  # unbounded: random logits need not finish, but it is an object
            assert text.startswith("{")
            continue
        jsonschema.validate(json.loads(text), json.loads(s.json_schema or "{}"))
    assert backend.mask_seconds.snapshot().count > 0


def test_tool_call_array_schema_with_const_names(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    from fleet_base.openai_contract.structured import Tool, tool_call_constraint

    tools = [
        Tool.model_validate(
            {
                "type": "function",
                "function": {
                    "name": n,
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x"],
                        "additionalProperties": False,
                    },
                },
            }
        )
        for n in ("alpha", "beta")
    ]
    constraint = tool_call_constraint(tools, "required", parallel=False)
    assert constraint is not None
    (text,) = _walk(backend, tokenizer, [constraint], steps=40)
    calls = json.loads(text)
    assert len(calls) == 1 and calls[0]["name"] in ("alpha", "beta") and 0 <= calls[0]["arguments"]["x"] <= 9
