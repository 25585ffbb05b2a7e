"""The capacity pools this cluster offers: declared in cluster.yaml, else the GPUs that
`nvidia-smi` reports (one pool per GPU model), else one pool of CPU replica slots so the
same placement flow runs on a machine without accelerators. torch is not needed."""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import shutil
import subprocess
from collections import defaultdict

from fleet_base.cluster_config import ClusterConfig
from fleet_base.domain import Tier
from fleet_base.protocol import PoolInventory

log = logging.getLogger(__name__)

NVIDIA_SMI_QUERY = ["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(text: str) -> list[tuple[str, float]]:
    """(model, memory GiB) per GPU from `nvidia-smi --query-gpu=name,memory.total --format=csv`
    output, with or without header and units ("81559 MiB" or "81559")."""
    gpus: list[tuple[str, float]] = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 2:
            continue
        name, mem = row[0].strip(), row[1].strip()
        if not name or name.lower() == "name":
            continue
        number = re.match(r"[\d.]+", mem)
        mib = float(number.group()) if number else 0.0
        gpus.append((name.removeprefix("NVIDIA ").strip(), round(mib / 1024, 1)))
    return gpus


def gpu_pools(gpus: list[tuple[str, float]]) -> list[PoolInventory]:
    """One pool per GPU model: gpus_per_node = how many of that model this host has."""
    by_model: dict[str, list[float]] = defaultdict(list)
    for model, mem in gpus:
        by_model[model].append(mem)
    pools = []
    for model in sorted(by_model):
        mems = by_model[model]
        slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "gpu"
        pools.append(
            PoolInventory(
                name=f"gpu-{slug}",
                gpu_model=model,
                gpu_memory_gb=min(mems),
                gpus_per_node=len(mems),
                nodes=1,
            )
        )
    return pools


def detect_gpus(timeout_s: float = 10.0) -> list[tuple[str, float]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout_s, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("nvidia-smi failed (%s); offering CPU slots", err)
        return []
    return parse_nvidia_smi(out)


def gpu_indices(env: dict[str, str] | None = None) -> list[int]:
    """This host's GPU indices as nvidia-smi numbers them, for assigning devices to local
    replicas; within the agent's own CUDA_VISIBLE_DEVICES when that names indices. [] on a
    host without GPUs."""
    detected = range(len(detect_gpus()))
    allowed = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if allowed is None:
        return list(detected)
    items = [item.strip() for item in allowed.split(",") if item.strip()]
    if not all(item.isdigit() for item in items):
        return list(detected)
    return [i for i in detected if str(i) in items]


def cpu_pool(config: ClusterConfig) -> PoolInventory:
    return PoolInventory(
        name="cpu",
        gpu_model="cpu",
        gpus_per_node=config.cpu_slots,
        nodes=1,
        tier=Tier.reserved,
        hourly_price=0.0,
    )


def inventory(config: ClusterConfig) -> list[PoolInventory]:
    """Declared pools win; else detected GPUs; else CPU slots."""
    if config.pools:
        return list(config.pools)
    pools = gpu_pools(detect_gpus())
    return pools or [cpu_pool(config)]
