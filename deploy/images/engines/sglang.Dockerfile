# syntax=docker/dockerfile:1.7
# Fleet's SGLang image: SGLang's official image (the last CUDA 12 line, like our engine's
# cu128 image), pinned, plus only what a Fleet replica pod needs (agent/runtime/kube_engine.py):
# a non-root user (the pod runs as 10001 with a read-only root filesystem), the model volume's
# mount point, labels. The pod gives the full command (`python3 -m sglang.launch_server ...`).
#   docker build -f deploy/images/engines/sglang.Dockerfile -t fleet-sglang:0.1.0 deploy/images/engines
# Pin the base by digest in CI: --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.19-cu129@sha256:...
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.19-cu129

FROM ${BASE_IMAGE}
ARG FLEET_VERSION=0.1.0
LABEL org.opencontainers.image.title="fleet-sglang" \
      org.opencontainers.image.version="${FLEET_VERSION}" \
      org.opencontainers.image.description="SGLang's server as a Fleet replica (engine sglang)" \
      dev.fleet.engine="sglang"
RUN groupadd --gid 10001 fleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp fleet \
    && mkdir -p /models
# HOME on the pod's /tmp scratch volume (FlashInfer's and Triton's JIT caches).
ENV HOME=/tmp
USER 10001:10001
# the server (Fleet starts it on kubernetes.port); the ZMQ KV-event publisher
EXPOSE 30000 5557
