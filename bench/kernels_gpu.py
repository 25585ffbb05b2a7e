"""Triton kernels on a CUDA GPU: correctness against the references, then decode bandwidth.

1. Every kernel (KV write, decode and prefill paged attention, RMSNorm, rotary) runs on fresh
   random inputs and is compared with its PyTorch reference (float32 and bfloat16).
2. Decode paged attention is timed for batch 1..256 x context 512..32k against PyTorch SDPA
   over the same K/V gathered contiguously (the best a non-paged layout can do), and each
   achieved bytes/s (K and V read once) is shown as a fraction of the device copy bandwidth
   measured in the same run.

    PYTHONPATH=. python -m bench.kernels_gpu                # Llama-3-8B-like heads
    PYTHONPATH=. python -m bench.kernels_gpu --num-heads 9 --num-kv-heads 3 --head-dim 64   # SmolLM2
    PYTHONPATH=. python -m bench.kernels_gpu --sweep        # also try tile/warp settings
    TRITON_INTERPRET=1 PYTHONPATH=. python -m bench.kernels_gpu --dry-run   # CPU smoke test

Timing uses CUDA events around each call, after warmup, with the L2 cache flushed in
between; nothing here asserts a timing. Exit status 1 means a correctness check failed.

Over ~400 lines: one self-contained GPU script (correctness, then bandwidth) meant to be
copied to a GPU machine and run alone.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 200)  # logs: no 80-column wrap

BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 8192, 16384, 32768)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


# --------------------------------------------------------------------------- timing


class Timer:
    """Mean milliseconds per call: CUDA events per call, L2 flushed before each (perf_counter on CPU)."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self._flush = (
            torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None
        )

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self._flush is None:
            start = time.perf_counter()
            for _ in range(self.iters):
                fn()
            return (time.perf_counter() - start) * 1e3 / self.iters
        torch.cuda.synchronize(self.device)
        events = []
        for _ in range(self.iters):
            self._flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            events.append((begin, end))
        torch.cuda.synchronize(self.device)
        return sum(b.elapsed_time(e) for b, e in events) / self.iters


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the practical memory roofline."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


# --------------------------------------------------------------------------- inputs


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def decode(self, q: torch.Tensor, scale: float, **options: object) -> Callable[[], torch.Tensor]:
        """The Triton decode over these caches, ready to time."""
        from kernels import triton_attention

        return functools.partial(
            triton_attention.paged_attention_decode,
            q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            scale,
            **options,
        )


def paged_inputs(
    lengths: Sequence[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> Paged:
    """Random K/V in shuffled blocks; slots past each length hold NaN so stray reads show up."""
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.full((len(lengths), max(per_seq)), int(order[-1]), dtype=torch.int32, device=device)
    k_cache[order[-1]] = float("nan")
    v_cache[order[-1]] = float("nan")
    used = 0
    for seq, (length, count) in enumerate(zip(lengths, per_seq, strict=True)):
        blocks = order[used : used + count]
        used += count
        tables[seq, :count] = blocks
        tail = length - (count - 1) * block_size
        k_cache[blocks[-1], tail:] = float("nan")
        v_cache[blocks[-1], tail:] = float("nan")
    return Paged(k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32, device=device))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return math.inf
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# --------------------------------------------------------------------------- correctness


def run_checks(device: torch.device, small: bool) -> bool:
    """Each Triton kernel vs its reference; True when all pass."""
    from kernels import reference as ref
    from kernels import triton_attention, triton_cache, triton_norm_rope

    gen_lengths = [1, 15, 16, 17, 33] if small else [1, 15, 16, 17, 100, 511, 1000, 2049]
    table = Table(title="Triton kernels vs PyTorch references (fresh random inputs)")
    for column in ("kernel", "shape", "dtype", "rel err", "tolerance", "ok"):
        table.add_column(column, justify="right" if column in ("rel err", "tolerance") else "left")
    all_ok = True

    def record(kernel: str, shape: str, dtype: torch.dtype, err: float) -> None:
        nonlocal all_ok
        ok = err < TOLERANCE[dtype]
        all_ok &= ok
        name = str(dtype).removeprefix("torch.")
        table.add_row(
            kernel, shape, name, f"{err:.2e}", f"{TOLERANCE[dtype]:.0e}", "yes" if ok else "[red]NO"
        )

    torch.manual_seed(0)
    attention_shapes = [(16, 64, 1, 2), (32, 128, 3, 2), (16, 128, 8, 1), (16, 64, 3, 3)]
    for dtype in (torch.float32, torch.bfloat16):
        for block_size, head_dim, group, num_kv_heads in attention_shapes:
            num_heads = group * num_kv_heads
            shape = f"bs{block_size} D{head_dim} Hq{num_heads} Hkv{num_kv_heads}"
            scale = head_dim**-0.5
            kv = paged_inputs(gen_lengths, block_size, num_kv_heads, head_dim, dtype, device)
            q = torch.randn(len(gen_lengths), num_heads, head_dim, dtype=dtype, device=device)
            args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
            upcast = (q.float(), kv.k_cache.float(), kv.v_cache.float(), *args[3:])
            expected = ref.paged_attention_decode(*upcast)
            record("decode", shape, dtype, rel_err(triton_attention.paged_attention_decode(*args), expected))
            split = triton_attention.paged_attention_decode(*args, partition_size=64, block_n=32)
            record("decode split-K", shape, dtype, rel_err(split, expected))

            # Chunked prefill: each sequence's last q_len tokens over the rest as cached prefix.
            q_lens = [min(n, max(1, n // 3)) for n in gen_lengths]
            starts = torch.tensor(
                [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
            )
            qp = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
            pargs = (qp, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.context_lens, scale)
            expected = ref.paged_attention_prefill(
                qp.float(), kv.k_cache.float(), kv.v_cache.float(), *pargs[3:]
            )
            record(
                "prefill (chunked)",
                shape,
                dtype,
                rel_err(triton_attention.paged_attention_prefill(*pargs), expected),
            )

        # KV write through a slot mapping with skipped (-1) slots, from strided views.
        num_tokens, num_kv_heads, head_dim, block_size = 37, 4, 128, 16
        qkv = torch.randn(num_tokens, (8 + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        _, key, value = qkv.split([8 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        key = key.view(num_tokens, num_kv_heads, head_dim)
        value = value.view(num_tokens, num_kv_heads, head_dim)
        slots = torch.randperm(8 * block_size, device=device)[:num_tokens]
        slots[::5] = -1
        caches = [
            torch.full((8, block_size, num_kv_heads, head_dim), 3.0, dtype=dtype, device=device)
            for _ in range(4)
        ]
        triton_cache.write_kv_cache(key, value, caches[0], caches[1], slots)
        ref.write_kv_cache(key, value, caches[2], caches[3], slots)
        err = max(rel_err(caches[0], caches[2]), rel_err(caches[1], caches[3]))
        record("write_kv_cache", f"T{num_tokens} Hkv{num_kv_heads} D{head_dim}", dtype, err)

        # Fused RMSNorm with and without the residual add.
        for hidden in (576, 4096):
            x = torch.randn(67, hidden, dtype=dtype, device=device)
            residual = torch.randn_like(x)
            weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
            out, new_res = triton_norm_rope.rms_norm(x, weight, 1e-5, residual)
            # Ground truth from the same inputs in float32: only the output rounding differs.
            exp_out, exp_res = ref.rms_norm(x.float(), weight.float(), 1e-5, residual.float())
            plain = triton_norm_rope.rms_norm(x, weight, 1e-5)
            err = max(
                rel_err(out, exp_out),
                rel_err(new_res, exp_res),
                rel_err(plain, ref.rms_norm(x.float(), weight.float(), 1e-5)),
            )
            record("rms_norm (+residual)", f"T67 H{hidden}", dtype, err)

        # Rotary in place on q/k views of one qkv tensor, llama3 scaling, full and partial rotation.
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        for head_dim, rot in ((128, 128), (64, 32)):
            cache = ref.build_cos_sin_cache(head_dim, 32768, 500000.0, scaling, device, torch.float32, rot)
            sizes = [32 * head_dim, 8 * head_dim, 8 * head_dim]
            qkv = torch.randn(91, sum(sizes), dtype=dtype, device=device)
            expected = qkv.float()
            positions = torch.randint(0, 32768, (91,), device=device)
            for buf, rotate in ((qkv, triton_norm_rope.rotary_embedding), (expected, ref.rotary_embedding)):
                q, k, _ = buf.split(sizes, dim=-1)
                rotate(positions, q.view(91, 32, head_dim), k.view(91, 8, head_dim), cache)
            record("rotary_embedding", f"T91 Hq32 Hkv8 D{head_dim} rot{rot}", dtype, rel_err(qkv, expected))
    console.print(table)
    return all_ok


# --------------------------------------------------------------------------- decode timing


def time_decode(
    device: torch.device,
    timer: Timer,
    copy_bw: float,
    batches: Sequence[int],
    contexts: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:

    group = num_heads // num_kv_heads
    elt = torch.tensor([], dtype=dtype).element_size()
    table = Table(
        title=(
            f"Decode paged attention, Hq={num_heads} Hkv={num_kv_heads} D={head_dim} block={block_size} "
            f"{str(dtype).removeprefix('torch.')}; copy bandwidth {copy_bw / 1e9:,.0f} GB/s"
        )
    )
    for column in (
        "batch",
        "context",
        "KV MiB",
        "triton µs",
        "triton GB/s",
        "% copy BW",
        "SDPA µs",
        "SDPA GB/s",
        "SDPA % BW",
        "triton speedup",
    ):
        table.add_column(column, justify="right")
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elt
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**34
            row = [str(batch), str(context), f"{kv_bytes / 2**20:,.1f}"]
            if 1.1 * kv_bytes > 0.9 * free:
                table.add_row(*row, "skipped: memory", *[""] * 6)
                continue
            paged = paged_inputs([context] * batch, block_size, num_kv_heads, head_dim, dtype, device)
            q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
            scale = head_dim**-0.5
            decode = paged.decode(q, scale)
            ms = timer(decode)
            row += [
                f"{ms * 1e3:,.1f}",
                f"{kv_bytes / (ms * 1e-3) / 1e9:,.0f}",
                f"{100 * kv_bytes / (ms * 1e-3) / copy_bw:.0f}%",
            ]
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**34
            if 1.6 * kv_bytes > 0.9 * free:  # gathered copy of K and V plus one transient
                table.add_row(*row, "skipped: memory", "", "", "")
            else:
                # The same K/V laid out contiguously [B, Hkv, L, D]; G query heads per KV head as G "queries".
                ids = paged.block_tables.long()
                k = (
                    paged.k_cache[ids]
                    .reshape(batch, context, num_kv_heads, head_dim)
                    .transpose(1, 2)
                    .contiguous()
                )
                v = (
                    paged.v_cache[ids]
                    .reshape(batch, context, num_kv_heads, head_dim)
                    .transpose(1, 2)
                    .contiguous()
                )
                qg = q.view(batch, num_kv_heads, group, head_dim)
                sdpa_ms = timer(functools.partial(F.scaled_dot_product_attention, qg, k, v, scale=scale))
                row += [
                    f"{sdpa_ms * 1e3:,.1f}",
                    f"{kv_bytes / (sdpa_ms * 1e-3) / 1e9:,.0f}",
                    f"{100 * kv_bytes / (sdpa_ms * 1e-3) / copy_bw:.0f}%",
                    f"{sdpa_ms / ms:.2f}x",
                ]
                table.add_row(*row)
                del k, v
            del paged, q
            if device.type == "cuda":
                torch.cuda.empty_cache()
    console.print(table)


def sweep(
    device: torch.device,
    timer: Timer,
    copy_bw: float,
    args: argparse.Namespace,
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, int]] = ((32, 4096), (64, 8192), (256, 4096), (8, 32768)),
) -> None:
    """Decode kernel tile / warp / stage settings and split-K partition sizes at a few shapes."""

    elt = torch.tensor([], dtype=dtype).element_size()
    settings: list[tuple[str, dict[str, int]]] = [("defaults", {})]
    settings += [
        (f"block_n {bn} / warps {w} / stages {st}", {"block_n": bn, "num_warps": w, "num_stages": st})
        for bn in (32, 64, 128)
        for w in (2, 4, 8)
        for st in (1, 2, 3)
    ]
    settings += [(f"partition {p}", {"partition_size": p}) for p in (256, 512, 1024, 2048, 4096, 32768)]
    table = Table(title=f"Decode kernel settings, % of copy bandwidth ({copy_bw / 1e9:,.0f} GB/s)")
    table.add_column("setting (others default)")
    for batch, context in shapes:
        table.add_column(f"B{batch} L{context}", justify="right")
    cells: dict[str, list[str]] = {label: [] for label, _ in settings}
    for batch, context in shapes:
        kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elt
        paged = paged_inputs(
            [context] * batch, args.block_size, args.num_kv_heads, args.head_dim, dtype, device
        )
        q = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device=device)
        for label, kwargs in settings:
            if kwargs.get("partition_size", 0) > context:
                cells[label].append("")
                continue
            decode = paged.decode(q, 0.1, **kwargs)
            try:
                ms = timer(decode)
                cells[label].append(f"{100 * kv_bytes / (ms * 1e-3) / copy_bw:.0f}%")
            except Exception as err:  # e.g. out of shared memory for a setting
                cells[label].append(f"[red]{type(err).__name__}")
        del paged, q
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for label, row in cells.items():
        table.add_row(label, *row)
    console.print(table)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time decode tile/warp/stage settings")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on CPU through Triton's interpreter (TRITON_INTERPRET=1), to test this script",
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    if args.dry_run:
        from kernels.triton_mode import interpreter_active

        if not interpreter_active():
            console.print("--dry-run needs TRITON_INTERPRET=1 in the environment")
            return 2
        device = torch.device("cpu")
        args.batches, args.contexts, args.warmup, args.iters = [1, 2], [32, 64], 0, 1
    elif not torch.cuda.is_available():
        console.print("No CUDA device here: the Triton kernel benchmark needs an NVIDIA GPU. Nothing to do.")
        return 0
    else:
        device = torch.device("cuda")
        console.print(f"Device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")

    ok = True
    if not args.skip_checks:
        ok = run_checks(device, small=args.dry_run)
    timer = Timer(device, args.warmup, args.iters)
    copy_bw = copy_bandwidth(device, timer, (1 if args.dry_run else 1024) * 2**20)
    console.print(f"Device copy bandwidth (read + write): {copy_bw / 1e9:,.0f} GB/s")
    time_decode(
        device,
        timer,
        copy_bw,
        args.batches,
        args.contexts,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.block_size,
        dtype,
    )
    if args.sweep and args.dry_run:
        sweep(device, timer, copy_bw, args, dtype, shapes=[(2, 64)])
    elif args.sweep:
        sweep(device, timer, copy_bw, args, dtype)
    if not ok:
        console.print("[red]Some Triton kernels disagree with their references (see the first table).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
