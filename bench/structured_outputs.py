"""Structured outputs: what constrained decoding costs, measured in one run.

1. Grammar compile time of a 20-field JSON schema: xgrammar (what the engine uses) vs
   llguidance (the alternative), cold and then from the engine's cache.
2. Per-step mask cost at batch 32: both engines filling 32 sequences' token bitmasks in
   one batched call while walking the same valid JSON document token by token, each step
   also applying the mask to a batch of logits (as the engine does).
3. Engine throughput (generated tokens/s) at batch 1 and 32, `json_schema` vs unconstrained,
   same prompts, same sampling (temperature 0.7, seeded), same process.

    PYTHONPATH=. .venv/bin/python -m bench.structured_outputs [--max-tokens 32] [--threads 2]

Measures and prints; asserts nothing about timing (numbers are noisy on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.common import console, machine_note, print_table, resolve_device, run_main, set_threads
from bench.inputs import resolve_model


def wide_schema(fields: int) -> dict[str, Any]:
    """A strict object of `fields` typed, bounded properties (strings, integers, enums, booleans)."""
    kinds = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"enum": ["low", "mid", "high"]},
        {"type": "boolean"},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def instance(schema: dict[str, Any]) -> dict[str, Any]:
    sample = {"string": "abc", "integer": 42, "boolean": True}
    return {k: v["enum"][1] if "enum" in v else sample[v["type"]] for k, v in schema["properties"].items()}


def compile_times(tokenizer: Any, vocab_size: int, schema: dict[str, Any]) -> list[list[object]]:
    import xgrammar  # noqa: F401  (its import, transformers included, is not setup time)

    from engine.grammar import GrammarBackend
    from fleet_base.sampling_params import StructuredOutput

    rows: list[list[object]] = []
    t0 = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab_size)
    setup = time.perf_counter() - t0
    spec = StructuredOutput(kind="json_schema", json_schema=json.dumps(schema))
    t0 = time.perf_counter()
    backend.compile(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.compile(spec)
    cached = time.perf_counter() - t0
    rows.append(["xgrammar (engine)", setup * 1e3, cold * 1e3, cached * 1e3])
    try:
        import llguidance
    except ImportError:
        rows.append(["llguidance", None, None, None])
        return rows
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
    )
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    llguidance.LLMatcher(lt, grammar)
    cold = time.perf_counter() - t0
    rows.append(["llguidance", setup * 1e3, cold * 1e3, None])
    return rows


def mask_costs(tokenizer: Any, vocab_size: int, schema: dict[str, Any], batch: int) -> list[list[object]]:
    """Per-step batched fill (ms) walking the same valid document in every row."""
    import torch
    import xgrammar as xgr

    from engine.grammar import GrammarBackend, apply_bitmask_
    from fleet_base.sampling_params import StructuredOutput

    doc = tokenizer.encode(json.dumps(instance(schema), separators=(", ", ": ")), add_special_tokens=False)
    backend = GrammarBackend(tokenizer, vocab_size)
    spec = StructuredOutput(kind="json_schema", json_schema=json.dumps(schema))
    matchers = [backend.matcher(spec) for _ in range(batch)]
    fills, applies = [], []
    logits = torch.randn(batch, vocab_size)
    for tok in doc:
        t0 = time.perf_counter()
        mask = backend.bitmask(matchers)  # type: ignore[arg-type]
        fills.append(time.perf_counter() - t0)
        assert mask is not None
        scratch = logits.clone()
        t0 = time.perf_counter()
        apply_bitmask_(scratch, mask, vocab_size)
        applies.append(time.perf_counter() - t0)
        if not all(m.accept_token(tok) for m in matchers):
            break
    rows: list[list[object]] = [
        [
            "xgrammar (engine)",
            len(fills),
            statistics.median(fills) * 1e3,
            statistics.mean(fills) * 1e3,
            statistics.median(applies) * 1e3,
        ]
    ]
    del xgr
    try:
        import llguidance
        import llguidance.torch as lgt
    except ImportError:
        return rows
    lt = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    lms = [llguidance.LLMatcher(lt, grammar) for _ in range(batch)]
    executor = llguidance.LLExecutor()
    bitmask = torch.full(lgt.get_bitmask_shape(batch, vocab_size), -1, dtype=torch.int32)
    fills = []
    for tok in doc:
        t0 = time.perf_counter()
        lgt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(lms)], bitmask)
        fills.append(time.perf_counter() - t0)
        apply_bitmask_(logits.clone(), bitmask, vocab_size)  # the same step work as above
        if not all(m.consume_token(tok) for m in lms):
            break
    rows.append(
        ["llguidance", len(fills), statistics.median(fills) * 1e3, statistics.mean(fills) * 1e3, None]
    )
    return rows


def throughput(
    model: str, batches: Sequence[int], max_tokens: int, schema: dict[str, Any]
) -> list[list[object]]:
    from engine import LLM, SamplingParams
    from fleet_base.sampling_params import StructuredOutput

    llm = LLM(model=model, show_progress=False, max_num_seqs=max(batches))
    spec = StructuredOutput(kind="json_schema", json_schema=json.dumps(schema))
    rows: list[list[object]] = []
    for n in batches:
        convs = [[{"role": "user", "content": f"Describe record {i} as JSON."}] for i in range(n)]
        results: dict[str, tuple[float, int]] = {}
        for label, structured in (("unconstrained", None), ("json_schema", spec)):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=7, structured=structured)
            llm.chat(convs[:1], params, use_tqdm=False)  # warm (compile is cached after this)
            t0 = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            results[label] = (wall, sum(len(o.token_ids) for o in outs))
        base = results["unconstrained"][1] / results["unconstrained"][0]
        for label, (wall, tokens) in results.items():
            rate = tokens / wall
            rows.append([f"batch {n}, {label}", tokens, wall, rate, rate / base])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--fields", type=int, default=20, help="properties of the schema whose compile is timed")
    p.add_argument("--mask-batch", type=int, default=32)
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes for throughput")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args(argv)
    from engine.tokenizer import Tokenizer

    threads = set_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = Tokenizer.from_path(path)
    vocab = tokenizer.vocab_size
    schema = wide_schema(args.fields)
    console.print(machine_note(resolve_device("auto"), threads))
    print_table(
        f"Grammar compile, {args.fields}-field JSON schema (ms)",
        ["engine", "tokenizer setup", "compile (cold)", "compile (cached)"],
        compile_times(tokenizer, vocab, schema),
    )
    print_table(
        f"Token mask per step at batch {args.mask_batch} (ms, one batched call per step)",
        ["engine", "steps", "fill median", "fill mean", "apply median"],
        mask_costs(tokenizer, vocab, schema, args.mask_batch),
    )
    if not args.skip_throughput:
        batches = [int(b) for b in args.batches.split(",")]
        print_table(
            f"Engine throughput, {args.fields}-field json_schema vs unconstrained (max_tokens {args.max_tokens})",
            ["run", "tokens", "wall s", "tokens/s", "vs unconstrained"],
            throughput(args.model, batches, args.max_tokens, schema),
            caption="json_schema rows stop when the object is complete; tokens/s counts the tokens generated.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
