# syntax=docker/dockerfile:1.7
# Fleet's vLLM image: vLLM's official OpenAI-server image, pinned, plus only what a Fleet
# replica pod needs (agent/runtime/kube_engine.py): a non-root user (the pod runs as 10001
# with a read-only root filesystem), the model volume's mount point, labels. The engine is
# vLLM's own build, untouched; the pod gives the full command (`vllm serve <path> ...`).
#   docker build -f deploy/images/engines/vllm.Dockerfile -t fleet-vllm:0.1.0 deploy/images/engines
# Pin the base by digest in CI: --build-arg BASE_IMAGE=vllm/vllm-openai:v0.12.0@sha256:...
ARG BASE_IMAGE=vllm/vllm-openai:v0.12.0

FROM ${BASE_IMAGE}
ARG FLEET_VERSION=0.1.0
LABEL org.opencontainers.image.title="fleet-vllm" \
      org.opencontainers.image.version="${FLEET_VERSION}" \
      org.opencontainers.image.description="vLLM's OpenAI server as a Fleet replica (engine vllm)" \
      dev.fleet.engine="vllm"
RUN groupadd --gid 10001 fleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp fleet \
    && mkdir -p /models
# HOME on the pod's /tmp scratch volume (vLLM's and Triton's caches); no usage stats sent home.
ENV HOME=/tmp \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
USER 10001:10001
# the OpenAI server; the ZMQ KV-event publisher (kubernetes.kv_events_port)
EXPOSE 8000 5557
