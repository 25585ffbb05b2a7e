# syntax=docker/dockerfile:1.7
# The CUDA engine image: `python -m engine.server` on the CUDA build of the pinned torch,
# which brings its matching Triton (our kernels JIT-compile at first use: the runtime stage
# keeps a C compiler for Triton's launcher, and TRITON_CACHE_DIR is on the pod's /tmp).
#   docker build -f deploy/images/engine-cuda.Dockerfile -t fleet-engine-cuda:0.1.0 \
#     --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 --build-arg TORCH_CUDA=cu128 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"
WORKDIR /opt/fleet
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY control_plane ./control_plane
COPY engine ./engine
COPY kernels ./kernels
COPY fleet_base ./fleet_base
RUN pip install -e ".[engine]" && python -c "import torch, triton; print(torch.__version__, triton.__version__)"

FROM ${CUDA_IMAGE} AS runtime
ARG FLEET_VERSION=0.1.0
LABEL org.opencontainers.image.title="fleet-engine-cuda" \
      org.opencontainers.image.version="${FLEET_VERSION}"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 fleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp fleet
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/fleet /opt/fleet
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /opt/fleet
USER 10001:10001
EXPOSE 8000
CMD ["python", "-m", "engine.server", "--help"]
