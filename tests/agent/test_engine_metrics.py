"""Other engines' /metrics read into Fleet's EngineSample. The texts here are STAND-INS written
in each engine's documented exposition (vLLM: docs.vllm.ai usage/metrics; SGLang:
docs.sglang.io references/production_metrics; llama.cpp: tools/server/README.md, `--metrics`),
not scrapes of running servers: none of those engines runs on this machine."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.replica_metrics import PROMPT_SAMPLE, EngineSample, LoadTracker, parse_metrics, prompt_sample
from fleet_base.bounds import MAX_TOKENS

M = 'model_name="meta-llama/Llama-3.1-70B-Instruct"'

# Stand-in: vLLM V1, two data-parallel engines (label `engine`), histograms trimmed to 3 buckets.
VLLM_V1 = f"""
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{M}}} 12.0
vllm:num_requests_running{{engine="1",{M}}} 10.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{M}}} 3.0
vllm:num_requests_waiting{{engine="1",{M}}} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.42
vllm:kv_cache_usage_perc{{engine="1",{M}}} 0.61
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",{M}}} 0.42
vllm:gpu_cache_usage_perc{{engine="1",{M}}} 0.61
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{M}}} 40000.0
vllm:prefix_cache_queries_total{{engine="1",{M}}} 10000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",{M}}} 30000.0
vllm:prefix_cache_hits_total{{engine="1",{M}}} 5000.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",{M}}} 50000.0
vllm:prompt_tokens_total{{engine="1",{M}}} 12000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",{M}}} 81234.0
vllm:generation_tokens_total{{engine="1",{M}}} 1000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",{M}}} 80.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",{M}}} 95.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{M}}} 100.0
vllm:time_to_first_token_seconds_count{{engine="0",{M}}} 100.0
vllm:time_to_first_token_seconds_sum{{engine="0",{M}}} 21.5
vllm:time_to_first_token_seconds_bucket{{engine="1",le="0.1",{M}}} 1.0
vllm:time_to_first_token_seconds_bucket{{engine="1",le="1.0",{M}}} 1.0
vllm:time_to_first_token_seconds_bucket{{engine="1",le="+Inf",{M}}} 2.0
vllm:time_to_first_token_seconds_count{{engine="1",{M}}} 2.0
vllm:time_to_first_token_seconds_sum{{engine="1",{M}}} 3.5
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.05",{M}}} 900.0
vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",{M}}} 1000.0
vllm:inter_token_latency_seconds_count{{engine="0",{M}}} 1000.0
vllm:inter_token_latency_seconds_sum{{engine="0",{M}}} 30.0
"""

# Stand-in: vLLM V0 names (before the kv_cache_usage_perc / inter_token_latency renames).
VLLM_V0 = f"""
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M}}} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{M}}} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{M}}} 0.9
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{{{M}}} 0.25
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{{le="+Inf",{M}}} 40.0
vllm:time_per_output_token_seconds_count{{{M}}} 40.0
vllm:time_per_output_token_seconds_sum{{{M}}} 2.0
"""

# Stand-in: SGLang with --enable-metrics (labels as its docs list them).
SG = 'engine_type="unified",model_name="Qwen/Qwen3-32B",pp_rank="0",tp_rank="0"'
SGLANG = f"""
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{{SG}}} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{{SG}}} 7.557572e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{{{SG}}} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{SG}}} 0.007507552643049313
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SG}}} 162.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{SG}}} 2826.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{{{SG}}} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{{le="0.001",{SG}}} 0.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",{SG}}} 11008.0
sglang:time_to_first_token_seconds_count{{{SG}}} 11008.0
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_sum{{{SG}}} 29846.5393948555
sglang:inter_token_latency_seconds_bucket{{le="+Inf",{SG}}} 7.557572e+06
sglang:inter_token_latency_seconds_count{{{SG}}} 7.557572e+06
"""

# Stand-in: llama-server --metrics (no labels; counters carry _total in their TYPE line).
LLAMACPP = """
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2.5
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 500
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 10
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 480
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 1.5
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 493.6
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 50
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 512
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""

# Fleet's own engine serves llm-d's model-server names next to its own: counted once.
FLEET_WITH_LLMD_NAMES = """
# TYPE fleet_engine_requests_running gauge
fleet_engine_requests_running{model="chat"} 3.0
# TYPE fleet_engine_requests_waiting gauge
fleet_engine_requests_waiting{model="chat"} 1.0
# TYPE fleet_engine_kv_cache_usage_ratio gauge
fleet_engine_kv_cache_usage_ratio{model="chat"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="chat"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="chat"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="chat"} 0.5
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            VLLM_V1,
            EngineSample(
                running=22,
                waiting=7,
                kv_cache_usage=0.61,  # the fullest engine; the deprecated duplicate is not added
                generation_tokens=82234,
                prompt_tokens=62000,
                ttft_sum=25.0,
                ttft_count=102,
                itl_sum=30.0,
                itl_count=1000,
                prefix_cache_hits=35000,
                prefix_cache_queries=50000,
            ),
            id="vllm-v1",
        ),
        pytest.param(
            VLLM_V0,
            EngineSample(
                running=5, kv_cache_usage=0.9, itl_sum=2.0, itl_count=40, prefix_cache_hit_rate=0.25
            ),
            id="vllm-v0",
        ),
        pytest.param(
            SGLANG,
            EngineSample(
                running=162,
                waiting=2826,
                kv_cache_usage=0.28,
                generation_tokens=7.557572e6,
                prompt_tokens=8.128902e6,
                ttft_sum=2.3518979474117756e6,
                ttft_count=11008,
                itl_sum=29846.5393948555,
                itl_count=7.557572e6,
                prefix_cache_hit_rate=0.007507552643049313,
            ),
            id="sglang",
        ),
        pytest.param(
            LLAMACPP,
            EngineSample(
                running=2,
                waiting=1,
                kv_cache_usage=0.125,
                generation_tokens=500,
                prompt_tokens=1234,
                itl_sum=10,
                itl_count=500,
            ),
            id="llama.cpp",
        ),
        pytest.param(
            FLEET_WITH_LLMD_NAMES, EngineSample(running=3, waiting=1, kv_cache_usage=0.5), id="fleet+llm-d"
        ),
    ],
)
def test_engine_series_read_into_engine_sample(text: str, expected: EngineSample) -> None:
    assert parse_metrics(text) == expected


def set_series(text: str, head: str, value: float) -> str:
    """`text` with the one sample line starting `head` set to `value`."""
    lines = text.splitlines()
    (i,) = [i for i, line in enumerate(lines) if line.startswith(head)]
    lines[i] = f"{lines[i].rsplit(' ', 1)[0]} {value}"
    return "\n".join(lines) + "\n"


def test_load_from_vllm_scrapes_feeds_the_autoscaler_fields() -> None:
    """Two vLLM scrapes a second apart become the ReplicaLoad the autoscaler and the
    spare-capacity gate read: rates from counters, mean TTFT of the requests that started."""
    t = LoadTracker(window_s=3.0)
    t.update(parse_metrics(VLLM_V1), 10.0)
    later = set_series(VLLM_V1, 'vllm:generation_tokens_total{engine="0"', 81534)
    later = set_series(later, 'vllm:prompt_tokens_total{engine="0"', 50600)
    later = set_series(later, 'vllm:time_to_first_token_seconds_count{engine="0"', 104)
    later = set_series(later, 'vllm:time_to_first_token_seconds_sum{engine="0"', 22.5)
    load = t.update(parse_metrics(later), 11.0)
    assert (load.running, load.waiting, load.kv_cache_usage) == (22, 7, 0.61)
    assert (load.tokens_per_s, load.prompt_tokens_per_s, load.requests_per_s) == (300.0, 600.0, 4.0)
    assert load.ttft_s == pytest.approx(0.25)


def render(prefix: str, running: float, waiting: float, usage: float, generated: float) -> str:
    names = {
        "vllm:": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
        "sglang:": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
        "llamacpp:": (
            "llamacpp:requests_processing",
            "llamacpp:requests_deferred",
            "llamacpp:kv_cache_usage_ratio",
        ),
    }[prefix]
    gen = {
        "vllm:": "vllm:generation_tokens",
        "sglang:": "sglang:generation_tokens",
        "llamacpp:": "llamacpp:tokens_predicted",
    }[prefix]
    lines = [f"# TYPE {n} gauge\n{n} {v!r}" for n, v in zip(names, (running, waiting, usage), strict=True)]
    lines.append(f"# TYPE {gen}_total counter\n{gen}_total {generated!r}")
    return "\n".join(lines) + "\n"


@given(
    prefix=st.sampled_from(["vllm:", "sglang:", "llamacpp:"]),
    running=st.integers(0, 10**6),
    waiting=st.integers(0, 10**7),
    usage=st.floats(0, 1),
    generated=st.integers(0, 2**53),
)
def test_any_engines_load_reads_back_exactly(prefix, running, waiting, usage, generated) -> None:
    sample = parse_metrics(render(prefix, float(running), float(waiting), usage, float(generated)))
    assert (sample.running, sample.waiting, sample.kv_cache_usage, sample.generation_tokens) == (
        running,
        waiting,
        usage,
        generated,
    )


def _prompt_histogram(name: str, lengths: list[int], labels: str = 'model_name="m"') -> str:
    """Prometheus text of a cumulative prompt-length histogram over `lengths`."""
    from fleet_base.metric_buckets import PROMPT_TOKEN_BUCKETS

    lines = [f"# TYPE {name} histogram"]
    for le in [*PROMPT_TOKEN_BUCKETS, float("inf")]:
        bound = "+Inf" if le == float("inf") else repr(le)
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {sum(1 for x in lengths if x <= le)}')
    lines.append(f"{name}_count{{{labels}}} {len(lengths)}")
    lines.append(f"{name}_sum{{{labels}}} {sum(lengths)}")
    return "\n".join(lines) + "\n"


def test_the_prompt_mix_comes_from_the_histograms_increments() -> None:
    """Two scrapes of vLLM's prompt-length histogram: the sample is spread like the requests
    counted between them (not the ones before), each at its bucket's middle."""
    t = LoadTracker(window_s=3.0)
    old = [100] * 50  # counted before the first scrape: not this window's mix
    t.update(parse_metrics(_prompt_histogram("vllm:request_prompt_tokens", old)), 10.0)
    new = [1000] * 6 + [8000] * 2
    load = t.update(parse_metrics(_prompt_histogram("vllm:request_prompt_tokens", old + new)), 11.0)
    assert sorted(load.prompt_sample) == [724] * 6 + [5793] * 2  # (512, 1024] and (4096, 8192]
    long = [20000] * 100  # more requests than a sample holds: evenly spaced quantiles
    load = t.update(parse_metrics(_prompt_histogram("vllm:request_prompt_tokens", old + new + long)), 12.0)
    assert len(load.prompt_sample) == PROMPT_SAMPLE and set(load.prompt_sample) <= {724, 5793, 23170}
    assert sum(1 for x in load.prompt_sample if x == 23170) == round(PROMPT_SAMPLE * 100 / 108)


def test_a_foreign_engines_histogram_is_not_read_as_fleets_and_a_restart_reports_none() -> None:
    text = _prompt_histogram("fleet_engine_request_prompt_tokens", [300, 300])
    assert parse_metrics(text, "vllm").prompt_buckets == ()
    assert parse_metrics(text).prompt_buckets[-1] == (float("inf"), 2.0)
    later = parse_metrics(_prompt_histogram("fleet_engine_request_prompt_tokens", [300]))  # went down
    assert prompt_sample(parse_metrics(text).prompt_buckets, later.prompt_buckets) == ()
    assert prompt_sample((), ()) == ()


def test_a_malformed_prompt_histogram_costs_the_mix_not_the_load() -> None:
    """A foreign engine's bad histogram (an unparsable or NaN bound, NaN or infinite counts, a
    bound beyond any context) never raises and never drops the replica's other figures."""
    bad = (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"
        "# TYPE vllm:request_prompt_tokens histogram\n"
        'vllm:request_prompt_tokens_bucket{le="abc"} 1\n'
        'vllm:request_prompt_tokens_bucket{le="NaN"} 1\n'
        'vllm:request_prompt_tokens_bucket{le="1e30"} 2\n'
        'vllm:request_prompt_tokens_bucket{le="+Inf"} 2\n'
    )
    t = LoadTracker(window_s=3.0)
    first = parse_metrics(bad)
    assert first.running == 3 and [le for le, _ in first.prompt_buckets] == [1e30, float("inf")]
    t.update(first, 0.0)
    load = t.update(parse_metrics(bad.replace("} 2\n", "} 5\n")), 1.0)
    assert load.running == 3 and load.prompt_sample and max(load.prompt_sample) <= MAX_TOKENS
    for count in ("NaN", "+Inf"):
        worse = bad.replace('le="+Inf"} 2', f'le="+Inf"}} {count}')
        assert prompt_sample(first.prompt_buckets, parse_metrics(worse).prompt_buckets) == ()
