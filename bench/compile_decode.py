"""torch.compile (inductor, CPU) for the decode forward, measured against eager.

The decode forward is split the way vLLM compiles it: the paged attention (KV write and
the gather over a context that grows every step) stays eager, and the dense pieces between
attentions are compiled with static shapes per batch-size bucket:

- `pre`: residual add + RMSNorm + fused qkv matmul + rotary of q and k;
- `post`: o_proj + residual add + RMSNorm + gate/up matmul + SiLU-mul + down matmul;
- `head`: final residual add + RMSNorm + LM head.

Every piece takes its weights as arguments, so one graph per bucket serves all layers.
For each batch size: cold compile seconds (empty inductor cache), compile seconds again
after `torch._dynamo.reset()` (the on-disk FX graph cache warm), eager and compiled ms per
decode forward (same inputs, interleaved rounds), and the largest logit difference and
greedy-token agreement over a few real decode steps.

    PYTHONPATH=. .venv/bin/python -m bench.compile_decode --batch-sizes 1 8 32 64
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from bench.common import batch_sweep_parser, console, print_table, run_main, set_threads
from bench.inputs import resolve_model


def _pieces() -> tuple[Any, Any, Any]:
    import torch.nn.functional as F

    from kernels import reference

    def pre(hidden, residual, norm_w, qkv_w, qkv_b, eps: float, heads: int, head_dim: int, cos, sin):
        if residual is None:
            residual = hidden
            normed = reference.rms_norm(hidden, norm_w, eps)
        else:
            normed, residual = reference.rms_norm(hidden, norm_w, eps, residual)
        qkv = F.linear(normed, qkv_w, qkv_b)
        n = qkv.shape[0]
        qk = qkv[:, : heads * head_dim].view(n, heads, head_dim)
        reference.rotary_embedding(None, qk, None, None, (cos, sin))
        return qkv, residual

    def post(attn, residual, o_w, norm_w, gate_up_w, down_w, eps: float, inter: int):
        out = F.linear(attn, o_w)
        normed, residual = reference.rms_norm(out, norm_w, eps, residual)
        gate_up = F.linear(normed, gate_up_w)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return F.linear(act, down_w), residual

    def head(hidden, residual, norm_w, lm_w, eps: float):
        normed, _ = reference.rms_norm(hidden, norm_w, eps, residual)
        return F.linear(normed, lm_w).float()

    return pre, post, head


class PiecewiseDecode:
    """The model's decode forward through `pre`/`post`/`head` (compiled or not), attention eager."""

    def __init__(self, model: Any, compile_fn: Any = None) -> None:
        pre, post, head = _pieces()
        wrap = compile_fn or (lambda f: f)
        self.model = model
        self.pre, self.post, self.head = wrap(pre), wrap(post), wrap(head)

    def __call__(self, input_ids, positions, kv_caches, meta, logits_idx):
        from kernels import ops

        m = self.model
        cfg = m.config
        if len(meta.decode_groups) != 1 or meta.num_decode_tokens != input_ids.shape[0]:
            raise ValueError("the piecewise forward takes decode-only steps of one attention group")
        hidden = m.embed_tokens(input_ids)
        m._plan_step(positions, kv_caches, meta)
        cos, sin = meta.rotary
        residual = None
        n = hidden.shape[0]
        for layer, (k_cache, v_cache) in zip(m.layers, kv_caches):
            a = layer.self_attn
            qkv, residual = self.pre(
                hidden,
                residual,
                layer.input_layernorm.weight,
                a.qkv_proj.weight,
                a.qkv_proj.bias,
                cfg.rms_norm_eps,
                a.num_heads + a.num_kv_heads,
                a.head_dim,
                cos,
                sin,
            )
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = q.view(n, a.num_heads, a.head_dim)
            k = k.view(n, a.num_kv_heads, a.head_dim)
            v = v.view(n, a.num_kv_heads, a.head_dim)
            ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, meta.kv_write)
            (_, _, tables, lens), plan = meta.decode_groups[0], meta.decode_plans[0]
            attn = ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, a.scale, plan)
            hidden, residual = self.post(
                attn.reshape(n, a.q_size),
                residual,
                a.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight,
                cfg.rms_norm_eps,
                cfg.intermediate_size,
            )
        lm_w = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        return self.head(hidden, residual, m.norm.weight, lm_w, cfg.rms_norm_eps)


def capture_decode_inputs(llm: Any, batch_size: int, prompts: list[list[int]]) -> tuple[list[Any], list[str]]:
    """Start `batch_size` requests, prefill them, and return the next decode step's model inputs."""
    from engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ids = [eng.add_request(prompts[i % len(prompts)], params) for i in range(batch_size)]
    while len(eng.scheduler.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()
    captured: list[Any] = []
    runner = eng.runner
    original = runner.model

    def spy(*args: Any) -> Any:
        captured.append(args)
        return original(*args)

    runner.model = spy
    try:
        eng.step()
    finally:
        runner.model = original
    return list(captured[0]), ids


def measure(llm: Any, batch_size: int, prompts: list[list[int]], rounds: int) -> dict[str, Any]:
    import torch

    runner = llm.engine.runner
    model = runner.model
    args, ids = capture_decode_inputs(llm, batch_size, prompts)
    input_ids, positions, kv_caches, meta, logits_idx = args
    out: dict[str, Any] = {"B": batch_size}
    eager = PiecewiseDecode(model)
    compiled = PiecewiseDecode(model, lambda f: torch.compile(f, dynamic=False, fullgraph=True))

    def fresh_meta() -> Any:
        meta.rotary = meta.kv_write = meta.decode_plans = None
        return meta

    def call(fn: Any) -> Any:
        return fn(input_ids, positions, kv_caches, fresh_meta(), logits_idx)

    with torch.inference_mode():
        t0 = time.perf_counter()
        want = model(input_ids, positions, kv_caches, fresh_meta(), logits_idx)
        one_forward = time.perf_counter() - t0
        for key in ("compile cold s", "compile warm s"):
            if key == "compile warm s":  # forget the compiled code; inductor's disk cache stays
                torch._dynamo.reset()
                compiled = PiecewiseDecode(model, lambda f: torch.compile(f, dynamic=False, fullgraph=True))
            t1 = time.perf_counter()
            got = call(compiled)
            out[key] = time.perf_counter() - t1 - one_forward
        out["max |dlogit|"] = float((got - want).abs().max())
        out["argmax equal"] = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
        for fn in (eager, compiled):
            call(fn)
        timings: dict[str, list[float]] = {"model": [], "pieces eager": [], "pieces compiled": []}
        fns = {"model": model, "pieces eager": eager, "pieces compiled": compiled}
        for _ in range(rounds):
            for name, fn in fns.items():
                t = time.perf_counter()
                call(fn)
                timings[name].append(time.perf_counter() - t)
        for name, ts in timings.items():
            out[f"{name} ms"] = 1000 * sorted(ts)[len(ts) // 2]
    for rid in ids:
        llm.engine.abort_request(rid)
    llm.engine.step()
    llm.reset_prefix_cache()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = batch_sweep_parser(__doc__)
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per batch size")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--cpp-wrapper", action="store_true", help="inductor's C++ wrapper (no Python per kernel call)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A fresh inductor cache: the first compile is cold, the one after a reset reads it from disk.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fleet-inductor-"))
    from engine import LLM

    if args.cpp_wrapper:
        import torch._inductor.config

        torch._inductor.config.cpp_wrapper = True
    resolve_model(args.model)
    threads = set_threads(args.threads)
    # fp32 linears: the pieces read each nn.Linear weight (other formats are other modules)
    llm = LLM(model=args.model, show_progress=False, num_threads=threads, weights="fp32")
    prompts = [list(range(200 + 7 * i, 260 + 7 * i)) for i in range(64)]
    rows = []
    for b in args.batch_sizes:
        r = measure(llm, b, prompts, args.rounds)
        console.print(r)
        rows.append(r)
    cols = list(rows[0])
    print_table(
        f"torch.compile (inductor) decode pieces vs eager, {threads} thread(s)",
        cols,
        [[r[c] for c in cols] for r in rows],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
