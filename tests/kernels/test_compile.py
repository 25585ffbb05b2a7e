"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU, and none spills registers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas_available() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not _ptxas_available(), reason="triton's NVIDIA backend (bundled ptxas) is not installed")
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)  # compiled mode: a fresh process decides it at import
    cmd = [
        sys.executable,
        "-m",
        "kernels.compile_check",
        "--arch",
        "90",
        "--dtypes",
        "bfloat16",
        "--no-spills",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    compiled = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    assert compiled == {
        "_decode_kernel",
        "_decode_reduce_kernel",
        "_prefill_kernel",
        "_write_kv_kernel",
        "_rotary_kernel",
        "_rms_norm_kernel",
    }, result.stdout
