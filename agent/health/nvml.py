"""The NVML source: each GPU's health counters and XID events, read through NVIDIA's
bindings (`nvidia-ml-py`, imported as `pynvml`).

On a host without NVML (no driver, no GPU, the bindings missing) the source says so once
(`status`, which the node's health reports as `nvml`) and yields nothing.

STAND-IN: with `FLEET_NVML_STANDIN=/path/to/file.json` set, the source does not call
pynvml; it reads that file, which describes what the pynvml calls would return:

    {"gpus": [{"index": 0, "uuid": "GPU-0", "lost": false, "xids": [{"code": 79}],
               "ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 0,
               "retired_pages_pending": false, "remap_failure": false,
               "throttle_reasons": 0, "temperature_c": 40}]}

A `{cluster}` in the path is replaced by the agent's cluster id, so the agents of a local
fleet on one host each read their own file. `xids` there is the whole history (a test appends to it); the source hands out each event
once, as NVML's event set does. It exists for tests and live demos on machines without
GPUs, and is never used unless the variable is set.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from agent.health.readings import GpuReading, XidEvent

log = logging.getLogger(__name__)

STANDIN_ENV = "FLEET_NVML_STANDIN"


class StandinFile(BaseModel):
    gpus: list[GpuReading] = Field(default_factory=list, max_length=1024)


class NvmlSource:
    """`read()` -> this host's GPUs now; `status` is "" while it reads, else why not."""

    def __init__(self, standin: str | None = None, cluster: str = "") -> None:
        standin = standin if standin is not None else os.environ.get(STANDIN_ENV, "")
        self.standin = standin.replace("{cluster}", cluster)
        self.status = ""
        self._nvml: Any = None
        self._events: Any = None
        self._seen_xids: dict[int, int] = {}  # stand-in: events handed out per GPU
        self._said = False

    def read(self) -> list[GpuReading]:
        """Blocking (NVML calls, a file): run it off the event loop."""
        if self.standin:
            return self._read_standin(Path(self.standin))
        if self._nvml is None and not self._start():
            return []
        return self._read_nvml()

    def gpu_count(self) -> int:
        return len(self.read()) if self.standin else self._count()

    # ------------------------------------------------------------ the stand-in

    def _read_standin(self, path: Path) -> list[GpuReading]:
        try:
            described = StandinFile.model_validate_json(path.read_bytes())
        except (OSError, ValidationError, ValueError) as err:
            self._unavailable(f"NVML stand-in {path} unreadable: {err}".splitlines()[0])
            return []
        self.status = ""
        out = []
        for gpu in described.gpus:
            seen = self._seen_xids.get(gpu.index, 0)
            self._seen_xids[gpu.index] = len(gpu.xids)
            out.append(gpu.model_copy(update={"xids": gpu.xids[seen:]}))
        return out

    # ------------------------------------------------------------ NVML itself

    def _unavailable(self, why: str) -> None:
        if not self._said or why != self.status:
            log.info("GPU health: %s", why)
            self._said = True
        self.status = why

    def _start(self) -> bool:
        try:
            import pynvml
        except ImportError:
            self._unavailable("no NVML: nvidia-ml-py is not installed")
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            self._unavailable(f"no NVML on this host ({err})")
            return False
        self._nvml = pynvml
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    pynvml.nvmlDeviceRegisterEvents(
                        handle, pynvml.nvmlEventTypeXidCriticalError, self._events
                    )
                except pynvml.NVMLError as err:
                    log.info("GPU %d: XID events not available (%s)", i, err)
        except pynvml.NVMLError as err:
            log.info("NVML events not available (%s)", err)
            self._events = None
        self.status = ""
        return True

    def _count(self) -> int:
        if self._nvml is None and not self._start():
            return 0
        try:
            return int(self._nvml.nvmlDeviceGetCount())
        except self._nvml.NVMLError:
            return 0

    def _read_nvml(self) -> list[GpuReading]:
        nv = self._nvml
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as err:
            self._unavailable(f"NVML stopped answering ({err})")
            return []
        xids = self._drain_xids()
        return [self._read_gpu(i, xids.get(i, [])) for i in range(count)]

    def _drain_xids(self) -> dict[int, list[XidEvent]]:
        nv, out = self._nvml, {}
        if self._events is None:
            return out
        for _ in range(256):  # bounded: a storm is summarised by the faults it caused
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:  # NVMLError_Timeout: nothing waiting
                break
            try:
                index = nv.nvmlDeviceGetIndex(data.device)
            except nv.NVMLError:
                index = 0
            out.setdefault(index, []).append(XidEvent(code=int(data.eventData)))
        return out

    def _read_gpu(self, index: int, xids: list[XidEvent]) -> GpuReading:
        nv = self._nvml
        reading: dict[str, Any] = {"index": index, "xids": xids}
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            reading["uuid"] = str(nv.nvmlDeviceGetUUID(handle))
        except nv.NVMLError_GpuIsLost:
            return GpuReading(index=index, lost=True, xids=xids)
        except nv.NVMLError:
            return GpuReading(**reading)

        def ask(field: str, call: Any, *args: Any) -> None:
            try:
                reading[field] = call(handle, *args)
            except nv.NVMLError_GpuIsLost:
                reading["lost"] = True
            except nv.NVMLError:  # not supported on this GPU (e.g. no ECC): left unknown
                pass

        err, volatile, aggregate = (
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nv.NVML_VOLATILE_ECC,
            nv.NVML_AGGREGATE_ECC,
        )
        ask("ecc_volatile_uncorrected", nv.nvmlDeviceGetTotalEccErrors, err, volatile)
        ask("ecc_aggregate_uncorrected", nv.nvmlDeviceGetTotalEccErrors, err, aggregate)
        ask("temperature_c", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        ask("throttle_reasons", nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        try:
            pending = nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)
            reading["retired_pages_pending"] = pending == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError:
            pass
        try:  # (corrected rows, uncorrected rows, pending, failure)
            rows = nv.nvmlDeviceGetRemappedRows(handle)
            reading["remap_failure"] = bool(rows[3])
            if rows[2]:
                reading["retired_pages_pending"] = True
        except nv.NVMLError:
            pass
        return GpuReading(**reading)


def write_standin(path: Path, gpus: list[GpuReading]) -> None:
    """Write a stand-in file (tests): what the pynvml calls would return."""
    path.write_text(json.dumps(StandinFile(gpus=gpus).model_dump(mode="json"), indent=1))
