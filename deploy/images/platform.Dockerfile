# syntax=docker/dockerfile:1.7
# The slim platform image: control plane, agent and gateway, `fleetctl`. No torch: the
# base install (`pip install fleet[cli]`) is torch-free (tests/test_platform_install.py).
#   docker build -f deploy/images/platform.Dockerfile -t fleet-platform:0.1.0 .
# Pin the base by digest in CI: --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/fleet
COPY pyproject.toml README.md alembic.ini ./
COPY agent ./agent
COPY control_plane ./control_plane
COPY engine ./engine
COPY kernels ./kernels
COPY fleet_base ./fleet_base
COPY migrations ./migrations
# Editable, so Alembic finds migrations/ next to the packages (control_plane/db/session.py).
RUN pip install -e ".[cli]" \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE} AS runtime
ARG FLEET_VERSION=0.1.0
LABEL org.opencontainers.image.title="fleet-platform" \
      org.opencontainers.image.version="${FLEET_VERSION}" \
      org.opencontainers.image.description="Fleet control plane, agent and gateway (no torch)"
RUN groupadd --gid 10001 fleet && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp fleet
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/fleet /opt/fleet
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    FLEET_HOME=/var/lib/fleet
WORKDIR /opt/fleet
USER 10001:10001
EXPOSE 7070 9000
CMD ["fleetctl", "--help"]
