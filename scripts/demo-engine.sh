#!/usr/bin/env bash
# The engine alone: installs what it needs (idempotently), serves SmolLM2-135M, sends one chat
# request through the OpenAI SDK (streamed), prints the server's metrics summary, and stops.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
port="${FLEET_DEMO_PORT:-8000}"
log="$(mktemp -t fleet-engine.XXXXXX.log)"
.venv/bin/python -m engine.server --model smollm2-135m --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
echo "engine server pid $server on 127.0.0.1:$port (log: $log); waiting for /health ..."
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 $server 2>/dev/null; then echo "server exited:"; tail -n 30 "$log"; exit 1; fi
  sleep 0.5
done
.venv/bin/python - "$port" <<'PY'
import sys, time
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
question = "In two sentences: why does a paged KV cache help an LLM server?"
print(f"\nuser> {question}\nassistant> ", end="", flush=True)
t0, first, n = time.perf_counter(), None, 0
stream = client.chat.completions.create(
    model="smollm2-135m", messages=[{"role": "user", "content": question}],
    max_tokens=96, temperature=0, stream=True, stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        first = first or time.perf_counter()
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        usage = chunk.usage
total = time.perf_counter() - t0
print(f"\n\n{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens; "
      f"TTFT {1000 * ((first or t0) - t0):.0f} ms, {usage.completion_tokens / total:.1f} tokens/s end to end")
PY
echo
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^fleet_engine_(requests_total|generation_tokens_total|prompt_tokens_total)' || true
