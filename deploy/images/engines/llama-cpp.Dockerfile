# syntax=docker/dockerfile:1.7
# Fleet's llama.cpp image: llama.cpp's official CUDA server image, pinned to a release build,
# plus only what a Fleet replica pod needs (agent/runtime/kube_engine.py): a non-root user
# (the pod runs as 10001 with a read-only root filesystem), the model volume's mount point,
# `llama-server` on PATH (the official image keeps it in /app), labels.
#   docker build -f deploy/images/engines/llama-cpp.Dockerfile -t fleet-llama-cpp:0.1.0 deploy/images/engines
# Pin the base by digest in CI: --build-arg BASE_IMAGE=ghcr.io/ggml-org/llama.cpp:server-cuda12-b9603@sha256:...
# TLS (--ssl-cert-file, which Fleet passes with `security`) needs a build with OpenSSL: check
# `llama-server --help | grep ssl` on the pinned build before enabling security with it.
ARG BASE_IMAGE=ghcr.io/ggml-org/llama.cpp:server-cuda12-b9603

FROM ${BASE_IMAGE}
ARG FLEET_VERSION=0.1.0
LABEL org.opencontainers.image.title="fleet-llama-cpp" \
      org.opencontainers.image.version="${FLEET_VERSION}" \
      org.opencontainers.image.description="llama.cpp's llama-server as a Fleet replica (engine llama.cpp)" \
      dev.fleet.engine="llama.cpp"
RUN groupadd --gid 10001 fleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp fleet \
    && mkdir -p /models
ENV PATH=/app:$PATH \
    HOME=/tmp
USER 10001:10001
EXPOSE 8080
