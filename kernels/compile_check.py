"""Compile every Triton kernel for an NVIDIA GPU without one: catches compile errors and spills.

Each kernel is launched through its real Python wrapper on small CPU tensors, with the
launch intercepted: the captured arguments become the signature, constexprs and the
16-byte divisibility hints Triton's JIT would derive at runtime, and the kernel is compiled
ahead of time for the chosen architecture with the ptxas bundled in Triton's wheel. The
report lists registers, stack (spill) bytes and shared memory per kernel and configuration.

    PYTHONPATH=. python -m kernels.compile_check --arch 90
    (exit status 1 on a compile error, or on spills with --no-spills)

Must run in compiled mode: TRITON_INTERPRET unset before triton is imported.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_TORCH_TO_TRITON = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass
class Launch:
    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](...)` records instead of launching."""

    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))

        return record


@contextmanager
def recording(module: Any, launches: list[Launch]) -> Iterator[None]:
    names = [n for n, v in vars(module).items() if type(v).__name__ == "JITFunction"]
    originals = {n: getattr(module, n) for n in names}
    for name, kernel in originals.items():
        setattr(module, name, _Recorder(kernel, launches))
    try:
        yield
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def _signature(
    launch: Launch,
) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], Any], dict[str, Any]]:
    kernel = launch.kernel
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}
    constexprs = {k: v for k, v in launch.kwargs.items() if k not in options}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = launch.args[index]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # the caching allocator aligns to 256 B
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:  # Triton's JIT turns an int 1 into a constant
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs, attrs, options


def _resources(cubin: bytes) -> dict[str, int]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}


def compile_launch(launch: Launch, arch: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = _signature(launch)
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {**_resources(compiled.asm["cubin"]), "shared": compiled.metadata.shared, **options}


def _workloads(dtypes: list[torch.dtype]) -> list[tuple[str, Any, Callable[[], None]]]:
    """(label, module, call) for every wrapper at the shapes the engine and the benchmark use."""
    from kernels import triton_attention, triton_cache, triton_norm_rope

    work: list[tuple[str, Any, Callable[[], None]]] = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for num_heads, num_kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
            shape = f"Hq{num_heads} Hkv{num_kv_heads} D{head_dim} {name}"
            cache = torch.zeros(64, 16, num_kv_heads, head_dim, dtype=dtype)
            tables = torch.zeros(4, 16, dtype=torch.int32)
            lens = torch.full((4,), 100, dtype=torch.int32)
            q = torch.zeros(4, num_heads, head_dim, dtype=dtype)
            for partition in (None, 64):
                label = f"decode {'split-K' if partition else 'single'} {shape}"
                work.append(
                    (
                        label,
                        triton_attention,
                        lambda q=q, c=cache, t=tables, n=lens, p=partition: (
                            triton_attention.paged_attention_decode(q, c, c, t, n, 0.1, partition_size=p)
                        ),
                    )
                )
            starts = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
            work.append(
                (
                    f"prefill {shape}",
                    triton_attention,
                    lambda q=q, c=cache, t=tables, s=starts, n=lens: triton_attention.paged_attention_prefill(
                        q, c, c, t, s, n, 0.1
                    ),
                )
            )
            slots = torch.arange(4)
            kv = torch.zeros(4, num_kv_heads, head_dim, dtype=dtype)
            work.append(
                (
                    f"write_kv_cache {shape}",
                    triton_cache,
                    lambda kv=kv, c=cache, s=slots: triton_cache.write_kv_cache(kv, kv, c, c, s),
                )
            )
            cos_sin = torch.zeros(128, head_dim)
            work.append(
                (
                    f"rotary {shape}",
                    triton_norm_rope,
                    lambda q=q, kv=kv, cs=cos_sin, s=slots: triton_norm_rope.rotary_embedding(s, q, kv, cs),
                )
            )
        for hidden in (576, 4096):
            x = torch.zeros(8, hidden, dtype=dtype)
            work.append(
                (
                    f"rms_norm H{hidden} {name}",
                    triton_norm_rope,
                    lambda x=x: triton_norm_rope.rms_norm(x, x[0], 1e-5, x),
                )
            )
    return work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability, e.g. 80 (A100), 90 (H100/H200)"
    )
    parser.add_argument("--no-spills", action="store_true", help="fail when a kernel spills registers")
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"]
    )
    args = parser.parse_args(argv)
    from kernels.triton_mode import interpreter_active

    if interpreter_active():
        print("compile_check needs compiled mode: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    failed = False
    seen: set[tuple[Any, ...]] = set()
    for label, module, call in _workloads([getattr(torch, name) for name in args.dtypes]):
        launches: list[Launch] = []
        with recording(module, launches):
            call()
        for launch in launches:
            key = (
                launch.kernel.__name__,
                *sorted(_signature(launch)[1].items()),
                *sorted(_signature(launch)[0].items()),
            )
            if key in seen:
                continue
            seen.add(key)
            kernel = launch.kernel.__name__
            try:
                res = compile_launch(launch, args.arch)
            except Exception as err:
                failed = True
                print(f"FAIL {kernel:24s} {label}: {type(err).__name__}: {err}")
                continue
            spilled = res["stack"] > 0
            failed |= spilled and args.no_spills
            print(
                f"{'SPILL' if spilled else 'ok':5s} {kernel:24s} {label:32s} regs={res['regs']:3d} "
                f"stack={res['stack']:4d} shared={res['shared']:6d} warps={res.get('num_warps', 4)}"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
