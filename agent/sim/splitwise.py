"""Profiles from Splitwise's measured performance model (`splitwise_perf_model.csv`:
Llama2-70B / BLOOM-176B on A100-80GB / H100-80GB at tensor parallel 2/4/8, prompt sizes
128..8192, batch sizes 1..64, five repeats each).

- prefill: `prompt_time` (ms) of a batch of `batch_size` prompts of `prompt_size` tokens,
  keyed by the batch's total prompt tokens (median over repeats and equal totals);
- decode: `token_time` (ms per step) by `batch_size` (median over prompt sizes and repeats);
- KV capacity: the GPUs' memory at 90 % minus the weights and an activation reserve per
  GPU, over the KV bytes of one token (Llama2-70B: 80 layers x 8 KV heads x 128 x 2 x fp16).
- host-to-device bandwidth (for a host KV tier, `fleet_base.kv_tier_cost`): each GPU loads
  its own shard of a block over its own PCIe link, so the replica's is tp x one link's
  effective pinned-copy rate. No host tier is set: its size is a deployment's choice
  (`fleetctl simulate --kv-offloading-size`).

`python -m agent.sim.splitwise CSV` (re)writes the stored profiles."""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path

from fleet_base.profile import PROFILES_DIR, PerfProfile

GIB = 1 << 30
MODELS = {
    # weights bytes, KV bytes per token
    "llama2-70b": (138e9, 2 * 80 * 8 * 128 * 2),
    "bloom-176b": (352e9, 2 * 70 * 14336 * 2),
}
GPU_MEMORY = {"a100-80gb": 80 * GIB, "h100-80gb": 80 * GIB}
# On-demand price per GPU-hour used for costs (roughly the big clouds' list prices, 2024).
GPU_PRICE = {"a100-80gb": 3.67, "h100-80gb": 6.98}
# Effective pinned host-to-device copy per GPU: H100 SXM is PCIe Gen5 x16 (64 GB/s each way
# on paper, ~50 GB/s measured by cudaMemcpy bandwidth tests); A100 SXM is PCIe Gen4 x16
# (32 GB/s on paper, ~25 GB/s measured).
GPU_H2D_BYTES_PER_S = {"a100-80gb": 25e9, "h100-80gb": 50e9}
ACTIVATION_RESERVE = 2 * GIB
DEFAULT_COLD_START_S = 60.0
STORED = [("llama2-70b", "h100-80gb", 4), ("llama2-70b", "h100-80gb", 8), ("llama2-70b", "a100-80gb", 4)]


def kv_capacity(model: str, hardware: str, tp: int) -> int:
    weights, per_token = MODELS[model]
    free = tp * (0.9 * GPU_MEMORY[hardware] - ACTIVATION_RESERVE) - weights
    return max(1, int(free // per_token))


def profile_from_splitwise(csv_path: Path, model: str, hardware: str, tp: int) -> PerfProfile:
    prefill: dict[int, list[float]] = defaultdict(list)
    decode: dict[int, list[float]] = defaultdict(list)
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            if row["model"] != model or row["hardware"] != hardware or int(row["tensor_parallel"]) != tp:
                continue
            batch = int(row["batch_size"])
            prefill[int(row["prompt_size"]) * batch].append(float(row["prompt_time"]) / 1000)
            decode[batch].append(float(row["token_time"]) / 1000)
    if not prefill:
        raise ValueError(f"no rows for {model} on {hardware} at tensor parallel {tp} in {csv_path}")
    xs = sorted(prefill)
    bs = sorted(decode)
    hw = hardware.split("-")[0]
    return PerfProfile(
        name=f"{model}-{hw}-tp{tp}",
        description=f"{model} on {tp}x {hardware}, measured by Splitwise (perf_model.csv)",
        source="Mutinifni/splitwise-sim data/perf_model.csv (MIT); h2d_bytes_per_s: tp x one GPU's "
        "effective PCIe pinned copy (agent.sim.splitwise.GPU_H2D_BYTES_PER_S)",
        gpu_model=hw.upper(),
        gpus_per_replica=tp,
        hourly_price=round(GPU_PRICE[hardware] * tp, 2),
        prefill_tokens=[float(x) for x in xs],
        prefill_s=[round(statistics.median(prefill[x]), 5) for x in xs],
        decode_batch=[float(b) for b in bs],
        decode_step_s=[round(statistics.median(decode[b]), 5) for b in bs],
        kv_capacity_tokens=kv_capacity(model, hardware, tp),
        kv_bytes_per_token=MODELS[model][1],
        h2d_bytes_per_s=GPU_H2D_BYTES_PER_S[hardware] * tp,
        max_num_seqs=max(bs),
        cold_start_s=DEFAULT_COLD_START_S,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m agent.sim.splitwise", description=__doc__)
    p.add_argument("csv", type=Path)
    p.add_argument("--out", type=Path, default=PROFILES_DIR)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for model, hardware, tp in STORED:
        prof = profile_from_splitwise(args.csv, model, hardware, tp)
        (args.out / f"{prof.name}.json").write_text(prof.model_dump_json(indent=1) + "\n")
        print(f"wrote {args.out / prof.name}.json (kv {prof.kv_capacity_tokens} tokens)")


if __name__ == "__main__":
    main()
