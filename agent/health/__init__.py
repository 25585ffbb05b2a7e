"""Node and GPU health: classify signals into faults, run each node's state machine, read
NVML, probe replicas for correct answers, and wire it into the agent (monitor)."""
