"""The node state machine: faults, the node's replicas and operators' actions -> its state.

    healthy -> suspect -> cordoned -> drained -> (remediated | retired)

- a severe fault (agent.health.classify) cordons the node at once; a soft one makes it
  suspect, and `soft_faults_to_cordon` of them within `soft_window_s` cordon it; a suspect
  node with no soft fault for `quiet_s` is healthy again.
- cordoned by the agent `flap_cordons` times within `flap_window_s`: retired (it keeps
  failing after each repair; it stays out until an operator uncordons it).
- a cordoned node with no replicas left is drained.
- operators' actions (`NodeAction`) apply once each, in `at` order: cordon (any state but
  retired) cordons it; uncordon makes a cordoned, drained or retired node remediated,
  which is healthy again after a clean correctness probe or `quiet_s` without faults (a
  fault meanwhile counts as usual).
- faults of severity none (an out-of-memory, an application XID) are counted only.

Pure and synchronous: the caller passes `now` and what it observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.health.classify import Classified, Severity
from fleet_base.cluster_config import HealthConfig
from fleet_base.node_health import NodeAction, NodeHealth, NodeState

OUT = (NodeState.cordoned, NodeState.drained, NodeState.retired)


@dataclass(frozen=True)
class Transition:
    node: str
    old: NodeState
    new: NodeState
    reason: str
    at: float


@dataclass
class NodePolicy:
    """One node's state and what it remembers to decide the next."""

    node: str
    settings: HealthConfig
    gpus: int = 0
    state: NodeState = NodeState.healthy
    reason: str = ""
    since: float = 0.0
    cordoned_by: str = ""
    faults: int = 0
    soft_at: list[float] = field(default_factory=list)
    agent_cordons_at: list[float] = field(default_factory=list)
    last_fault_at: float | None = None
    last_action_at: float = 0.0
    _out: list[Transition] = field(default_factory=list, repr=False)
    _now: float = field(default=0.0, repr=False)

    def health(self, nvml: str = "") -> NodeHealth:
        withheld = list(range(self.gpus)) if self.state in OUT else []
        return NodeHealth(
            node=self.node,
            state=self.state,
            reason=self.reason[:512],
            since=self.since,
            gpus=self.gpus,
            gpus_withheld=withheld,
            cordoned_by=self.cordoned_by,  # type: ignore[arg-type]
            faults=self.faults,
            nvml=nvml[:512],
        )

    @property
    def withheld(self) -> bool:
        return self.state in OUT

    def step(
        self,
        now: float,
        faults: list[Classified],
        replicas_on_node: int,
        actions: Sequence[NodeAction] = (),
        clean_probe: bool = False,
    ) -> tuple[NodeHealth, list[Transition]]:
        self._out = []
        self._now = now
        self._actions(actions)
        self._faults(faults)
        self._settle(replicas_on_node, clean_probe)
        return self.health(), self._out

    def _move(self, new: NodeState, reason: str) -> None:
        if new == self.state and reason == self.reason:
            return
        self._out.append(Transition(self.node, self.state, new, reason, self._now))
        if new != self.state:
            self.since = self._now
        self.state, self.reason = new, reason

    def _actions(self, actions: Sequence[NodeAction]) -> None:
        for action in sorted((a for a in actions if a.node == self.node), key=lambda a: a.at):
            if action.at <= self.last_action_at:
                continue
            self.last_action_at = action.at
            why = f": {action.reason}" if action.reason else ""
            if action.action == "cordon" and self.state not in OUT:
                self.cordoned_by = "operator"
                self._move(NodeState.cordoned, f"cordoned by an operator{why}")
            elif action.action == "uncordon" and self.state in OUT:
                self.cordoned_by = ""
                self.soft_at.clear()  # the flap record stays: it is what retires a node
                self._move(NodeState.remediated, f"uncordoned by an operator{why}")

    def _faults(self, faults: list[Classified]) -> None:
        s, now = self.settings, self._now
        for c in sorted(faults, key=lambda c: c.fault.at):
            self.faults += 1
            if c.severity == Severity.none:
                continue
            self.last_fault_at = now
            what = c.fault.kind.value + (f" on GPU {c.fault.gpu}" if c.fault.gpu is not None else "")
            what += f": {c.fault.evidence}" if c.fault.evidence else ""
            if self.state in OUT:
                continue
            if c.severity == Severity.soft:
                self.soft_at = [t for t in self.soft_at if now - t <= s.soft_window_s] + [now]
                if len(self.soft_at) < s.soft_faults_to_cordon:
                    self._move(
                        NodeState.suspect, f"{what} ({len(self.soft_at)} of {s.soft_faults_to_cordon})"
                    )
                    continue
                what = f"{len(self.soft_at)} faults within {s.soft_window_s:.0f} s, the last {what}"
            self._cordon(what)

    def _cordon(self, what: str) -> None:
        s, now = self.settings, self._now
        self.soft_at.clear()
        self.cordoned_by = "agent"
        self.agent_cordons_at = [t for t in self.agent_cordons_at if now - t <= s.flap_window_s] + [now]
        if len(self.agent_cordons_at) >= s.flap_cordons:
            n = len(self.agent_cordons_at)
            self._move(
                NodeState.retired, f"cordoned {n} times within {s.flap_window_s:.0f} s; the last: {what}"
            )
        else:
            self._move(NodeState.cordoned, what)

    def _settle(self, replicas_on_node: int, clean_probe: bool) -> None:
        s, now = self.settings, self._now
        if self.state == NodeState.suspect and (not self.soft_at or now - self.soft_at[-1] >= s.quiet_s):
            self.soft_at.clear()
            self._move(NodeState.healthy, f"no fault for {s.quiet_s:.0f} s")
        elif self.state == NodeState.remediated and (
            clean_probe or now - max(self.since, self.last_fault_at or 0.0) >= s.quiet_s
        ):
            self._move(
                NodeState.healthy,
                "a clean probe after remediation" if clean_probe else "quiet after remediation",
            )
        if self.state == NodeState.cordoned and replicas_on_node == 0:
            self._move(NodeState.drained, f"no replicas left; {self.reason}"[:512])
