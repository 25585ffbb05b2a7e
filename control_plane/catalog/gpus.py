"""What the catalogs leave implicit: the GPUs inside GCP machine families whose host row
names no accelerator, and GPU memory where GpuInfo is just a name (Azure)."""

from __future__ import annotations

import re

# GB per GPU, for GpuInfo values that carry no MemoryInfo.
GPU_MEMORY_GB: dict[str, float] = {
    "A10": 24,
    "A10G": 24,
    "A100": 40,
    "A100-80GB": 80,
    "B200": 180,
    "H100": 80,
    "H100-MEGA": 80,
    "H200": 141,
    "K80": 12,
    "L4": 24,
    "L40S": 48,
    "M60": 8,
    "MI25": 16,
    "MI300X": 192,
    "P100": 16,
    "P4": 8,
    "T4": 16,
    "V100": 16,
    "V100-32GB": 32,
}

# GCP accelerator-optimized families: the GPU model their `-Ng` machines carry.
_GCP_FAMILIES: tuple[tuple[str, str], ...] = (
    ("a2-highgpu-", "A100"),
    ("a2-megagpu-", "A100"),
    ("a2-ultragpu-", "A100-80GB"),
    ("a3-highgpu-", "H100"),
    ("a3-edgegpu-", "H100"),
    ("a3-megagpu-", "H100-MEGA"),
    ("a3-ultragpu-", "H200"),
    ("a4-highgpu-", "B200"),
)
# g2-standard-N carries L4s; the count is not in the name.
_G2_L4 = {4: 1, 8: 1, 12: 1, 16: 1, 24: 2, 32: 1, 48: 4, 96: 8}


def gcp_machine_gpus(instance_type: str) -> tuple[str, int] | None:
    """(GPU model, GPUs per node) of a GCP machine type with built-in GPUs, or None."""
    name = instance_type.strip().lower()
    for prefix, model in _GCP_FAMILIES:
        if name.startswith(prefix):
            m = re.match(r"(\d+)g\b", name[len(prefix) :])
            if m:
                return model, int(m.group(1))
    m = re.fullmatch(r"g2-standard-(\d+)", name)
    if m and int(m.group(1)) in _G2_L4:
        return "L4", _G2_L4[int(m.group(1))]
    return None


def memory_from_info(gpu_info: str, gpu_model: str) -> float:
    """GB per GPU: GpuInfo's SizeInMiB when present (GCP, AWS), else the table."""
    m = re.search(r"SizeInMiB'?\"?\s*:\s*(\d+)", gpu_info or "")
    if m:
        return round(int(m.group(1)) / 1024, 1)
    return float(GPU_MEMORY_GB.get(gpu_model, GPU_MEMORY_GB.get(gpu_model.upper(), 0.0)))
