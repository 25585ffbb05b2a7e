"""A gateway's settings for batch and async inference (`ClusterConfig.batch`)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from fleet_base.batch.names import RESULT_TTL_S


class BatchConfig(BaseModel):
    enabled: bool = True
    # where file contents live: "" = the JetStream object store; "s3://bucket/prefix" (the
    # S3 client's usual environment: AWS_ENDPOINT_URL, credentials)
    store_url: str = ""
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)
    max_lines: int = Field(50_000, ge=1)
    # a worker's hold on a work item before it is handed to another worker; renewed
    # (`in_progress`) while the request runs, so it bounds only a dead worker's items
    ack_wait_s: float = Field(60.0, gt=0)
    # a driver's claim on a batch; renewed at a third of it, taken over when it lapses
    claim_s: float = Field(30.0, gt=0)
    # spare capacity: batch lines in flight per ready replica at most, and only while the
    # replica's engine has nobody waiting and its KV cache is below this fraction
    per_replica: int = Field(4, ge=0)
    max_kv_usage: float = Field(0.8, gt=0, le=1)
    # a line whose run fails (a 5xx past the gateway's own retries, or a 429) is run again
    # after a backoff from `line_backoff_s` (doubling, at most a minute), at most this many
    # times in all; then its failure is its result
    # (the default outlasts a replica's restart: about two minutes of tries)
    line_attempts: int = Field(8, ge=1)
    line_backoff_s: float = Field(1.0, gt=0)
    # webhook targets: hosts or CIDRs allowed even when private or loopback (SSRF guard)
    webhook_allow: list[str] = Field(default_factory=list)
    # an async request's max_time_in_queue_s when it names none, and the most it may name
    # (Baseten's defaults: 10 minutes, 72 hours); dispatching it later expires it
    async_queue_default_s: float = Field(600.0, gt=0)
    async_queue_max_s: float = Field(72 * 3600.0, gt=0)
    # an async result stays retrievable this long after it finished (delivered or not)
    result_retention_s: float = Field(7 * 24 * 3600.0, gt=0)
    # webhook retries: exponential backoff from `webhook_backoff_s`, capped, until this age
    webhook_backoff_s: float = Field(1.0, gt=0)
    webhook_backoff_max_s: float = Field(60.0, gt=0)
    webhook_give_up_s: float = Field(24 * 3600.0, gt=0)

    @field_validator("result_retention_s")
    @classmethod
    def _kept_by_the_bucket(cls, value: float) -> float:
        """The results and async buckets drop an entry `RESULT_TTL_S` after its last write,
        whatever a gateway states: a longer retention would promise results that are gone."""
        if value > RESULT_TTL_S:
            raise ValueError(
                f"result_retention_s must be at most {RESULT_TTL_S:.0f} (the results bucket's age)"
            )
        return value
