"""Performance profiles: measured timing of one replica as data (JSON in `profiles/`).

A profile is a few curves, linearly interpolated (and extrapolated past the last point
along the last segment, never below zero): prefill time by the number of prompt tokens in
one prefill batch, and decode step time by the number of sequences in the batch. Plus the
KV token capacity and the batch limit that bound concurrency, a cold-start time, and an
optional error rate (to simulate a bad version).

A host-memory KV tier below the device pool (the engine's `--kv-offloading-size`) is
`host_kv_bytes` (0: none) loaded back at `h2d_bytes_per_s`; `kv_bytes_per_token` turns
both into tokens and seconds (`fleet_base.kv_tier_cost` values a host hit with them)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
# Host-to-device copy bandwidth when a profile does not say: below the ~12 GB/s a pinned copy
# reaches over PCIe Gen3 x16, so an unmeasured host tier is never valued above what it does.
DEFAULT_H2D_BYTES_PER_S = 8e9


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points; linear past both ends, floored at 0."""
    if len(xs) == 1:
        return max(0.0, ys[0])
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class PerfProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    description: str = ""
    source: str = ""
    gpu_model: str = "sim"
    gpus_per_replica: int = Field(1, ge=1)
    hourly_price: float = Field(0.0, ge=0, description="per replica (all its GPUs)")
    # Prefill: seconds to process one batch of N prompt tokens.
    prefill_tokens: list[float] = Field(min_length=1)
    prefill_s: list[float] = Field(min_length=1)
    # Decode: seconds per step (one token for every running sequence) by batch size.
    decode_batch: list[float] = Field(min_length=1)
    decode_step_s: list[float] = Field(min_length=1)
    kv_capacity_tokens: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_prefill_tokens: int = Field(8192, ge=1, description="prompt tokens admitted per prefill batch")
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description=(
            "a prompt needing more new prefill tokens than this is long: one at a time, at most this"
            " many of a step's tokens while shorter prompts wait (the engine's flag); 0: off"
        ),
    )
    cold_start_s: float = Field(0.0, ge=0)
    error_rate: float = Field(0.0, ge=0, le=1)
    # KV bytes of one token over the whole replica (all layers, K and V, every GPU's share).
    kv_bytes_per_token: int = Field(0, ge=0, description="0: unknown (then no host tier)")
    host_kv_bytes: int = Field(0, ge=0, description="host-memory KV tier per replica; 0: none")
    h2d_bytes_per_s: float = Field(
        DEFAULT_H2D_BYTES_PER_S, gt=0, description="host-to-device copy, whole replica"
    )

    @model_validator(mode="after")
    def _curves(self) -> PerfProfile:
        for xs, ys, what in (
            (self.prefill_tokens, self.prefill_s, "prefill"),
            (self.decode_batch, self.decode_step_s, "decode"),
        ):
            if len(xs) != len(ys):
                raise ValueError(f"{what}: x and y lists differ in length")
            if any(b <= a for a, b in itertools.pairwise(xs)):
                raise ValueError(f"{what}: x values must increase")
            if any(y < 0 for y in ys):
                raise ValueError(f"{what}: times must be >= 0")
        if self.host_kv_bytes and not self.kv_bytes_per_token:
            raise ValueError("a host KV tier needs kv_bytes_per_token")
        if self.long_prefill_token_threshold >= self.max_prefill_tokens:
            raise ValueError("long_prefill_token_threshold must be below max_prefill_tokens (or 0)")
        return self

    @property
    def host_kv_tokens(self) -> int:
        """Tokens the host tier holds (0: no host tier)."""
        return self.host_kv_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else 0

    def prefill_time(self, tokens: float) -> float:
        return interpolate(self.prefill_tokens, self.prefill_s, tokens)

    def decode_time(self, batch: float) -> float:
        return interpolate(self.decode_batch, self.decode_step_s, batch)


def list_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json"))


def load_profile(name_or_path: str | Path, directory: Path = PROFILES_DIR) -> PerfProfile:
    """A stored profile by name (`profiles/<name>.json`) or a path to a JSON file."""
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.exists():
        path = directory / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(
            f"unknown profile {str(name_or_path)!r}; known: {', '.join(list_profiles(directory))}"
        )
    return PerfProfile.model_validate_json(path.read_text())
