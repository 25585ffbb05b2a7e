"""The NVML source: through its stand-in file (the library boundary), each XID handed out
once; without NVML it says so and yields nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.health.classify import classify_gpu
from agent.health.nvml import NvmlSource, write_standin
from agent.health.readings import GpuReading, XidEvent
from fleet_base.node_health import FaultKind


def test_standin_hands_out_each_xid_once(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    write_standin(path, [GpuReading(index=0), GpuReading(index=1, ecc_volatile_uncorrected=0)])
    src = NvmlSource(standin=str(path))
    first = src.read()
    assert [g.index for g in first] == [0, 1] and src.status == ""
    write_standin(
        path, [GpuReading(index=0), GpuReading(index=1, xids=[XidEvent(code=79)], ecc_volatile_uncorrected=2)]
    )
    second = src.read()
    assert second[1].xids == [XidEvent(code=79)]
    faults = [c.fault.kind for prev, cur in zip(first, second) for c in classify_gpu("n", prev, cur, 1.0)]
    assert faults == [FaultKind.fell_off_bus, FaultKind.ecc_uncorrectable]
    assert src.read()[1].xids == []  # seen already


def test_unreadable_standin_says_why(tmp_path: Path) -> None:
    src = NvmlSource(standin=str(tmp_path / "missing.json"))
    assert src.read() == [] and "unreadable" in src.status


def test_without_nvml_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    monkeypatch.delenv("FLEET_NVML_STANDIN", raising=False)
    src = NvmlSource()
    assert src.read() == [] and src.status.startswith("no NVML on this host")


def test_standin_path_per_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_NVML_STANDIN", str(tmp_path / "nvml-{cluster}.json"))
    write_standin(tmp_path / "nvml-east.json", [GpuReading(index=0, lost=True)])
    assert [g.lost for g in NvmlSource(cluster="east").read()] == [True]
    assert NvmlSource(cluster="west").read() == []
