#!/usr/bin/env bash
# Fleet's main job on one machine: bring up a local fleet (nats-server, the control plane,
# an agent and a gateway per region), deploy SmolLM2-135M, send a streamed chat request
# through every region's gateway with the OpenAI SDK, show the fleet, and take it down.
# Installs what it needs first (idempotent). FLEET_HOME defaults to a fresh temp folder;
# FLEET_DEMO_KEEP=1 leaves the fleet running (stop it with `fleetctl down`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export FLEET_HOME="${FLEET_HOME:-$(mktemp -d -t fleet-home.XXXXXX)}"
fleetctl() { .venv/bin/python -m control_plane.cli "$@"; }
if [ "${FLEET_DEMO_KEEP:-0}" != 1 ]; then trap 'fleetctl down >/dev/null 2>&1 || true' EXIT; fi

echo "FLEET_HOME=$FLEET_HOME"
fleetctl up --detach --regions local-east,local-west --model smollm2-135m --name smollm2 \
  --replicas "${FLEET_DEMO_REPLICAS:-1}"
fleetctl status smollm2
.venv/bin/python - "$FLEET_HOME" <<'PY'
import json, sys, time
from pathlib import Path
from openai import OpenAI

home = Path(sys.argv[1])
key = (home / "local" / "inference-key").read_text().strip()
fleet = json.loads((home / "local" / "fleet.json").read_text())
gateways = [(p["name"], p["url"]) for p in fleet["processes"] if p["kind"] == "gateway"]
question = "In two sentences: why does a paged KV cache help an LLM server?"
for region, url in gateways:
    client = OpenAI(base_url=f"{url}/v1", api_key=key)
    print(f"\n[{region} gateway {url}] user> {question}\nassistant> ", end="", flush=True)
    t0, first = time.perf_counter(), None
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=64,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    total = time.perf_counter() - t0
    print(f"\n  {usage.completion_tokens} tokens, TTFT {1000 * ((first or t0) - t0):.0f} ms, "
          f"{total:.2f} s end to end")
PY
echo
fleetctl ps
