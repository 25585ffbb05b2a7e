"""What an NVML read of one GPU returns (the real library or its stand-in), as the
classifier reads it. Counters are cumulative; `xids` are the events that arrived since
the previous read (NVML's event set hands each one out once)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class XidEvent(BaseModel):
    code: int = Field(ge=0)
    at: float | None = None


class GpuReading(BaseModel):
    index: int = Field(ge=0, le=1023)
    uuid: str = ""
    # NVML_ERROR_GPU_IS_LOST on any call: the GPU has fallen off the bus
    lost: bool = False
    xids: list[XidEvent] = Field(default_factory=list)
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remap_failure: bool | None = None
    # nvmlDeviceGetCurrentClocksThrottleReasons bitmask
    throttle_reasons: int = 0
    temperature_c: float | None = None
