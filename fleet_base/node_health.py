"""Node and GPU health on the wire: what an agent observed (faults), what it concluded (a
node's state) and what an operator asked for (cordon, uncordon).

A node is where replicas run: the host on the process and sim runtimes, a Kubernetes node
on that runtime. A fault is a node matter even when one GPU shows it: the node is cordoned
as a whole (its neighbours often follow or need the same maintenance), and the record keeps
which GPU said what. The policies (classification, the state machine) live in the agent;
this module is only the contract both sides read, torch-free and I/O-free.
"""

from __future__ import annotations

import platform
import re
import secrets
import time
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from fleet_base.bounds import Count, Timestamp

MAX_NODES = 4096
MAX_FAULTS = 256  # per heartbeat; a burst beyond it is summarised by the state's reason
MAX_EVIDENCE = 512

NODE_NAME_MAX = 253
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
NodeName = Annotated[str, Field(min_length=1, max_length=NODE_NAME_MAX, pattern=NODE_NAME_PATTERN)]


class NodeState(str, Enum):
    healthy = "healthy"
    suspect = "suspect"  # one fault that may pass: still serves, watched more closely
    cordoned = "cordoned"  # no new replicas; the ones there are moved away
    drained = "drained"  # cordoned and empty
    remediated = "remediated"  # an operator uncordoned it; healthy again after a clean probe
    retired = "retired"  # failed too often: stays out until an operator says otherwise


class FaultKind(str, Enum):
    xid = "xid"  # NVML XID event (the code is in the evidence)
    ecc_uncorrectable = "ecc_uncorrectable"
    retired_pages = "retired_pages"  # pending page retirement / row remapping failure
    thermal = "thermal"  # hardware slowdown or thermal throttling
    fell_off_bus = "fell_off_bus"  # NVML_ERROR_GPU_IS_LOST
    cuda_error = "cuda_error"  # the engine's fatal error was a device error
    oom = "oom"  # the engine ran out of memory: the request's or the config's fault, not the node's
    crash_loop = "crash_loop"  # replicas crashed repeatedly on the same GPU(s)
    stall = "stall"  # the stall detector saw the engine loop stop
    wrong_answer = "wrong_answer"  # the correctness probe got different tokens


class NodeFault(BaseModel):
    """One observation. Repeated in heartbeats for a while so one lost message does not
    lose it; `fault_id` makes storing it idempotent."""

    fault_id: str = Field(default_factory=lambda: secrets.token_hex(12), min_length=1, max_length=64)
    node: NodeName
    gpu: int | None = Field(None, ge=0, le=1023)  # None: the node as a whole
    kind: FaultKind
    at: Timestamp = Field(default_factory=time.time)
    evidence: str = Field("", max_length=MAX_EVIDENCE)
    replica_id: str | None = Field(None, max_length=128)
    deployment: str | None = Field(None, max_length=128)


class NodeHealth(BaseModel):
    """A node's state as its agent holds it, in every heartbeat."""

    node: NodeName
    state: NodeState = NodeState.healthy
    reason: str = Field("", max_length=MAX_EVIDENCE)
    since: Timestamp = Field(default_factory=time.time)
    gpus: Count = 0  # accelerators (or CPU replica slots) the node has
    gpus_withheld: list[int] = Field(default_factory=list, max_length=1024)
    cordoned_by: Literal["", "agent", "operator"] = ""
    faults: Count = 0  # faults the agent saw on it since it started
    # the NVML source's own status: "" when it reads, else why not ("no NVML on this host")
    nvml: str = Field("", max_length=MAX_EVIDENCE)


class NodeAction(BaseModel):
    """An operator's word on a node (`fleetctl nodes cordon|uncordon`), carried in the
    cluster's DesiredState. The agent applies each action once, in `at` order, so an
    uncordon after a fault's cordon clears it and an older one does not."""

    node: NodeName
    action: Literal["cordon", "uncordon"]
    at: Timestamp
    reason: str = Field("", max_length=MAX_EVIDENCE)


# XIDs a faulty application (or its teardown) raises, which clear with it: recorded, never
# the node's fault (NVIDIA's XID catalogue: 13, 31, 43, 45, 68). A fault of kind `xid`
# names its code in the evidence as "Xid <code>".
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
_XID_CODE = re.compile(r"\bxid\s*(\d+)", re.IGNORECASE)


def is_node_fault(kind: FaultKind | str, evidence: str = "") -> bool:
    """Whether a fault counts against its node (failure counts, placement's price): all
    but an out-of-memory and an application XID."""
    kind = FaultKind(kind)
    if kind == FaultKind.oom:
        return False
    if kind == FaultKind.xid:
        m = _XID_CODE.search(evidence)
        return not (m and int(m.group(1)) in APPLICATION_XIDS)
    return True


def local_node_name(configured: str = "", hostname: str | None = None) -> str:
    """The node name of this host on the process and sim runtimes: `configured`
    (ClusterConfig.node_name) when set, else the host name reduced to NodeName (characters
    outside it become "-", leading ones it cannot start with dropped), "localhost" if
    nothing is left. `platform.node()` is the host name (uname), without `socket`, so this
    contract module stays free of I/O libraries."""
    name = configured or (platform.node() if hostname is None else hostname)
    name = re.sub(r"[^A-Za-z0-9._\-]", "-", name)
    name = re.sub(r"^[^A-Za-z0-9]+", "", name)[:NODE_NAME_MAX]
    return name or "localhost"
