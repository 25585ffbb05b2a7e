"""Everything worth measuring on a CUDA machine, in one run and one report.

1. Kernel checks and the decode bandwidth table: `bench.kernels_gpu` at SmolLM2's heads.
2. Greedy equality on the real model: the engine on the PyTorch reference kernels vs the
   Triton kernels, and the Triton path eager vs with CUDA graphs (`cuda_graphs=True`).
3. The offline throughput benchmark (`bench.engine_throughput`) eager and with CUDA graphs.

Each part's output goes into one Markdown report (`--out`); a part that fails is reported and
the others still run. Exit status 1 if any part failed, 2 without CUDA.

    PYTHONPATH=. .venv/bin/python -m bench.gpu_all --out gpu_report.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GREEDY_CHILD = r"""
import json, sys
from engine import LLM, SamplingParams
prompts = json.loads(sys.argv[1]); max_tokens = int(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
runs = {}
for name, kw in [("torch", dict(attention_backend="torch")), ("triton", dict(attention_backend="triton")),
                 ("triton+graphs", dict(attention_backend="triton", cuda_graphs=True))]:
    llm = LLM(model=sys.argv[3], device="cuda", dtype="float32", show_progress=False, **kw)
    runs[name] = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
print("RESULT " + json.dumps(runs))
"""

PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a linked list.",
    "Explain the difference between TCP and UDP in three sentences.",
    "1, 1, 2, 3, 5, 8, 13,",
]


def run_part(title: str, cmd: list[str], timeout: int) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        ok, out = proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    except subprocess.TimeoutExpired as err:
        ok, out = False, f"timed out after {timeout} s\n{(err.stdout or b'')[-4000:]!r}"
    print(f"{title}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return ok, out


def greedy_section(model: str, max_tokens: int, timeout: int) -> tuple[bool, str]:
    cmd = [sys.executable, "-c", GREEDY_CHILD, json.dumps(PROMPTS), str(max_tokens), model]
    ok, out = run_part("greedy equality", cmd, timeout)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if not ok or line is None:
        return False, out
    runs = json.loads(line[len("RESULT ") :])
    ref = runs["torch"]
    rows = ["| path | prompts identical to the torch reference |", "|---|---|"]
    ok = True
    for name, toks in runs.items():
        same = sum(a == b for a, b in zip(ref, toks))
        ok &= same == len(ref)
        rows.append(f"| {name} | {same}/{len(ref)} |")
    return ok, "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="gpu_report.md")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48, help="greedy equality: tokens per prompt")
    p.add_argument("--timeout", type=int, default=900, help="seconds per part")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        Path(args.out).write_text("# GPU report\n\nNo CUDA device: nothing was run.\n", encoding="utf-8")
        print("no CUDA device", file=sys.stderr)
        return 2
    py = sys.executable
    sections: list[tuple[str, bool, str]] = []
    kernels = [py, "-m", "bench.kernels_gpu", "--num-heads", "9", "--num-kv-heads", "3", "--head-dim", "64"]
    sections.append(
        ("Kernel checks and decode bandwidth (SmolLM2 heads)", *run_part("kernels", kernels, args.timeout))
    )
    sections.append(("Greedy equality (float32)", *greedy_section(args.model, args.max_tokens, args.timeout)))
    thr = [py, "-m", "bench.engine_throughput", "--num-prompts", str(args.num_prompts), "--device", "cuda"]
    sections.append(("Offline throughput (eager)", *run_part("throughput eager", thr, args.timeout)))
    graphs = [*thr, "--skip-hf-single", "--skip-hf-static", "--cuda-graphs"]
    sections.append(
        ("Offline throughput (CUDA graphs, ours only)", *run_part("throughput graphs", graphs, args.timeout))
    )
    name = torch.cuda.get_device_name(0)
    lines = [f"# GPU report: {name}", "", f"torch {torch.__version__}, CUDA {torch.version.cuda}", ""]
    for title, ok, body in sections:
        table = body.startswith("|")
        lines += [f"## {title}: {'ok' if ok else 'FAILED'}", ""]
        lines += [body, ""] if table else ["```", body.rstrip(), "```", ""]
    Path(args.out).write_text("\n".join(lines), encoding="utf-8")
    print(f"report: {args.out}")
    return 0 if all(ok for _, ok, _ in sections) else 1


if __name__ == "__main__":
    raise SystemExit(main())
