"""Histogram buckets of the engine's request metrics: one home, so the simulated replica and
the engine export the same series and dashboards read both runtimes alike."""

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Prompt lengths in tokens, doubling: the autoscaler reads the mix of prompt lengths from
# this histogram's increments (agent.replica_metrics), so its buckets bound that precision.
PROMPT_TOKEN_BUCKETS = tuple(float(16 << i) for i in range(15))  # 16 .. 262144
