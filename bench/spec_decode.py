"""n-gram speculative decoding: tokens/s with and without it, and its acceptance rate, same run.

Two workloads, each at concurrency 1 (requests one after another) and as one batch:
(a) "copy": outputs that copy spans of the prompt, where drafting should help: ShareGPT texts
    to repeat or correct, and real Python functions (this repository's engine/ sources) to
    edit and show in full; greedy, natural stops, capped at --copy-max-tokens.
(b) "chat": ShareGPT first turns as `bench.engine_throughput` loads them (chat template,
    Azure conversation output lengths, greedy, ignore_eos), where it should not.
The engines ("off"; "ngram": the default setting, batch-size gate and backoff included;
optionally "ungated": no batch-size gate) are loaded once and run in turn, the order rotated
per case, the same prompts each; the table also says how many outputs were identical to off
(greedy: all should be), and the steps the gate and the backoff left undrafted.

    PYTHONPATH=. .venv/bin/python -m bench.spec_decode --single-requests 3 --batch-size 16 \
        --arms off ngram ungated --threads 1
"""

from __future__ import annotations

import argparse
import ast
import time
from typing import Any

from pydantic import BaseModel

from bench.common import console, machine_note, print_table, run_main
from bench.inputs import ROOT, chat_token_ids, load_azure_output_lengths, load_sharegpt_prompts, resolve_model

COPY_INSTRUCTIONS = (
    "Repeat the following text word for word:\n\n{}",
    "Fix any spelling mistakes in the following text and output the full corrected text:\n\n{}",
)
ARMS = ("off", "ngram", "ungated")
CODE_INSTRUCTION = (
    "Add a docstring to this Python function and output the full function:\n\n```python\n{}\n```"
)


class Case(BaseModel):
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool


class Run(BaseModel):
    workload: str
    concurrency: int
    arm: str  # off | ngram | ungated
    requests: int
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    verifies: int
    gated_steps: int = 0
    backoff_skips: int = 0
    decode_seconds: float  # per request, first to last token, summed
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def itl_ms(self) -> float | None:
        """Mean time per output token after each request's first (what a streaming user feels)."""
        n = self.tokens - self.requests
        return 1000 * self.decode_seconds / n if n > 0 else None


def code_snippets(limit: int, min_lines: int = 8, max_lines: int = 30) -> list[str]:
    """Top-level functions and methods of engine/*.py, in file order, of a moderate length."""
    out: list[str] = []
    for path in sorted((ROOT / "engine").glob("*.py")):
        src = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    seg = ast.get_source_segment(src, node)
                    if seg:
                        out.append(seg)
            if len(out) >= limit:
                return out
    return out


def copy_case(tokenizer: Any, n: int, max_tokens: int, max_prompt_tokens: int) -> Case:
    """Half texts to repeat or correct (ShareGPT turns of 300-1,200 characters), half code edits."""
    texts = [t for t in load_sharegpt_prompts() if 300 <= len(t) <= 1200]
    code = code_snippets(n)
    prompts: list[list[int]] = []
    ti = ci = 0
    while len(prompts) < n and (ti < len(texts) or ci < len(code)):
        if len(prompts) % 2 == 1 and ci < len(code):
            text, ci = CODE_INSTRUCTION.format(code[ci]), ci + 1
        elif ti < len(texts):
            text = COPY_INSTRUCTIONS[ti % len(COPY_INSTRUCTIONS)].format(texts[ti].strip())
            ti += 1
        else:
            text, ci = CODE_INSTRUCTION.format(code[ci]), ci + 1
        ids = chat_token_ids(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
    return Case(prompts=prompts, max_tokens=[max_tokens] * len(prompts), ignore_eos=False)


def chat_case(tokenizer: Any, n: int, max_out: int, max_prompt_tokens: int, seed: int) -> Case:
    lens = load_azure_output_lengths(n, seed, hi=max_out)
    prompts: list[list[int]] = []
    for text in load_sharegpt_prompts():
        if len(prompts) == n:
            break
        ids = chat_token_ids(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
    return Case(prompts=prompts, max_tokens=lens[: len(prompts)], ignore_eos=True)


def run(llm: Any, case: Case, concurrency: int, workload: str, arm: str) -> Run:
    from engine import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=case.ignore_eos) for m in case.max_tokens
    ]
    llm.reset_prefix_cache()  # each run prefills its prompts itself
    s0 = llm.stats()
    t0 = time.perf_counter()
    if concurrency == 1:
        outs = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(case.prompts, params, strict=True)]
    else:
        outs = llm.generate(case.prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    s1 = llm.stats()
    return Run(
        workload=workload,
        concurrency=concurrency,
        arm=arm,
        requests=len(outs),
        tokens=sum(len(o.token_ids) for o in outs),
        seconds=seconds,
        drafted=s1.spec_decode_num_draft_tokens - s0.spec_decode_num_draft_tokens,
        accepted=s1.spec_decode_num_accepted_tokens - s0.spec_decode_num_accepted_tokens,
        verifies=s1.spec_decode_num_drafts - s0.spec_decode_num_drafts,
        gated_steps=s1.spec_decode_num_gated_steps - s0.spec_decode_num_gated_steps,
        backoff_skips=s1.spec_decode_num_backoff_skips - s0.spec_decode_num_backoff_skips,
        decode_seconds=sum(
            o.metrics.last_token_time - o.metrics.first_token_time
            for o in outs
            if o.metrics and o.metrics.first_token_time and o.metrics.last_token_time
        ),
        outputs=[list(o.token_ids) for o in outs],
    )


def print_runs(runs: list[Run], title: str) -> None:
    rows = []
    base = {(r.workload, r.concurrency): r for r in runs if r.arm == "off"}
    for r in runs:
        off = base.get((r.workload, r.concurrency))
        same = sum(a == b for a, b in zip(r.outputs, off.outputs, strict=True)) if off else None
        rows.append(
            [
                r.workload,
                r.concurrency,
                r.arm,
                r.requests,
                r.tokens,
                r.seconds,
                r.tokens_per_s,
                r.tokens_per_s / off.tokens_per_s if off and off.tokens_per_s else None,
                r.itl_ms,
                off.itl_ms / r.itl_ms if off and off.itl_ms and r.itl_ms else None,
                r.accepted / r.drafted if r.drafted else None,
                (r.accepted + r.verifies) / r.verifies if r.verifies else None,
                f"{same}/{r.requests}" if r.arm != "off" and same is not None else "-",
                r.gated_steps if r.arm != "off" else None,
                r.backoff_skips if r.arm != "off" else None,
            ]
        )
    cols = [
        "workload",
        "concurrency",
        "arm",
        "requests",
        "tokens",
        "seconds",
        "tok/s",
        "vs off",
        "ms/token after first",
        "decode vs off",
        "acceptance",
        "tokens/verify",
        "identical",
        "gated steps",
        "backoff skips",
    ]
    print_table(title, cols, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--single-requests", type=int, default=4, help="requests at concurrency 1")
    p.add_argument(
        "--batch-size", type=int, nargs="+", default=[16], help="requests submitted at once (one or more)"
    )
    p.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=["off", "ngram"],
        help="off; ngram (gated); ungated (no batch-size gate)",
    )
    p.add_argument("--disable-by-batch-size", type=int, default=None, help="the gate of the ngram arm")
    p.add_argument("--copy-max-tokens", type=int, default=128)
    p.add_argument("--chat-max-tokens", type=int, default=128, help="clip of the Azure output lengths")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--workloads", nargs="+", choices=["copy", "chat"], default=["copy", "chat"])
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--prompt-lookup-max", "--ngram-max", dest="prompt_lookup_max", type=int, default=None)
    p.add_argument("--prompt-lookup-min", "--ngram-min", dest="prompt_lookup_min", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="pin torch threads (default: tuned per step)")
    p.add_argument("--seed", type=int, default=0, help="seed of the output-length draw")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine import LLM, SamplingParams
    from engine.spec_decode.config import SpeculativeConfig

    args = parse_args(argv)
    resolve_model(args.model)
    fields = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
    spec = SpeculativeConfig(**{k: getattr(args, k) for k in fields if getattr(args, k) is not None})
    settings = {
        "off": None,
        "ngram": spec,
        "ungated": spec.model_copy(update={"disable_by_batch_size": None}),
    }
    sizes = [b for b in args.batch_size if b > 0]
    n = max([args.single_requests, *sizes])
    kw: dict[str, Any] = {"show_progress": False, "max_num_seqs": max([1, *sizes])}
    if args.threads is not None:
        kw["num_threads"] = args.threads
    engines = {arm: LLM(args.model, speculative_config=settings[arm], **kw) for arm in args.arms}
    first = next(iter(engines.values()))
    note = lambda: machine_note("cpu", args.threads or torch.get_num_threads())  # noqa: E731
    console.print(f"{note()} (threads tuned per step unless --threads); speculative {spec.model_dump()}")
    cases = {}
    if "copy" in args.workloads:
        cases["copy"] = copy_case(first.tokenizer, n, args.copy_max_tokens, args.max_prompt_tokens)
    if "chat" in args.workloads:
        cases["chat"] = chat_case(first.tokenizer, n, args.chat_max_tokens, args.max_prompt_tokens, args.seed)
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in engines.values():
        llm.generate([next(iter(cases.values())).prompts[0]], warm, use_tqdm=False)
    runs: list[Run] = []
    arms = list(engines)
    turn = 0
    for name, case in cases.items():
        for conc, size in ((1, args.single_requests), *((b, b) for b in sizes)):
            if size <= 0:
                continue
            sub = Case(
                prompts=case.prompts[:size], max_tokens=case.max_tokens[:size], ignore_eos=case.ignore_eos
            )
            order = arms[turn % len(arms) :] + arms[: turn % len(arms)]
            turn += 1  # rotate which goes first, so drifting load favours none
            done = {arm: run(engines[arm], sub, conc, name, arm) for arm in order}
            runs.extend(done[arm] for arm in arms)
            print_runs(runs, "speculative decoding so far")
    print_runs(
        runs, f"n-gram speculative decoding vs off, same run ({machine_note('cpu', args.threads or 0)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
